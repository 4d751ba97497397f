"""A tied Qwen3 checkpoint no one here trained (a random one transformers writes, q/k norm weights not all 1, one
embedding matrix for input and output) through `nightloom run` under an explicit TP2 and an explicit PP2 layout (2
steps at a negligible learning rate), then `nightloom eval RUN --data eval.jsonl --seq-len 256 --json`: the mean
NLL equals transformers' Qwen3ForCausalLM on the original checkpoint within 1e-4, and so does the run's export,
which transformers reloads as a tied model. The tokenizer, corpus, checkpoint, shards and the reference NLL are
built once for both layouts (issue 38, "Must show")."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.harness import free_port
from tests.support.hf_runs import (
    SEQ,
    SMALL_DENSE,
    TOL,
    bpe_tokenizer,
    continue_pretrain_spec,
    eval_data,
    nightloom_eval,
    run_two_steps,
    transformers_nll,
)

#: the dense families' small model (vocab 320 >= the BPE's 300 ids and even: vocab-parallel under TP2; 4 layers:
#: two per stage under PP2) with its embedding tied to the head
QWEN3_TIED = {**SMALL_DENSE, "tie_word_embeddings": True}
LAYOUTS = {
    "tp2": {"tp": 2, "dp_shard": 1, "micro_batch": 2},
    "pp2": {"pp": 2, "dp_shard": 1, "micro_batch": 2, "schedule": "1f1b"},
}


@dataclass(frozen=True)
class Setup:
    """What both layouts share: the files a run reads and transformers' NLL of the original checkpoint."""

    root: Path
    corpus: Path
    eval_data: Path
    tokenizer: Path
    weights: Path
    docs: list[str]
    ref_nll: float
    ref_tokens: int
    #: loss and grad_norm of steps 1 and 2 of each layout run so far: the same batches, so the layouts must agree
    steps: dict[str, list[float]] = field(default_factory=dict)


def _tied_nll(model_dir: Path, tokenizer_dir: Path, docs: list[str]) -> tuple[float, int]:
    """transformers' NLL of a folder it must load as tied (one matrix for the embedding and the head)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return transformers_nll(model_dir, tokenizer_dir, docs)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    from safetensors import safe_open

    from nightloom.hf.random_model import build_random_model

    root = tmp_path_factory.mktemp("tied-layouts")
    data = eval_data(root, "tied Qwen3 head")
    tokenizer = bpe_tokenizer(root, data.corpus)
    weights = build_random_model(
        root / "qwen3-tied", "qwen3", seed=23, max_shard_size="200KB", norm_std=0.3, **QWEN3_TIED
    )
    names = set()
    for f in weights.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            names |= set(st.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # the checkpoint is tied
    ref, tokens = _tied_nll(weights, tokenizer, data.docs)
    return Setup(root, data.corpus, data.eval_data, tokenizer, weights, data.docs, ref, tokens)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_tied_qwen3_run_then_eval_equals_transformers(prefect_backend, setup: Setup, layout: str):
    s = setup
    spec = continue_pretrain_spec(
        s.root,
        s.weights,
        s.tokenizer,
        s.corpus,
        s.root / "shards",  # the second layout reuses the shards
        tag=f"-{layout}",
        cluster={"master_port": free_port()},
        parallel=LAYOUTS[layout],
    )
    summary = run_two_steps(spec)
    run_dir = Path(summary["run_dir"])
    plan = json.loads(sorted(run_dir.glob("job-attempt*.json"))[-1].read_text())["plan"]
    assert (plan["tp"], plan["pp"]) == (LAYOUTS[layout].get("tp", 1), LAYOUTS[layout].get("pp", 1)), plan
    # the other layout's steps (when it ran first): same loss and gradient norm, so the tied matrix's gradient is
    # the whole model's under both (PP sums the two stages' copies; the norm counts the matrix once)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    s.steps[layout] = [x for m in metrics if "grad_norm" in m for x in (m["loss"], m["grad_norm"])]
    for other, seen in s.steps.items():
        assert len(seen) == 4 and seen == pytest.approx(s.steps[layout], rel=1e-5), (layout, other, s.steps)

    ours = nightloom_eval(run_dir, s.eval_data)
    print(
        f"tied qwen3 {layout}: nightloom eval {ours['loss']:.8f}, transformers {s.ref_nll:.8f} ({s.ref_tokens} tokens)"
    )
    assert ours["step"] == 2 and ours["tokens"] == s.ref_tokens and s.ref_tokens > 6 * (SEQ - 1)
    assert abs(ours["loss"] - s.ref_nll) < TOL, (ours["loss"], s.ref_nll)
    # the run's export: one embedding matrix (tied in config.json, no lm_head tensor), scored the same
    export = Path(summary["export_dir"])
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["tie_word_embeddings"] is True, config
    assert "lm_head.weight" not in json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
    exported, _ = _tied_nll(export, export, s.docs)
    print(f"tied qwen3 {layout}: export {exported:.8f}")
    assert abs(exported - s.ref_nll) < TOL, (exported, s.ref_nll)
