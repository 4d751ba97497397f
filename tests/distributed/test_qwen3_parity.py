"""Qwen3 (per-head q/k RMSNorm, head_dim independent of hidden/heads) from Hugging Face weights under FSDP2, TP2
(with and without SP) and PP2 on 2 gloo processes and FSDP2 x TP2 on 4, against the same job in one process: every
step's loss (abs 1e-5) and pre-clip gradient norm (relative 1e-5), and every final parameter (abs 1e-5). A q/k norm
whose gradient each TP rank took from its own heads only (not summed over the ranks) moves the grad norm at step 1
and the weights after it. Step 1's loss also equals transformers' Qwen3ForCausalLM on the same batch, and each run's
export loads in transformers with nothing missing or unexpected. Tied under TP/PP is not here (the tied-layout
tests cover the embedding)."""

from __future__ import annotations

import pytest
import torch
import transformers

from nightloom.hf.config import shape_from_hf_config
from nightloom.hf.random_model import build_random_model
from nightloom.parallel import ParallelPlan
from nightloom.spec import TrainSpec
from nightloom.train.job import TrainJob
from tests.support.harness import launch_many, write_corpus
from tests.support.hf_runs import final_checkpoint_params, hf_first_batch_loss

SEQ, BATCH, STEPS = 32, 8, 3
LOSS_TOL, GRAD_NORM_RTOL, PARAM_ATOL = 1e-5, 1e-5, 1e-5
CONFIG = {
    "vocab_size": 301,  # odd: padded to 302 under TP2
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,  # != hidden / heads
    "max_position_embeddings": 128,
    "initializer_range": 0.1,
    "rope_theta": 1e6,
}
SINGLE = {"micro_batch": 2, "grad_accum": 4}
LAYOUTS = {  # 2 processes
    "fsdp2": {"dp_shard": 2, "micro_batch": 2, "grad_accum": 2},
    "tp2_sp": {"tp": 2, "sp": True, "micro_batch": 2, "grad_accum": 4},
    "tp2_nosp": {"tp": 2, "sp": False, "micro_batch": 2, "grad_accum": 4},
    "pp2": {"pp": 2, "schedule": "1f1b", "micro_batch": 2, "grad_accum": 4},
}
#: 4 processes: the q/k norm weights replicated over TP and sharded by FSDP on top (a 2-D parameter)
COMPOSED = {"fsdp2_tp2_sp": {"dp_shard": 2, "tp": 2, "sp": True, "micro_batch": 2, "grad_accum": 2}}


def _source(root, tied: bool):
    return build_random_model(
        root / ("tied" if tied else "untied"), "qwen3", seed=7, max_shard_size="100KB", norm_std=0.3,
        tie_word_embeddings=tied, **CONFIG,
    )  # fmt: skip


def _job(run_dir, source, corpus, plan):
    run_dir.mkdir(parents=True, exist_ok=True)
    job = TrainJob(
        run_id=run_dir.name,
        run_dir=str(run_dir),
        model=shape_from_hf_config(source),
        plan=ParallelPlan(**plan),
        train=TrainSpec(
            steps=STEPS, seq_len=SEQ, global_batch=BATCH, lr=1e-3, warmup_steps=1, precision="fp32", seed=1234
        ),
        manifest=str(corpus),
        peak_flops=50e9,
        peak_source="test constant",
        weights=str(source),
        hf_config=str(source / "config.json"),
    )
    p = run_dir / "job.json"
    p.write_text(job.model_dump_json(indent=2))
    return p


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The one-process runs (untied, tied) in one launch, then every 2-process layout in one, the 4-process one."""
    root = tmp_path_factory.mktemp("qwen3")
    corpus = write_corpus(root / "corpus")
    untied, tied = _source(root, False), _source(root, True)
    single = {
        "untied": _job(root / "single", untied, corpus, SINGLE),
        "tied": _job(root / "single_t", tied, corpus, SINGLE),
    }
    double = {name: _job(root / name, untied, corpus, plan) for name, plan in LAYOUTS.items()}
    double["tied_fsdp2"] = _job(root / "tied_fsdp2", tied, corpus, LAYOUTS["fsdp2"])
    four = {name: _job(root / name, untied, corpus, plan) for name, plan in COMPOSED.items()}
    one = launch_many(1, list(single.values()), timeout=300)
    many = launch_many(2, list(double.values()), timeout=400) | launch_many(4, list(four.values()), timeout=400)
    return (
        {"untied": untied, "tied": tied, "corpus": corpus},
        {k: (j, one[j]) for k, j in single.items()},
        {k: (j, many[j]) for k, j in (double | four).items()},
    )


@pytest.mark.timeout(720)
@pytest.mark.parametrize("layout", [*sorted(LAYOUTS), *COMPOSED, "tied_fsdp2"])
def test_layout_matches_one_process(layout, runs):
    sources, single, double = runs
    tied = layout.startswith("tied")
    ref_job, ref = single["tied" if tied else "untied"]
    job, out = double[layout]
    assert len(ref.losses) == STEPS, ref.output[-4000:]
    assert len(out.losses) == STEPS, out.output[-4000:]
    assert "[nightloom.train] loaded " in out.output
    loss_diff = max(abs(a - b) for a, b in zip(out.losses, ref.losses))
    norm_rel = max(abs(a.grad_norm - b.grad_norm) / b.grad_norm for a, b in zip(out.metrics, ref.metrics))
    print(f"qwen3 {layout}: max |loss - 1 process| {loss_diff:.2e}, max rel |grad_norm - 1 process| {norm_rel:.2e}")
    assert loss_diff <= LOSS_TOL, (out.losses, ref.losses)
    assert norm_rel <= GRAD_NORM_RTOL, ([m.grad_norm for m in out.metrics], [m.grad_norm for m in ref.metrics])
    a, b = (
        final_checkpoint_params(job.parent, CONFIG["vocab_size"]),
        final_checkpoint_params(ref_job.parent, CONFIG["vocab_size"]),
    )
    assert sorted(a) == sorted(b) and any(".attn.q_norm." in k for k in a)
    worst, where = max((float((a[k] - b[k]).abs().max()), k) for k in b)
    print(f"qwen3 {layout}: max |param - 1 process| {worst:.2e} ({where})")
    assert worst <= PARAM_ATOL, worst
    # the first step's loss is transformers' on the same batch (the weights loaded as Qwen3ForCausalLM reads them)
    hf_loss = hf_first_batch_loss(sources["tied" if tied else "untied"], sources["corpus"], SEQ, BATCH)
    assert abs(out.losses[0] - hf_loss) < LOSS_TOL, (out.losses[0], hf_loss)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(job.parent / "export", output_loading_info=True)
    assert all(not v for v in info.values()), info


def test_q_norm_weights_moved(runs):
    """The q/k norm weights are trained (loaded from the file, then updated), not left at their loaded values."""
    sources, single, _ = runs
    job, _ = single["untied"]
    from safetensors import safe_open

    trained = final_checkpoint_params(job.parent, CONFIG["vocab_size"])["layers.0.attn.q_norm.weight"]
    for f in sources["untied"].glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as s:
            if "model.layers.0.self_attn.q_norm.weight" in s.keys():
                start = s.get_tensor("model.layers.0.self_attn.q_norm.weight")
    assert not torch.equal(trained, start) and float((trained - start).abs().max()) < 0.01
