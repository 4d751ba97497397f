"""A Gemma 3 checkpoint no one here trained (a random one transformers writes: tied, (1 + w) norm weights not all 0,
a sliding window of 32 tokens on three layers of four, shorter than the training windows (128) and the scored
prefixes (256)) through `nightloom run` (FSDP2 on 2 processes, 2 steps at a negligible learning rate, a BPE tokenizer
folder) and `nightloom eval RUN --data eval.jsonl --seq-len 256 --json`: the mean NLL equals transformers'
Gemma3ForCausalLM on the original checkpoint (the same tokenizer through AutoTokenizer) within 1e-4, and so does the
run's export."""

from __future__ import annotations

import json
from pathlib import Path

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

GEMMA3 = {
    "vocab_size": 320,  # >= the BPE's 300 ids
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "sliding_window": 32,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    "rope_theta": 1e6,
    "rope_local_base_freq": 1e4,
    "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    "query_pre_attn_scalar": 32,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
}


def test_gemma3_run_then_eval_equals_transformers(prefect_backend, tmp_path):
    from nightloom.hf.random_model import build_random_model

    data = eval_data(tmp_path, "Gemma 3 sliding window")
    tokenizer = bpe_tokenizer(tmp_path, data.corpus)
    weights = build_random_model(
        tmp_path / "gemma3", "gemma3_text", seed=11, max_shard_size="200KB", norm_std=0.3, **GEMMA3
    )
    spec = continue_pretrain_spec(tmp_path, weights, tokenizer, data.corpus, tmp_path / "shards")

    summary = run_two_steps(spec)
    ours = nightloom_eval(Path(summary["run_dir"]), data.eval_data)
    ref, tokens = transformers_nll(weights, tokenizer, data.docs)
    print(f"gemma3 run: nightloom eval {ours['loss']:.8f}, transformers {ref:.8f} ({tokens} tokens)")
    assert ours["step"] == 2 and ours["tokens"] == tokens and tokens > 6 * (SEQ - 1)
    assert abs(ours["loss"] - ref) < TOL, (ours["loss"], ref)
    # the run's export: transformers reloads it (a Gemma 3 with its windows and RoPE bases) and scores it the same
    export = Path(summary["export_dir"])
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["sliding_window"] == 32
    exported, _ = transformers_nll(export, export, data.docs)
    print(f"gemma3 export: transformers {exported:.8f}")
    assert abs(exported - ref) < TOL, (exported, ref)
