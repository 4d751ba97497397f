"""The bf16 paths of Hugging Face import, training and export on CUDA. Skipped without CUDA.

bf16 parity follows Megatron-Bridge's standard (one forward against transformers: top-1 equal on >= 99% of
positions, cosine >= 0.99); the loss tolerance is bf16 rounding (~1e-2)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F
import transformers
from safetensors import safe_open

from nightloom.hf.config import shape_from_hf_config
from nightloom.hf.load import model_from_hf
from nightloom.hf.random_model import build_random_model
from nightloom.parallel import ParallelPlan
from nightloom.spec import TrainSpec
from nightloom.train.data import PackedWindows
from nightloom.train.job import TrainJob
from tests.support.harness import launch, result, write_corpus

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CONFIG = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    },
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build_random_model(tmp_path_factory.mktemp("hf") / "src", "llama", seed=0, max_shard_size="1MB", **CONFIG)


def test_bf16_forward_matches_transformers(source):
    ids = torch.randint(0, 512, (2, 256), generator=torch.Generator().manual_seed(0)).cuda()
    ours = model_from_hf(source, 256).cuda().to(torch.bfloat16).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        a, b = ours(ids).float(), hf(ids).logits.float()
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    cos = F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
    assert top1 >= 0.99 and cos >= 0.99, (top1, cos)


@pytest.mark.timeout(400)
def test_bf16_import_train_export(source, tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    run.mkdir()
    job = TrainJob(
        run_id="gpu-hf",
        run_dir=str(run),
        model=(shape_from_hf_config(source)),
        plan=ParallelPlan(micro_batch=4, grad_accum=2),
        train=TrainSpec(steps=3, seq_len=128, global_batch=8, lr=1e-4, warmup_steps=1, precision="bf16"),
        manifest=str(corpus),
        peak_flops=1e15,
        peak_source="test constant",
        weights=str(source),
        hf_config=str(source / "config.json"),
    )
    (run / "job.json").write_text(job.model_dump_json())
    out = launch(1, run / "job.json", timeout=300)
    seqs = PackedWindows(str(corpus), 128, seed=job.train.seed).windows(0, 8).cuda()
    hf = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        ref = float(F.cross_entropy(hf(seqs[:, :-1]).logits.flatten(0, 1), seqs[:, 1:].flatten()))
    assert abs(out.losses[0] - ref) < 2e-2, (out.losses[0], ref)
    export = result(run / "job.json")["export_dir"]
    assert json.loads((run / "export" / "config.json").read_text())["dtype"] == "bfloat16"
    for f in (run / "export").glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as s:
            assert all(s.get_slice(k).get_dtype() == "BF16" for k in s.keys())
    _, info = transformers.AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert all(not v for v in info.values()), info
