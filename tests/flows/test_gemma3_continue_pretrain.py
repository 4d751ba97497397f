"""A Gemma 3 checkpoint no one here trained (a random one transformers writes: tied, (1 + w) norm weights not all 0,
a sliding window of 32 tokens on three layers of four, shorter than the training windows (128) and the scored
prefixes (256)) through `nightloom run` (FSDP2 on 2 processes, 2 steps at a negligible learning rate, a BPE tokenizer
folder) and `nightloom eval RUN --data eval.jsonl --seq-len 256 --json`: the mean NLL equals transformers'
Gemma3ForCausalLM on the original checkpoint (the same tokenizer through AutoTokenizer) within 1e-4, and so does the
run's export."""

from __future__ import annotations

from tests.support.hf_runs import SMALL_DENSE, run_then_eval_equals_transformers

GEMMA3 = {
    **SMALL_DENSE,
    "sliding_window": 32,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    "rope_local_base_freq": 1e4,
    "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    "query_pre_attn_scalar": 32,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
}


def test_gemma3_run_then_eval_equals_transformers(prefect_backend, tmp_path):
    run = run_then_eval_equals_transformers(
        tmp_path, "gemma3_text", GEMMA3, tag="Gemma 3 sliding window", architecture="Gemma3ForCausalLM", label="gemma3"
    )
    # the export is a Gemma 3 with its windows (and RoPE bases): transformers scored it the same
    assert run.export_config["sliding_window"] == 32
