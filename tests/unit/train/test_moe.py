"""Mixtures of experts in the native model (train/moe.py) against transformers 5.24: a tiny random qwen3_moe (dense
first layer, renormalised top-2 of 8), mixtral (top-2 of 4) and deepseek_v3 (multi-head latent attention with and
without the low-rank query, interleaved or rotate-half RoPE, YaRN with its softmax scale, the sigmoid router with a
random expert-choice bias over 1, 2 or 4 groups, shared experts, a dense first layer) loaded from the per-expert layout save_pretrained writes
give the same logits (fp32, 1e-5), the same training loss (cross entropy + coef · load-balancing loss, what
transformers returns with output_router_logits=True; deepseek_v3 has none) and the same router gradients; the
export (per-expert layout again) reloads in transformers with the same logits; spec checks refuse MoE with tp/pp/cp
and LoRA on latent attention."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from nightloom.hf.export import export_checkpoint
from nightloom.hf.load import model_from_hf
from nightloom.hf.names import expected_shapes
from nightloom.hf.random_model import build_random_model
from nightloom.spec.load import SpecError, load_spec
from nightloom.train.moe import ExpertLoad, imbalance, router_aux_loss
from nightloom.train.parallelize import loss_fn

BASE = {
    "vocab_size": 128,
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "initializer_range": 0.1,
}
#: deepseek_v3: low-rank query, 2 expert groups, interleaved RoPE (the variants below change one thing at a time)
DEEPSEEK_V3 = {
    "num_key_value_heads": 4,
    "intermediate_size": 64,
    "moe_intermediate_size": 24,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 12,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.0,
    "rope_interleave": True,
    "tie_word_embeddings": False,
}
#: DeepSeek-V3's own long-context RoPE: YaRN with mscale, the softmax scaled too
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
MODELS = {
    "qwen3_moe": {
        "intermediate_size": 64,
        "moe_intermediate_size": 24,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "mlp_only_layers": [0],
        "norm_topk_prob": True,
        "router_aux_loss_coef": 0.05,
    },
    "qwen3_moe_unnormalised": {
        "intermediate_size": 64,
        "moe_intermediate_size": 24,
        "num_experts": 4,
        "num_experts_per_tok": 3,
        "decoder_sparse_step": 2,
        "norm_topk_prob": False,
        "router_aux_loss_coef": 0.1,
    },
    "mixtral": {
        "intermediate_size": 40,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.05,
    },
    "deepseek_v3": DEEPSEEK_V3,
    "deepseek_v3_yarn": DEEPSEEK_V3 | {"v_head_dim": 16, "n_group": 4, "topk_group": 2, "rope_scaling": YARN},
    "deepseek_v3_full_query": DEEPSEEK_V3
    | {
        "n_routed_experts": 4,
        "num_experts_per_tok": 3,
        "n_shared_experts": 2,
        "q_lora_rank": None,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "rope_interleave": False,
    },
}
TOL = 1e-5


def _arch(case: str) -> str:
    return "deepseek_v3" if case.startswith("deepseek_v3") else case.split("_unnormalised")[0]


@pytest.fixture(scope="module", params=sorted(MODELS))
def source(request, tmp_path_factory):
    arch = _arch(request.param)
    folder = tmp_path_factory.mktemp(request.param) / "hf"
    return build_random_model(
        folder, arch, seed=3, max_shard_size="60KB", norm_std=0.2, bias_std=0.1, **(BASE | MODELS[request.param])
    )


def _hf(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_the_hub_layout_is_what_transformers_writes(source):
    """Every tensor save_pretrained wrote is one the reader expects (per expert), and nothing is missing."""
    from nightloom.hf.load import scan_checkpoint

    model = model_from_hf(source, 32)
    index = scan_checkpoint(source, model.shape)
    assert set(index.tensors) == set(expected_shapes(model.shape))
    assert any(".experts.3." in n for n in index.tensors)


def test_logits_loss_and_gradients_match_transformers(source):
    torch.manual_seed(0)
    x = torch.randint(0, BASE["vocab_size"], (2, 24))
    hf, ours = _hf(source), model_from_hf(source, 32).eval()
    shape = ours.shape
    with torch.no_grad():
        diff = float((hf(x).logits - ours(x)).abs().max())
    print(f"{shape.arch} top-{shape.experts_per_token}/{shape.num_experts}: max |logits - transformers| {diff:.2e}")
    assert diff < TOL
    balanced = shape.router_score == "softmax"  # deepseek_v3 balances by its bias, with no auxiliary loss
    out = hf(x, labels=x, output_router_logits=True) if balanced else hf(x, labels=x)
    logits = ours(x)
    load = ExpertLoad(shape.router_aux_loss_coef, shape.num_experts)
    loss = loss_fn(logits[:, :-1], x[:, 1:]) + load.loss(ours)
    print(f"loss {float(loss):.7f} transformers {float(out.loss):.7f}")
    assert abs(float(loss) - float(out.loss)) < TOL
    aux, counts = router_aux_loss(ours)
    if balanced:
        assert abs(float(aux) - float(out.aux_loss)) < TOL
    assert int(counts.sum()) == x.numel() * shape.experts_per_token * shape.moe_layers
    out.loss.backward()
    loss.backward()
    last = max(i for i in range(shape.layers) if shape.is_moe_layer(i))
    ours_router = ours.layers[str(last)].ffn.router.weight.grad
    hf_mlp = hf.model.layers[last]
    hf_router = (hf_mlp.mlp if hasattr(hf_mlp, "mlp") else hf_mlp.block_sparse_moe).gate.weight.grad
    assert float((ours_router - hf_router).abs().max()) < TOL  # the aux loss trains the router as transformers'


def test_export_reloads_in_transformers_with_the_same_logits(source, tmp_path):
    model = model_from_hf(source, 32).eval()
    ckpt = tmp_path / "step-1"
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(ckpt), no_dist=True)
    out = export_checkpoint(ckpt, model.shape, tmp_path / "export", "fp32", source_config=source)
    names = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    assert names == set(expected_shapes(model.shape))  # the Hub's per-expert layout
    import transformers

    back, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert all(not v for v in info.values()), info
    x = torch.randint(0, BASE["vocab_size"], (2, 16))
    with torch.no_grad():
        assert float((back.eval()(x).logits - model(x)).abs().max()) < TOL


def test_imbalance_and_expert_load_reset():
    assert imbalance([4, 4, 4, 4]) == 1.0 and imbalance([16, 0, 0, 0]) == 4.0 and imbalance([0, 0]) is None
    load = ExpertLoad(0.0, 3)
    load.counts += torch.tensor([1.0, 2.0, 3.0])
    load.aux, load.micro = 3.0, 2
    assert load.take(torch.device("cpu")) == ([1, 2, 3], 1.5)
    assert load.take(torch.device("cpu")) == ([0, 0, 0], 0.0)


def _spec(tmp_path, config: dict, parallel) -> list[str]:
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    (tmp_path / "c.jsonl").write_text('{"text": "hello"}\n')
    spec = {
        "name": "t",
        "dataset": {"path": "c.jsonl"},
        "model": {"config": "m/config.json"},
        "cluster": {"nodes": 1, "gpus_per_node": 2},
        "parallel": parallel,
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    try:
        load_spec(path)
    except SpecError as e:
        return e.errors
    return []


def test_spec_checks_take_qwen3_moe_and_refuse_its_unsupported_layouts(tmp_path):
    cfg = {"model_type": "qwen3_moe", **BASE, **MODELS["qwen3_moe"], "vocab_size": 512, "max_position_embeddings": 512}
    assert _spec(tmp_path, cfg, {"dp_shard": 2, "ep": 2}) == []
    errors = "\n".join(_spec(tmp_path, cfg, {"tp": 2, "dp_shard": 1, "pp": 1}))
    assert "parallel.tp" in errors and "mixture-of-experts" in errors, errors


def test_spec_checks_take_deepseek_v3_and_name_what_it_does_not_run(tmp_path):
    """deepseek_v3 trains with dp_shard and ep, YaRN included; LoRA on its latent attention is refused on
    train.lora, a RoPE kind the model does not compute on the config's rope_scaling, both before anything runs."""
    cfg = {"model_type": "deepseek_v3", **BASE, **MODELS["deepseek_v3"], "vocab_size": 512}
    cfg["max_position_embeddings"] = 512
    assert _spec(tmp_path, cfg, {"dp_shard": 2, "ep": 2}) == []
    spec = yaml.safe_load((tmp_path / "spec.yaml").read_text())
    spec["train"] = {"task": "sft", "lora": {"rank": 4}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(SpecError) as ei:
        load_spec(tmp_path / "spec.yaml")
    assert any("train.lora" in e and "latent attention" in e for e in ei.value.errors), ei.value.errors
    yarn = cfg | {"rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096}}
    assert _spec(tmp_path, yarn, {"dp_shard": 2}) == []
    longrope = cfg | {"rope_scaling": {"type": "longrope", "factor": 4}}
    errors = "\n".join(_spec(tmp_path, longrope, {"dp_shard": 2}))
    assert "rope_scaling.rope_type" in errors and "longrope" in errors and "model.config" in errors, errors


@pytest.mark.slow
def test_expert_load_plot_shows_an_imbalanced_router(tmp_path):
    """metrics.jsonl's expert fields round-trip, and a MoE run's plots include the per-expert load (a dense run's
    do not): the heat map of a router stuck on expert 0 differs from a balanced one's."""
    import numpy as np
    from matplotlib.image import imread

    from nightloom.metrics import StepMetrics, append_metrics, read_metrics
    from nightloom.plots import write_run_plots

    def steps(skew: bool):
        out = []
        for i in range(1, 11):
            tokens = [100 + 60 * i, 100, 100, 100] if skew else [100, 100, 100, 100]
            out.append(
                StepMetrics(
                    step=i, loss=3.0, expert_tokens=tokens, expert_imbalance=imbalance(tokens), router_aux_loss=1.1
                )
            )
        return out

    append_metrics(tmp_path / "m.jsonl", steps(True)[0])
    assert read_metrics(tmp_path / "m.jsonl")[0].expert_tokens == [160, 100, 100, 100]
    skewed, balanced = write_run_plots(steps(True), tmp_path / "a"), write_run_plots(steps(False), tmp_path / "b")
    assert "experts" in skewed and "experts" not in write_run_plots([StepMetrics(step=1, loss=3.0)], tmp_path / "c")
    assert not np.array_equal(imread(skewed["experts"]), imread(balanced["experts"]))


def test_prometheus_exports_the_expert_load_of_moe_runs_only():
    import socket
    import urllib.request

    from nightloom.metrics import PROMETHEUS_METRICS, PROMETHEUS_MOE_METRICS
    from nightloom.train.prom import RankMetrics

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    m = RankMetrics(port, "r1", 0)
    try:
        m.update(step=1, loss=2.0)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert not any(name in body for name in PROMETHEUS_MOE_METRICS)  # a dense run exports none of them
        m.experts([30, 10, 0, 0], 1.25)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'nightloom_expert_tokens{expert="0",rank="0",run="r1"} 30.0' in body
        assert 'nightloom_expert_imbalance{rank="0",run="r1"} 3.0' in body
        assert 'nightloom_router_aux_loss{rank="0",run="r1"} 1.25' in body
        assert not set(PROMETHEUS_MOE_METRICS) & set(PROMETHEUS_METRICS)
    finally:
        m.close()


def test_transformers_fused_expert_layout_is_read_too(source, tmp_path):
    """A checkpoint of transformers 5's in-memory names (experts fused in gate_up_proj / down_proj, the router at
    mlp.gate for mixtral too), as a state_dict saved directly writes it, loads to the same logits."""
    import shutil

    from safetensors.torch import save_file

    hf = _hf(source)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    folder = tmp_path / "fused"
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(source / "config.json", folder / "config.json")
    ours = model_from_hf(folder, 32).eval()
    x = torch.randint(0, BASE["vocab_size"], (2, 16))
    with torch.no_grad():
        assert float((hf(x).logits - ours(x)).abs().max()) < TOL
