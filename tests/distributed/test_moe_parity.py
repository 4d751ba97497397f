"""Mixtures of experts from Hugging Face weights (qwen3_moe with a dense first layer, mixtral, deepseek_v3) under
expert parallelism against the same job in one process: EP2 on 2 gloo processes (each rank holds half the experts, rows travel by
all_to_all), plain FSDP2 (experts sharded on dim 0 with the block), and EP2 x FSDP2 on 4 (experts over 2 ranks,
FSDP over the other 2 on dim 1): every step's loss (abs 1e-5, the router's load-balancing loss included), pre-clip
gradient norm (relative 1e-5) and every final parameter (abs 1e-5). Step 1's loss equals transformers' `loss` with
output_router_logits=True on the same rows (one row per micro-batch, as the aux loss is per forward), and each
run's export (per-expert layout) loads in transformers with nothing missing or unexpected. The step-2 checkpoint
of EP2 x FSDP2 resumes in one process, and one process's resumes under EP2, continuing the curve (DCP reshards the
experts' DTensors)."""

from __future__ import annotations

import shutil

import pytest
import torch

from nightloom.hf.config import shape_from_hf_config
from nightloom.hf.random_model import build_random_model
from tests.support.harness import launch_groups, launch_many, write_corpus
from tests.support.hf_runs import SMALL_DEEPSEEK_V3, final_checkpoint_params, hf_job

SEQ, BATCH, STEPS = 32, 4, 3
LOSS_TOL, GRAD_NORM_RTOL, PARAM_ATOL = 1e-5, 1e-5, 1e-5
BASE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "initializer_range": 0.1,
}
MODELS = {
    "qwen3_moe": {
        "intermediate_size": 96,
        "moe_intermediate_size": 48,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "mlp_only_layers": [0],
        "norm_topk_prob": True,
        "router_aux_loss_coef": 0.05,
        "head_dim": 16,
    },
    "mixtral": {
        "intermediate_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.05,
    },
    "deepseek_v3": SMALL_DEEPSEEK_V3,
}
SINGLE = {"micro_batch": 1, "grad_accum": 4}
TWO = {  # 2 processes
    "qwen3_moe/ep2": {"dp_shard": 2, "ep": 2, "micro_batch": 1, "grad_accum": 2},
    "qwen3_moe/fsdp2": {"dp_shard": 2, "micro_batch": 1, "grad_accum": 2},
    "mixtral/ep2": {"dp_shard": 2, "ep": 2, "micro_batch": 1, "grad_accum": 2},
    "deepseek_v3/ep2": {"dp_shard": 2, "ep": 2, "micro_batch": 1, "grad_accum": 2},
    # full recompute: the block's forward (its two all_to_alls included) runs again in backward on every rank
    "qwen3_moe/ep2_recompute": {"dp_shard": 2, "ep": 2, "micro_batch": 1, "grad_accum": 2, "recompute": "full"},
}
FOUR = {
    "qwen3_moe/ep2_fsdp4": {"dp_shard": 4, "ep": 2, "micro_batch": 1, "grad_accum": 1},
    "deepseek_v3/ep2_fsdp4": {"dp_shard": 4, "ep": 2, "micro_batch": 1, "grad_accum": 1},
}


def _job(run_dir, source, corpus, plan):
    return hf_job(
        run_dir, source, corpus, plan, steps=STEPS, seq_len=SEQ, global_batch=BATCH, lr=1e-3, checkpoint_every=2
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    corpus = write_corpus(root / "corpus")
    sources = {
        arch: build_random_model(root / arch, arch, seed=5, max_shard_size="100KB", norm_std=0.3, **(BASE | cfg))
        for arch, cfg in MODELS.items()
    }
    single = {arch: _job(root / f"{arch}_single", src, corpus, SINGLE) for arch, src in sources.items()}
    two = {k: _job(root / k.replace("/", "_"), sources[k.split("/")[0]], corpus, p) for k, p in TWO.items()}
    four = {k: _job(root / k.replace("/", "_"), sources[k.split("/")[0]], corpus, p) for k, p in FOUR.items()}
    one, two, four = launch_groups((1, single, 400), (2, two, 500), (4, four, 500))
    return sources, corpus, one, two | four


def _hf_first_step_loss(source, corpus) -> float:
    """transformers' `loss` (cross entropy + coef · load-balancing loss, output_router_logits=True) averaged over
    the first global batch's rows, one row per forward as the trainer's micro-batches."""
    import transformers

    from nightloom.train.data import PackedWindows

    seqs = PackedWindows(str(corpus), SEQ, seed=1234).windows(0, BATCH)
    hf = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    aux = {} if hf.config.model_type == "deepseek_v3" else {"output_router_logits": True}  # no auxiliary loss
    with torch.no_grad():
        losses = [
            float(hf(row[None, :-1], labels=row[None, 1:], shift_labels=row[None, 1:], **aux).loss) for row in seqs
        ]
    return sum(losses) / len(losses)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", [*TWO, *FOUR])
def test_layout_matches_one_process(layout, runs):
    import transformers

    sources, corpus, single, multi = runs
    arch = layout.split("/")[0]
    ref_job, ref = single[arch]
    job, out = multi[layout]
    assert len(ref.losses) == STEPS, ref.output[-4000:]
    assert len(out.losses) == STEPS, out.output[-4000:]
    loss_diff = max(abs(a - b) for a, b in zip(out.losses, ref.losses))
    norm_rel = max(abs(a.grad_norm - b.grad_norm) / b.grad_norm for a, b in zip(out.metrics, ref.metrics))
    print(f"{layout}: max |loss - 1 process| {loss_diff:.2e}, max rel |grad_norm - 1 process| {norm_rel:.2e}")
    assert loss_diff <= LOSS_TOL, (out.losses, ref.losses)
    assert norm_rel <= GRAD_NORM_RTOL, ([m.grad_norm for m in out.metrics], [m.grad_norm for m in ref.metrics])
    assert [m.expert_tokens for m in out.metrics] == [m.expert_tokens for m in ref.metrics]
    a, b = final_checkpoint_params(job.parent, BASE["vocab_size"]), final_checkpoint_params(ref_job.parent, 256)
    assert sorted(a) == sorted(b) and any(".ffn.experts.w2" in k for k in a)
    worst, where = max((float((a[k] - b[k]).abs().max()), k) for k in b)
    print(f"{layout}: max |param - 1 process| {worst:.2e} ({where})")
    assert worst <= PARAM_ATOL, worst
    if arch == "deepseek_v3":  # the expert-choice bias is a buffer: loaded, never trained, checkpointed as it came
        src = transformers.AutoModelForCausalLM.from_pretrained(sources[arch], dtype=torch.float32)
        bias = src.model.layers[1].mlp.gate.e_score_correction_bias
        assert bias.abs().sum() > 0 and torch.equal(a["layers.1.ffn.router_bias"], bias)
    hf_loss = _hf_first_step_loss(sources[arch], corpus)
    print(f"{layout}: step 1 loss {out.losses[0]:.6f}, transformers {hf_loss:.6f}")
    assert abs(out.losses[0] - hf_loss) < LOSS_TOL, (out.losses[0], hf_loss)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(job.parent / "export", output_loading_info=True)
    assert all(not v for v in info.values()), info


def test_router_is_trained_and_load_logged(runs):
    """The router's weights move, and each step's metrics count top-k assignments of every token of every MoE
    layer: sum = global batch tokens x k x MoE layers."""
    _, _, single, _ = runs
    for arch, (job, out) in single.items():
        shape = shape_from_hf_config(job.parent.parent / arch)
        for m in out.metrics:
            assert sum(m.expert_tokens) == BATCH * SEQ * shape.experts_per_token * shape.moe_layers
            assert m.expert_imbalance >= 1.0 and m.router_aux_loss > 0


def test_checkpoints_resume_across_expert_layouts(runs, tmp_path):
    sources, corpus, single, multi = runs
    ref_job, ref = single["qwen3_moe"]
    pairs = {"to_one": (multi["qwen3_moe/ep2_fsdp4"][0], SINGLE, 1), "to_ep2": (ref_job, TWO["qwen3_moe/ep2"], 2)}
    jobs = {}
    for name, (src_job, plan, _) in pairs.items():
        run = tmp_path / name
        (run / "checkpoints").mkdir(parents=True)
        shutil.copytree(src_job.parent / "checkpoints" / "step-2", run / "checkpoints" / "step-2")
        (run / "checkpoints" / "latest").write_text("step-2\n")
        jobs[name] = _job(run, sources["qwen3_moe"], corpus, plan)
    outs = launch_many(1, [jobs["to_one"]], timeout=300) | launch_many(2, [jobs["to_ep2"]], timeout=300)
    for name, job in jobs.items():
        out = outs[job]
        assert [m.step for m in out.metrics] == [3], out.output[-3000:]
        print(f"resumed {name}: step 3 loss {out.losses[0]:.7f}, uninterrupted {ref.losses[2]:.7f}")
        assert abs(out.losses[0] - ref.losses[2]) <= LOSS_TOL
