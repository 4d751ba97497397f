"""Mixture-of-experts checkpoints no one here trained (random ones transformers writes in the Hub's per-expert
layout) through `nightloom run` with expert parallelism (EP2 on 2 processes: each rank holds half the experts;
EP2 x FSDP2 on 4: experts over 2 ranks, sharded over the other 2), 2 steps at a negligible learning rate with a
BPE tokenizer folder, then `nightloom eval RUN --data eval.jsonl --seq-len 256 --json`: the mean NLL equals
transformers' on the original checkpoint within 1e-4, and so does the run's export (per-expert layout, reloaded by
transformers). qwen3_moe with a dense first layer; mixtral."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.hf_runs import (
    SEQ,
    TOL,
    bpe_tokenizer,
    continue_pretrain_spec,
    eval_data,
    nightloom_eval,
    run_two_steps,
    transformers_nll,
)

BASE = {
    "vocab_size": 320,  # >= the BPE's 300 ids
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}
MODELS = {
    "qwen3_moe": {
        "intermediate_size": 96,
        "moe_intermediate_size": 48,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "mlp_only_layers": [0],
        "norm_topk_prob": True,
        "head_dim": 16,
    },
    "mixtral": {"intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2},
}
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
#: (model, parallel, ranks): EP2 on 2 ranks; EP2 on 4 ranks (experts over 2, their FSDP2 over the other 2)
CASES = {
    "qwen3_moe/ep2": ("qwen3_moe", {"dp_shard": 2, "ep": 2}, 2),
    "mixtral/ep2": ("mixtral", {"dp_shard": 2, "ep": 2}, 2),
    "qwen3_moe/ep2_fsdp4": ("qwen3_moe", {"dp_shard": 4, "ep": 2}, 4),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_run_under_ep_then_eval_equals_transformers(prefect_backend, tmp_path, case):
    from nightloom.hf.random_model import build_random_model

    arch, parallel, ranks = CASES[case]
    data = eval_data(tmp_path, f"{arch} experts")
    tokenizer = bpe_tokenizer(tmp_path, data.corpus)
    weights = build_random_model(
        tmp_path / arch, arch, seed=11, max_shard_size="200KB", norm_std=0.3, **BASE, **MODELS[arch]
    )
    spec = continue_pretrain_spec(
        tmp_path,
        weights,
        tokenizer,
        data.corpus,
        tmp_path / "shards",
        parallel=parallel,
        cluster={"gpus_per_node": ranks},
    )

    summary = run_two_steps(spec)
    run_dir = Path(summary["run_dir"])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(len(m["expert_tokens"]) == (8 if arch == "qwen3_moe" else 4) for m in metrics), metrics
    ours = nightloom_eval(run_dir, data.eval_data)
    ref, tokens = transformers_nll(weights, tokenizer, data.docs)
    print(f"{case} run: nightloom eval {ours['loss']:.8f}, transformers {ref:.8f} ({tokens} tokens)")
    assert ours["step"] == 2 and ours["tokens"] == tokens and tokens > 6 * (SEQ - 1)
    assert abs(ours["loss"] - ref) < TOL, (ours["loss"], ref)
    export = Path(summary["export_dir"])
    assert json.loads((export / "config.json").read_text())["architectures"] == [ARCHITECTURES[arch]]
    exported, _ = transformers_nll(export, export, data.docs)
    print(f"{case} export: transformers {exported:.8f}")
    assert abs(exported - ref) < TOL, (exported, ref)
