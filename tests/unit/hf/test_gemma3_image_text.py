"""Gemma 3's image-text checkpoints (Gemma3ForConditionalGeneration, model_type gemma3): nightloom loads and
trains the text decoder, leaving the vision tower and projector out (said once in the log), and exports a
text-only gemma3_text model.

A tiny image-text model built with transformers 5.24 (a tiny SigLIP vision tower) is saved two ways: by
save_pretrained, which writes the Hub's layout (`language_model.model.*`, `language_model.lm_head.weight`,
`vision_tower.*`, `multi_modal_projector.*`: transformers maps its module names back on save), and as its
state_dict (transformers 5's module names: `model.language_model.*`, `lm_head.weight`, `model.vision_tower.*`),
which transformers loads too. The native model's logits on text input must match the image-text model's within
1e-5."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from nightloom.hf.config import read_config, shape_from_hf_config
from nightloom.hf.export import export_checkpoint
from nightloom.hf.load import WeightsError, model_from_hf, scan_checkpoint

TOL = 1e-5
SEQ = 48
TEXT = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "max_position_embeddings": 256,
    "sliding_window": 16,  # < SEQ: the sliding layers' window shows
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
    "query_pre_attn_scalar": 40,
}
VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 28,
    "patch_size": 14,
}


def _image_text_model(tied: bool) -> transformers.Gemma3ForConditionalGeneration:
    """Seeded, every text-decoder tensor random (norm weights too: a norm left at its init would not show)."""
    cfg = transformers.Gemma3Config(
        text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4, tie_word_embeddings=tied
    )
    torch.manual_seed(7)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name or name.startswith("lm_head"):
                p.normal_(0.0, 0.3 if name.endswith("norm.weight") else 0.25)
    return model


def _save_state_dict(model, folder):
    """The model's own (transformers 5) names in one file, with its config: a layout transformers loads."""
    folder.mkdir(parents=True)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del sd["lm_head.weight"]  # the embedding's storage; transformers ties it again on load
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def saved(request, tmp_path_factory):
    """(tied, {layout: folder}, ids, transformers' text-only logits)"""
    tied = request.param
    root = tmp_path_factory.mktemp(f"g3it-{'tied' if tied else 'untied'}")
    model = _image_text_model(tied)
    model.save_pretrained(root / "hub", max_shard_size="100KB")
    folders = {"hub": root / "hub", "modules": _save_state_dict(model, root / "modules")}
    ids = torch.randint(0, TEXT["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(input_ids=ids).logits  # text only: no pixel values
    return tied, folders, ids, ref


def test_save_pretrained_writes_the_hub_layout(saved):
    tied, folders, _, _ = saved
    names = set(json.loads((folders["hub"] / "model.safetensors.index.json").read_text())["weight_map"])
    assert "language_model.model.embed_tokens.weight" in names and "language_model.model.norm.weight" in names
    assert any(n.startswith("vision_tower.") for n in names)
    assert any(n.startswith("multi_modal_projector.") for n in names)
    assert ("language_model.lm_head.weight" in names) is not tied
    with safe_open(str(folders["modules"] / "model.safetensors"), framework="pt") as f:
        mod = set(f.keys())
    assert "model.language_model.embed_tokens.weight" in mod and any(n.startswith("model.vision_tower.") for n in mod)
    assert ("lm_head.weight" in mod) is not tied


@pytest.mark.parametrize("layout", ["hub", "modules"])
def test_text_decoder_logits_match_the_image_text_model(saved, layout):
    tied, folders, ids, ref = saved
    folder = folders[layout]
    if layout == "modules":  # transformers itself reads this layout as the same model
        again = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            assert torch.equal(again(input_ids=ids).logits, ref)
    lines: list[str] = []
    model = model_from_hf(folder, SEQ, log=lines.append)
    assert model.shape.tied_embeddings is tied
    with torch.no_grad():
        ours = model.eval()(ids)
    diff = float((ours - ref).abs().max())
    assert diff < TOL and bool((ours.argmax(-1) == ref.argmax(-1)).all()), f"{layout}: max |logit diff| {diff:.2e}"
    index = scan_checkpoint(folder, model.shape)
    n_vision = len(index.left_out)
    assert n_vision > 0 and all(
        n.split(".")[0] in ("vision_tower", "multi_modal_projector", "model") for n in index.left_out
    )
    assert len(lines) == 1, lines  # said once
    assert f"left out {n_vision} tensors" in lines[0] and "vision_tower" in lines[0]
    assert "multi_modal_projector" in lines[0]


@pytest.mark.parametrize("saved", [False], ids=["untied"], indirect=True)
def test_untied_negative_control(saved):
    """Reading the untied model as tied (text_config's own flag, which transformers writes as true) must fail
    the same check: the head is the top-level flag's."""
    tied, folders, ids, ref = saved
    assert not tied
    assert read_config(folders["hub"])["text_config"]["tie_word_embeddings"] is True
    from nightloom.hf.load import load_hf_weights
    from nightloom.train.model import build_model

    shape = shape_from_hf_config(folders["hub"]).with_(tied_embeddings=True)
    model = build_model(shape, SEQ, device="cpu")
    model.init_weights(0)
    load_hf_weights([model], folders["hub"], shape, log=lambda _: None)
    with torch.no_grad():
        assert float((model.eval()(ids) - ref).abs().max()) > 1e-2


def test_export_is_a_text_model_transformers_loads(saved, tmp_path):
    """The export of an image-text source: gemma3_text (Gemma3ForCausalLM), decoder tensors only, same logits."""
    tied, folders, ids, ref = saved
    model = model_from_hf(folders["hub"], SEQ, log=lambda _: None)
    ckpt = tmp_path / "ckpt" / "step-0"
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(ckpt), no_dist=True)
    out = export_checkpoint(ckpt, model.shape, tmp_path / "export", "fp32", source_config=folders["hub"])
    cfg = read_config(out)
    assert cfg["model_type"] == "gemma3_text" and cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert cfg["tie_word_embeddings"] is tied and "vision_config" not in cfg
    names = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    assert not any("vision" in n or "multi_modal" in n or "language_model" in n for n in names)
    text = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(text).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        diff = float((text(ids).logits - ref).abs().max())
    assert diff < TOL, f"export: max |logit diff| {diff:.2e}"


def test_a_checkpoint_without_a_text_decoder_is_refused(saved, tmp_path):
    """Only the vision tower and projector: refused, naming what the folder holds."""
    _, folders, _, _ = saved
    src = folders["modules"]
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        vision = {n: f.get_tensor(n) for n in f.keys() if not n.startswith(("model.language_model.", "lm_head."))}
    (tmp_path / "v").mkdir()
    save_file(vision, str(tmp_path / "v" / "model.safetensors"))
    (tmp_path / "v" / "config.json").write_text((src / "config.json").read_text())
    shape = shape_from_hf_config(tmp_path / "v")
    with pytest.raises(
        WeightsError,
        match=r"holds no text decoder .*found \d+ tensors: model\.multi_modal_projector\.\* \(\d+\), model\.vision_tower\.\* \(\d+\)",
    ):
        scan_checkpoint(tmp_path / "v", shape)
    with pytest.raises(WeightsError, match="holds no text decoder"):
        model_from_hf(tmp_path / "v", SEQ)


def test_a_decoder_stored_twice_is_refused(saved, tmp_path):
    """Both image-text layouts in one folder: which one to train is not guessed."""
    _, folders, _, _ = saved
    with safe_open(str(folders["modules"] / "model.safetensors"), framework="pt") as f:
        both = {n: f.get_tensor(n) for n in f.keys()}
    both["language_model.model.norm.weight"] = both["model.language_model.norm.weight"].clone()
    save_file(both, str(tmp_path / "model.safetensors"))
    shape = shape_from_hf_config(folders["modules"])
    with pytest.raises(WeightsError, match=r"under both model\.language_model\.\* and language_model\.model\.\*"):
        scan_checkpoint(tmp_path, shape)


def test_a_missing_decoder_tensor_is_named_as_stored(saved, tmp_path):
    _, folders, _, _ = saved
    with safe_open(str(folders["modules"] / "model.safetensors"), framework="pt") as f:
        sd = {n: f.get_tensor(n) for n in f.keys() if n != "model.language_model.layers.1.mlp.up_proj.weight"}
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"tensor model\.language_model\.layers\.1\.mlp\.up_proj\.weight: missing"):
        scan_checkpoint(tmp_path, shape_from_hf_config(folders["modules"]))


def test_the_trainer_path_says_it_once_by_default(saved, capsys):
    """load_hf_weights as the trainer calls it (no log given): one printed line (rank 0 only under a group)."""
    _, folders, _, _ = saved
    model_from_hf(folders["hub"], SEQ)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "left out" in ln]
    assert len(lines) == 1 and "image-text checkpoint" in lines[0] and "language_model.model.*" in lines[0], lines
