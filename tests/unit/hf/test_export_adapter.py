"""What a LoRA or full export hands a user: an adapter `AutoPeftModelForCausalLM` loads alone (its base the run's
weights folder, or the unmerged base the export writes when there is none) with the merged export's logits; every
tokenizer and chat-template file; files as readable as the rest of the run (umask); no torch no_dist warning and
no tqdm bar in the output."""

from __future__ import annotations

import json
import os
import stat
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from nightloom.hf.export import ADAPTER_DIR, BASE_DIR, adapter_base, export_checkpoint, tokenizer_files
from nightloom.hf.load import model_from_hf
from nightloom.hf.random_model import build_random_model
from nightloom.train.lora import LoraSettings, apply_lora

SMALL = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "initializer_range": 0.25,
}
LORA = LoraSettings(4, 8.0, 0.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
TEMPLATE = "{% for m in messages %}<{{ m.role }}> {{ m.content }}\n{% endfor %}"


@pytest.fixture
def weights(tmp_path):
    """A small random qwen2 folder (q/k/v biases not zero): the run's model.weights."""
    return build_random_model(tmp_path / "qwen2", "qwen2", seed=3, bias_std=0.3, **SMALL)


def _lora_checkpoint(weights, tmp_path):
    """(native model with trained-looking adapters, its DCP checkpoint) started from `weights`."""
    model = model_from_hf(weights, 32)
    apply_lora(model, LORA)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # B starts at 0: give the adapters an effect
    ckpt = tmp_path / "ckpt" / "step-1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(ckpt), no_dist=True)
    return model, ckpt


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _autopeft_matches_merged(out, native, ids) -> float:
    """The largest |AutoPeft(adapter) - merged export| logit difference; both also match the native model."""
    import peft

    adapted = peft.AutoPeftModelForCausalLM.from_pretrained(str(out / ADAPTER_DIR)).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    a, m = _logits(adapted, ids), _logits(merged, ids)
    with torch.no_grad():
        torch.testing.assert_close(m, native(ids), rtol=0, atol=1e-4)
    return (a - m).abs().max().item()


def test_adapter_base_is_the_weights_folder_and_autopeft_gives_the_merged_logits(weights, tmp_path):
    native, ckpt = _lora_checkpoint(weights, tmp_path)
    out = export_checkpoint(
        ckpt, native.shape, tmp_path / "export", "fp32", source_config=weights, lora=LORA, base=str(weights)
    )
    cfg = json.loads((out / ADAPTER_DIR / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(weights.resolve())
    assert not (out / BASE_DIR).exists()  # the weights folder is the base: no copy
    ids = torch.randint(0, SMALL["vocab_size"], (2, 16))
    assert _autopeft_matches_merged(out, native, ids) < 1e-4


def test_a_run_without_weights_exports_its_unmerged_base_for_the_adapter(weights, tmp_path):
    native, ckpt = _lora_checkpoint(weights, tmp_path)  # as a model.config-only run: nothing on disk names the base
    out = export_checkpoint(ckpt, native.shape, tmp_path / "export", "fp32", source_config=weights, lora=LORA)
    cfg = json.loads((out / ADAPTER_DIR / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str((tmp_path / "export" / BASE_DIR).absolute())
    base = transformers.AutoModelForCausalLM.from_pretrained(str(out / BASE_DIR)).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(weights)).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 16))
    torch.testing.assert_close(_logits(base, ids), _logits(ref, ids), rtol=0, atol=1e-5)  # the base, unmerged
    assert _autopeft_matches_merged(out, native, ids) < 1e-4


def test_adapter_base_rule():
    assert adapter_base(None, "/runs/r1/export") == f"/runs/r1/export/{BASE_DIR}"
    assert adapter_base("s3://bucket/models/qwen2", "/x") == "s3://bucket/models/qwen2"  # as given
    assert adapter_base("Qwen/Qwen2-0.5B", "/x") == "Qwen/Qwen2-0.5B"  # a Hub id, not a local folder


def _tokenizer(folder):
    """A fast tokenizer saved as transformers 5 saves one: the template in chat_template.jinja, not in the config."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<eos>": 1} | {w: i + 2 for i, w in enumerate("hi there user assistant".split())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(folder))
    (folder / "added_tokens.json").write_text("{}\n")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("tools: {{ messages | length }}")
    (folder / "model-00001-of-00001.safetensors").write_bytes(b"")  # not a tokenizer file
    assert (folder / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
    return folder


def test_export_carries_every_tokenizer_and_template_file(weights, tmp_path):
    tok = _tokenizer(tmp_path / "tok")
    names = {p.relative_to(tok).as_posix() for p in tokenizer_files(tok)}
    assert {"chat_template.jinja", "added_tokens.json", "additional_chat_templates/tool_use.jinja"} <= names
    model = model_from_hf(weights, 32)
    ckpt = tmp_path / "ckpt"
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(ckpt), no_dist=True)
    out = export_checkpoint(ckpt, model.shape, tmp_path / "export", "fp32", source_config=weights, tokenizer=tok)
    assert {n for n in names} <= {p.relative_to(out).as_posix() for p in out.rglob("*")}
    loaded = transformers.AutoTokenizer.from_pretrained(str(out))
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "there"}]
    assert loaded.apply_chat_template(chat, tokenize=False) == "<user> hi\n<assistant> there\n"
    assert loaded.apply_chat_template(chat, tokenize=False, chat_template="tool_use") == "tools: 2"

    own = tmp_path / "own.jinja"  # the run's model.chat_template wins, as it did in training
    own.write_text("{% for m in messages %}[{{ m.role }}]{% endfor %}")
    out = export_checkpoint(ckpt, model.shape, tmp_path / "x", "fp32", tokenizer=tok, chat_template=own)
    assert transformers.AutoTokenizer.from_pretrained(str(out)).apply_chat_template(chat, tokenize=False) == (
        "[user][assistant]"
    )


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def _modes(folder) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [folder, *folder.rglob("*")]}


def test_export_and_weights_get_the_umask_mode_not_0600(weights, tmp_path, umask_027):
    built = build_random_model(tmp_path / "built", "llama", seed=1, **SMALL)
    assert set(_modes(built).values()) <= {0o640, 0o750}, _modes(built)
    native, ckpt = _lora_checkpoint(weights, tmp_path)
    out = export_checkpoint(ckpt, native.shape, tmp_path / "export", "bf16", source_config=weights, lora=LORA)
    modes = _modes(out)
    assert modes["adapter/adapter_model.safetensors"] == 0o640 and modes["model-00001-of-00001.safetensors"] == 0o640
    assert all(m == (0o750 if (out / p).is_dir() else 0o640) for p, m in modes.items()), modes


def test_export_and_eval_reads_and_weights_builds_are_quiet(weights, tmp_path, capfd):
    from nightloom.train import checkpoint

    native, ckpt = _lora_checkpoint(weights, tmp_path)
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        export_checkpoint(ckpt, native.shape, tmp_path / "export", "bf16", lora=LORA, base=str(weights))
        checkpoint.load_weights(ckpt, native)  # what `nightloom eval` reads a checkpoint with
        build_random_model(tmp_path / "sharded", "llama", seed=1, max_shard_size="20KB", **SMALL)
        warnings.warn("other warnings still show", UserWarning, stacklevel=1)
    messages = [str(w.message) for w in seen]
    assert not [m for m in messages if "torch.distributed is disabled" in m], messages
    assert "other warnings still show" in messages
    assert "Writing model shards" not in capfd.readouterr().err
    assert transformers.utils.logging.is_progress_bar_enabled()  # restored after the call


def test_a_dora_adapter_loads_with_peft_and_gives_the_native_and_merged_logits(weights, tmp_path):
    """train.lora.use_dora: the export's adapter (its magnitude as PEFT's lora_magnitude_vector, use_dora in the
    config) loads with PeftModel.from_pretrained onto the base and scores like the native model and the merged
    export."""
    import peft

    dora = LoraSettings(LORA.rank, LORA.alpha, 0.0, LORA.modules, dora=True)
    model = model_from_hf(weights, 32)
    apply_lora(model, dora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_magnitude_delta" in name:
                p.normal_(0, 0.05)  # adapters and magnitudes that moved
    ckpt = tmp_path / "ckpt" / "step-1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(ckpt), no_dist=True)
    out = export_checkpoint(
        ckpt, model.shape, tmp_path / "export", "fp32", source_config=weights, lora=dora, base=str(weights)
    )
    assert json.loads((out / ADAPTER_DIR / "adapter_config.json").read_text())["use_dora"] is True
    base = transformers.AutoModelForCausalLM.from_pretrained(str(weights)).eval()
    adapted = peft.PeftModel.from_pretrained(base, str(out / ADAPTER_DIR)).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 16))
    with torch.no_grad():
        native = model(ids)
    assert (native - _logits(transformers.AutoModelForCausalLM.from_pretrained(str(weights)), ids)).abs().max() > 1e-2
    torch.testing.assert_close(_logits(adapted, ids), native, rtol=0, atol=1e-4)
    torch.testing.assert_close(_logits(merged, ids), native, rtol=0, atol=1e-4)


def test_merged_export_switch(weights, tmp_path):
    """train.lora.merged_export: off (a QLoRA run's default) writes the adapter alone, with its tokenizer, and no
    merged model; the adapter still gives the native logits. The spec's default follows quantize, and lm-eval
    benchmarks, which score the merged export, are refused without it."""
    import peft

    from nightloom.spec import LoraSpec, RunSpec

    native, ckpt = _lora_checkpoint(weights, tmp_path)
    tok = _tokenizer(tmp_path / "tok")
    lora = LoraSettings(LORA.rank, LORA.alpha, 0.0, LORA.modules, merged=False)
    out = export_checkpoint(
        ckpt, native.shape, tmp_path / "export", "fp32", tokenizer=tok, lora=lora, base=str(weights)
    )
    assert not list(out.glob("*.safetensors")) and not (out / "config.json").exists()
    assert all((out / ADAPTER_DIR / f.relative_to(tok)).is_file() for f in tokenizer_files(tok))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(weights)).eval()
    adapted = peft.PeftModel.from_pretrained(base, str(out / ADAPTER_DIR)).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(_logits(adapted, ids), native(ids), rtol=0, atol=1e-4)

    assert LoraSettings.from_spec(LoraSpec(rank=4)).merged
    assert not LoraSettings.from_spec(LoraSpec(rank=4, quantize="nf4")).merged
    assert LoraSettings.from_spec(LoraSpec(rank=4, quantize="nf4", merged_export=True)).merged
    data = {"name": "q", "dataset": {"path": "/d.jsonl"}, "validate": {"benchmarks": {"tasks": ["demo"]}}}
    with pytest.raises(ValueError, match="train.lora.merged_export: true"):
        RunSpec.model_validate({**data, "train": {"lora": {"rank": 4, "quantize": "nf4"}}})
    lora_on = {"rank": 4, "quantize": "nf4", "merged_export": True}
    assert RunSpec.model_validate({**data, "train": {"lora": lora_on}}).train.lora.merged_export
