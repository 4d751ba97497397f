"""A Qwen3 checkpoint no one here trained (a random one transformers writes, q/k norm weights not all 1) through
`nightloom run` (FSDP2 on 2 processes, 2 steps at a negligible learning rate, a BPE tokenizer folder) and
`nightloom eval RUN --data eval.jsonl --seq-len 256 --json`: the mean NLL equals transformers' Qwen3ForCausalLM on
the original checkpoint (the same tokenizer through AutoTokenizer) within 1e-4, and so does the run's export."""

from __future__ import annotations

from tests.support.hf_runs import SMALL_DENSE, run_then_eval_equals_transformers

QWEN3 = {**SMALL_DENSE, "tie_word_embeddings": False}


def test_qwen3_run_then_eval_equals_transformers(prefect_backend, tmp_path):
    run_then_eval_equals_transformers(
        tmp_path, "qwen3", QWEN3, tag="Qwen3 q/k norm", architecture="Qwen3ForCausalLM", label="qwen3"
    )
