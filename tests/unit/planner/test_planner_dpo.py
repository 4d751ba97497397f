"""train.task dpo in the planner: `parallel: auto` never picks pipeline or context parallelism (the trainer runs
preference tuning in one process, on FSDP2 and TP). Its memory and step time (both rows of every pair, the
reference): test_planner_dpo_cost.py."""

from __future__ import annotations

import pytest

from nightloom.planner import plan_for_spec
from nightloom.spec import RunSpec


def _spec(nodes: int, seq: int, batch: int, parallel="auto", **train) -> RunSpec:
    cluster = {"nodes": nodes, "gpus_per_node": 8, "gpu_type": "h100-80gb"}
    train = {"seq_len": seq, "global_batch": batch, **train}
    data = {"name": "p", "dataset": {"path": "d"}, "model": {"name": "llama3.1-405b"}, "cluster": cluster}
    return RunSpec.model_validate({**data, "train": train, "parallel": parallel})


def test_auto_never_picks_pipeline_or_context_parallel_for_dpo():
    """Llama 3.1 405B at 32k tokens on 128 H100: 8 sequences need CP or PP, which dpo refuses (an error before
    any rental); with 64 pairs it plans neither."""
    from nightloom.planner import PlanError

    pretrain = plan_for_spec(_spec(16, 32768, 8), require_fit=False).chosen
    assert pretrain.cp > 1 or pretrain.pp > 1, pretrain.layout()
    with pytest.raises(PlanError, match="global batch 8 is not divisible by dp"):
        plan_for_spec(_spec(16, 32768, 8, task="dpo"), require_fit=False)
    chosen = plan_for_spec(_spec(16, 32768, 64, task="dpo"), require_fit=False).chosen
    assert chosen.pp == 1 and chosen.cp == 1, chosen.layout()
