"""Native generation on a sharded model, 2 gloo processes: under FSDP2 (shards gathered for the rollout) and TP2
(heads split, vocabulary padded 97 -> 98) the greedy tokens, the sampled tokens of each data-parallel rank's
(step, rank) RNG and their log-probs equal one process's; the sharded training forward gives the same log-probs;
sequence parallelism is refused by name."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from nightloom.hf.load import model_from_hf
from nightloom.hf.random_model import build_random_model
from nightloom.train.rollout.generate import generate
from nightloom.train.rollout.sampling import SamplingParams, rollout_generator
from tests.support.harness import ROOT, env, torchrun_prefix

PROMPTS = [[5, 17, 33, 2, 9, 61, 40], [8, 71], [12, 13, 14, 15]]  # as rollout_worker.py
LAYOUTS = {"fsdp2": {"dp_shard": 2}, "tp2": {"tp": 2}, "tp2-sp": {"tp": 2, "sp": True}}
CONFIG = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "initializer_range": 0.3,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = build_random_model(tmp_path_factory.mktemp("hf") / "w", "llama", seed=4, **CONFIG)
    out = tmp_path_factory.mktemp("out")
    cmd = [*torchrun_prefix(2), str(ROOT / "tests/distributed/rollout_worker.py"), str(folder), json.dumps(LAYOUTS)]
    p = subprocess.run([*cmd, str(out)], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    records = {
        (f.stem.rsplit(".", 1)[0], int(f.stem.rsplit(".", 1)[1])): json.loads(f.read_text()) for f in out.glob("*.json")
    }
    return model_from_hf(folder, 64).eval(), records


@pytest.mark.parametrize("layout", ["fsdp2", "tp2"])
def test_sharded_generation_equals_one_process(runs, layout):
    model, records = runs
    greedy = generate(model, PROMPTS, SamplingParams(max_new_tokens=12, temperature=0), eos_ids=[], pad_id=0)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=50)
    for rank in (0, 1):
        rec = records[(layout, rank)]
        assert rec["greedy"] == greedy.tokens.tolist(), (layout, rank)
        one = generate(model, PROMPTS, params, eos_ids=[], pad_id=0, generator=rollout_generator(0, 5, rec["dp_rank"]))
        assert rec["sampled"] == one.tokens.tolist(), (layout, rank)
        assert torch.allclose(torch.tensor(rec["logprobs"]), one.logprobs, atol=1e-5)
        assert torch.allclose(torch.tensor(rec["forward_logprobs"]), one.logprobs, atol=1e-5)
    if layout == "fsdp2":  # two data-parallel ranks draw different completions
        assert records[(layout, 0)]["sampled"] != records[(layout, 1)]["sampled"]


def test_sequence_parallel_is_refused(runs):
    _, records = runs
    assert "sequence parallelism (sp) is not supported" in records[("tp2-sp", 0)]["error"]
