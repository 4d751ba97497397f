"""The prepare step (tokenize + pack, once before launch) is a function of the run's seed: xtuner shuffles before
packing with datasets' unseeded `shuffle()`, which draws from numpy's global RNG, so the wrapper seeds it."""

from __future__ import annotations

from nightloom.finetune.run import prepare_data
from nightloom.finetune.xtuner_plan import plan_xtuner
from tests.support.xtuner_data import alpaca_rows, make_spec, write_shards


def _packed(xtuner_env, base_model, shards, run_dir, seed: int) -> list[list[int]]:
    from datasets import load_from_disk

    spec = make_spec(run_dir, base_model, shards)
    spec = spec.model_copy(update={"train": spec.train.model_copy(update={"seed": seed})})
    plan = plan_xtuner(spec, shards, run_dir, world_size=1, env=xtuner_env, peak_flops=1e9, log=lambda s: None)
    assert prepare_data(plan, log=lambda s: None)["rows"] > 0
    return load_from_disk(plan.processed_dir)["input_ids"]


def test_prepare_packs_the_same_samples_in_the_same_order_for_one_seed(xtuner_env, base_model, tmp_path):
    shards = write_shards(tmp_path / "shards", alpaca_rows(48))
    first = _packed(xtuner_env, base_model, shards, tmp_path / "a", seed=7)
    again = _packed(xtuner_env, base_model, shards, tmp_path / "b", seed=7)
    other = _packed(xtuner_env, base_model, shards, tmp_path / "c", seed=8)
    assert len(first) > 1 and first == again  # before: each prepare packed in another order
    assert other != first and sum(map(len, other)) == sum(map(len, first))  # the same tokens, another order
