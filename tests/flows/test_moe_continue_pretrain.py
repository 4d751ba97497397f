"""Mixture-of-experts checkpoints no one here trained (random ones transformers writes in the Hub's per-expert
layout) through `nightloom run` with expert parallelism (EP2 on 2 processes: each rank holds half the experts;
EP2 x FSDP2 on 4: experts over 2 ranks, sharded over the other 2), 2 steps at a negligible learning rate with a
BPE tokenizer folder, then `nightloom eval RUN --data eval.jsonl --seq-len 256 --json`: the mean NLL equals
transformers' on the original checkpoint within 1e-4, and so does the run's export (per-expert layout, reloaded by
transformers). qwen3_moe with a dense first layer; mixtral; deepseek_v3 (multi-head latent attention, the grouped
sigmoid router with its expert-choice bias, a shared expert)."""

from __future__ import annotations

import json

import pytest

from tests.support.hf_runs import SMALL_DEEPSEEK_V3, run_then_eval_equals_transformers

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
    "deepseek_v3": SMALL_DEEPSEEK_V3,
}
ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
#: (model, parallel, ranks): EP2 on 2 ranks; EP2 on 4 ranks (experts over 2, their FSDP2 over the other 2)
CASES = {
    "qwen3_moe/ep2": ("qwen3_moe", {"dp_shard": 2, "ep": 2}, 2),
    "mixtral/ep2": ("mixtral", {"dp_shard": 2, "ep": 2}, 2),
    "deepseek_v3/ep2": ("deepseek_v3", {"dp_shard": 2, "ep": 2}, 2),
    "qwen3_moe/ep2_fsdp4": ("qwen3_moe", {"dp_shard": 4, "ep": 2}, 4),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_run_under_ep_then_eval_equals_transformers(prefect_backend, tmp_path, case):
    arch, parallel, ranks = CASES[case]
    run = run_then_eval_equals_transformers(
        tmp_path,
        arch,
        {**BASE, **MODELS[arch]},
        tag=f"{arch} experts",
        architecture=ARCHITECTURES[arch],
        label=case,
        parallel=parallel,
        cluster={"gpus_per_node": ranks},
    )
    # every step's metrics count the tokens routed to each of the model's experts
    metrics = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(len(m["expert_tokens"]) == (4 if arch == "mixtral" else 8) for m in metrics), metrics
