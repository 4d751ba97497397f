"""train.task dpo in the planner: `parallel: auto` never picks pipeline or context parallelism (the trainer runs
preference tuning in one process, on FSDP2 and TP), and the step time counts both rows of every pair and, with
LoRA, the reference's no-grad forward (spec/preference.step_factor), so the nights and the cost hold."""

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


@pytest.mark.parametrize(
    ("lora", "preference", "factor"),
    [
        ({"rank": 16}, None, 3.0),  # two rows a pair, plus the base's forward of both (half a LoRA step)
        ({"rank": 16}, {"loss": "simpo"}, 2.0),  # reference-free
        (None, {"reference": "precomputed"}, 2.0),  # the one pass before training is not per step
    ],
)
def test_step_time_counts_both_rows_and_the_reference(lora, preference, factor):
    layout = {"tp": 8, "dp_shard": -1, "micro_batch": 1}
    sft = plan_for_spec(_spec(8, 4096, 64, layout, task="sft", lora=lora), require_fit=False).chosen
    dpo = _spec(8, 4096, 64, layout, task="dpo", lora=lora, preference=preference)
    dpo = plan_for_spec(dpo, require_fit=False).chosen
    assert dpo.step_time_s == pytest.approx(factor * sft.step_time_s)
