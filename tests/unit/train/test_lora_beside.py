"""What trains beside LoRA's adapters (train.lora.modules_to_save, trainable_token_indices; train/lora.train_beside)
against PEFT's own model with the same LoraConfig on the same tiny Llama: the step-1 loss and every trained
tensor's gradient within 1e-4; the adapter-only checkpoint keeps them and a fresh model restored from it scores
the same; the export loads with PeftModel.from_pretrained and gives nightloom's logits within 1e-4; validate
refuses bad names and layouts with FILE:LINE: field.path."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from nightloom.hf.export import ADAPTER_DIR, export_checkpoint
from nightloom.hf.names import to_hf
from nightloom.train.checkpoint import adapter_state, load_weights
from nightloom.train.lora import LoraSettings, apply_lora
from nightloom.train.model import build_model
from nightloom.train.parallelize import loss_fn
from nightloom.train.preference.reference import adapters_disabled
from tests.support.tiny_llama import CONFIG, MODULES, native_lora_model, save_tiny_llama

TOKENS = (3, 7, 100)  # "new special tokens": rows of the embedding
SAVED = LoraSettings(8, 16.0, 0.0, MODULES, saved=("embed_tokens", "lm_head"))
ROWS = LoraSettings(8, 16.0, 0.0, MODULES, tokens=TOKENS)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("llama"))


def _native(folder, lora: LoraSettings):
    return native_lora_model(folder, lora)[0]


def _peft(folder, lora: LoraSettings):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    kw = {"modules_to_save": list(lora.saved)} if lora.saved else {"trainable_token_indices": list(lora.tokens)}
    cfg = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0, target_modules=list(lora.modules), **kw)
    return get_peft_model(base, cfg).train()


def _peft_name(name: str, shape) -> str:
    """PEFT's parameter of one of ours: adapters under the adapter's name, a saved module's copy, the token rows."""
    if name.endswith("lora_tokens_delta"):
        return "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta.default"
    if ".lora_" not in name:  # a module trained in full: PEFT trains its copy
        stem = to_hf(name, shape)[: -len(".weight")]
        return f"base_model.model.{stem}.modules_to_save.default.weight"
    return "base_model.model." + to_hf(name, shape).replace(".weight", ".default.weight")


def _ids(g: torch.Generator) -> torch.Tensor:
    """Two rows with every trained token in them."""
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 33), generator=g)
    ids[:, 5], ids[:, 11], ids[0, 20] = TOKENS[0], TOKENS[1], TOKENS[2]
    return ids


def _moved(model, g: torch.Generator) -> None:
    """B, the token deltas and the saved modules moved from their start, so every path has an effect."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and not name.endswith("lora_A.weight"):
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.mark.parametrize("lora", [SAVED, ROWS], ids=["modules_to_save", "trainable_tokens"])
def test_step_one_loss_and_grads_equal_peft(llama_dir, lora):
    model, ref = _native(llama_dir, lora), _peft(llama_dir, lora)
    shape, peft_params = model.shape, dict(ref.named_parameters())
    g = torch.Generator().manual_seed(1)
    _moved(model, g)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ours_beside = {n for n, _ in trained if ".lora_A" not in n and ".lora_B" not in n}
    expect = {"tok_embeddings.weight", "output.weight"} if lora.saved else {"tok_embeddings.lora_tokens_delta"}
    assert ours_beside == expect
    with torch.no_grad():
        for name, p in trained:
            other = peft_params[_peft_name(name, shape)]
            assert other.requires_grad, name
            if name.endswith("lora_tokens_delta"):  # PEFT holds the rows' values: base row + our delta
                other.copy_(model.tok_embeddings.weight[list(TOKENS)] + p)
            else:
                other.copy_(p)
    ids = _ids(g)
    loss = loss_fn(model(ids[:, :-1]), ids[:, 1:])
    loss.backward()
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-4, (loss.item(), ref_loss.item())
    for name, p in trained:
        assert p.grad is not None and p.grad.abs().max() > 0, name
        torch.testing.assert_close(p.grad, peft_params[_peft_name(name, shape)].grad, atol=1e-4, rtol=0, msg=name)
    if lora.tokens:  # the adapters off (a DPO reference) give the base rows again
        with torch.no_grad(), adapters_disabled(model), ref.disable_adapter():
            x = ids[:, :-1]
            torch.testing.assert_close(model(x), ref(input_ids=x).logits, atol=1e-4, rtol=0)


def _save(state: dict, ckpt, adapters_only: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": state}, checkpoint_id=str(ckpt), no_dist=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": 1, "adapters_only": adapters_only}))


@pytest.mark.parametrize("lora", [SAVED, ROWS], ids=["modules_to_save", "trainable_tokens"])
def test_adapter_checkpoint_keeps_them_and_the_export_loads_with_peft(llama_dir, tmp_path, lora):
    import peft
    import transformers

    model = _native(llama_dir, lora)
    _moved(model, torch.Generator().manual_seed(2))
    ids = _ids(torch.Generator().manual_seed(3))[:, :-1]
    with torch.no_grad():
        native = model(ids)
    kept = adapter_state(model, get_model_state_dict(model))
    beside = {"tok_embeddings.weight", "output.weight"} if lora.saved else {"tok_embeddings.lora_tokens_delta"}
    assert beside <= set(kept) and "layers.0.attn.wq.weight" not in kept and "norm.weight" not in kept
    ckpt = tmp_path / "ckpt" / "step-1"
    _save(kept, ckpt, adapters_only=True)
    restored = _native(llama_dir, lora)  # the base again, adapters at their start: resume fills them
    load_weights(ckpt, restored)
    with torch.no_grad():
        torch.testing.assert_close(restored(ids), native, atol=0, rtol=0)

    out = export_checkpoint(
        ckpt, model.shape, tmp_path / "export", "fp32", source_config=llama_dir, lora=lora, base=str(llama_dir)
    )
    cfg = json.loads((out / ADAPTER_DIR / "adapter_config.json").read_text())
    assert cfg["modules_to_save"] == (list(lora.saved) or None)
    assert cfg["trainable_token_indices"] == (list(lora.tokens) or None)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(llama_dir)).eval()
    with torch.no_grad():
        assert (base(ids).logits - native).abs().max() > 1e-2
        adapted = peft.PeftModel.from_pretrained(base, str(out / ADAPTER_DIR)).eval()
        torch.testing.assert_close(adapted(ids).logits, native, atol=1e-4, rtol=0)
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
        torch.testing.assert_close(merged(ids).logits, native, atol=1e-4, rtol=0)


def test_a_tied_embedding_saved_exports_both_names_and_refuses_token_rows(tmp_path):
    """A tied embedding is one matrix: modules_to_save trains it as the head too, and the adapter names both so
    PEFT's head is not left tied to the untrained base; token rows alone are refused by name."""
    import peft
    import transformers

    folder = tmp_path / "tied"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**(CONFIG | {"tie_word_embeddings": True}))).save_pretrained(
        folder
    )
    lora = LoraSettings(8, 16.0, 0.0, MODULES, saved=("embed_tokens",))
    model = _native(folder, lora)
    _moved(model, torch.Generator().manual_seed(4))
    ckpt = tmp_path / "ckpt" / "step-1"
    _save(adapter_state(model, get_model_state_dict(model)), ckpt, adapters_only=True)
    out = export_checkpoint(
        ckpt, model.shape, tmp_path / "export", "fp32", source_config=folder, lora=lora, base=str(folder)
    )
    assert json.loads((out / ADAPTER_DIR / "adapter_config.json").read_text())["modules_to_save"] == [
        "embed_tokens",
        "lm_head",
    ]
    ids = _ids(torch.Generator().manual_seed(5))[:, :-1]
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
        adapted = peft.PeftModel.from_pretrained(base, str(out / ADAPTER_DIR)).eval()
        torch.testing.assert_close(adapted(ids).logits, model(ids), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="trainable_token_indices: .* ties its head"):
        _native(folder, ROWS)
    last = build_model(model.shape, 32, device="meta").keep_layers(1, 2, has_embed=False, has_head=True)
    apply_lora(last, lora)  # a pipeline's last stage: its head is its copy of the tied matrix, trained too
    assert last.output.weight.requires_grad and last.tok_embeddings is None


def test_token_ids_past_the_vocabulary_are_refused(llama_dir):
    with pytest.raises(ValueError, match=r"id 500 is not below .*vocabulary \(128\)"):
        _native(llama_dir, LoraSettings(8, 16.0, 0.0, MODULES, tokens=(3, 500)))


@pytest.mark.parametrize(
    ("lora", "extra", "field", "words"),
    [
        ({"modules_to_save": ["embed_tokens", "wte"]}, {}, "train.lora.modules_to_save", "unknown module ['wte']"),
        ({"trainable_token_indices": [3, -1]}, {}, "train.lora.trainable_token_indices", "negative ids [-1]"),
        ({"trainable_token_indices": [3, 3]}, {}, "train.lora.trainable_token_indices", "repeated ids"),
        (
            {"modules_to_save": ["embed_tokens"], "trainable_token_indices": [3]},
            {},
            "train.lora",
            "trains the whole embedding already",
        ),
        ({"trainable_token_indices": [3]}, {"parallel": {"tp": 2}}, None, "parallel.tp 2 must be 1"),
        ({"modules_to_save": ["lm_head"]}, {"parallel": {"pp": 2}}, None, "parallel.tp 1 and parallel.pp 2 must be 1"),
        ({"modules_to_save": ["lm_head"]}, {"train_task": "dpo"}, None, "adapters off"),
        ({"modules_to_save": ["lm_head"]}, {"train_task": "grpo"}, None, "train.grpo.beta 0.04 scores its reference"),
    ],
)
def test_validate_refuses_bad_names_and_layouts_with_file_line_field(tmp_path, lora, extra, field, words):
    import yaml

    from nightloom.spec import SpecError
    from nightloom.spec.load import load_spec

    train = {"lora": {"rank": 4, **lora}} | ({"task": extra["train_task"]} if "train_task" in extra else {})
    if train.get("task") == "grpo":  # the KL term's reference: the adapters off
        train["grpo"] = {"beta": 0.04, "rewards": [{"fn": "accuracy"}]}
    data = {"name": "l", "dataset": {"path": "d.jsonl"}, "train": train} | {
        k: v for k, v in extra.items() if k != "train_task"
    }
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(SpecError) as err:
        load_spec(path)
    text = str(err.value)
    assert words in text and f"{path}:" in text, text
    if field:
        line = next(
            i
            for i, s in enumerate(path.read_text().splitlines(), 1)
            if s.strip().startswith(field.split(".")[-1] + ":")
        )
        assert f"{path}:{line}: {field}:" in text, text


def test_validate_checks_token_rows_against_the_model(llama_dir, tmp_path):
    """Before any node is rented: an id past the model's vocabulary, and token rows on a tied embedding."""
    import yaml

    from nightloom.spec import SpecError
    from nightloom.spec.load import load_spec

    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    tied = tmp_path / "tied.json"
    tied.write_text(json.dumps(json.loads((llama_dir / "config.json").read_text()) | {"tie_word_embeddings": True}))
    for config, ids, words in [(llama_dir / "config.json", [3, 500], "ids [500] are not below"), (tied, [3], "ties")]:
        data = {"name": "l", "model": {"config": str(config)}, "dataset": {"path": "d.jsonl"}}
        path = tmp_path / "spec.yaml"
        path.write_text(yaml.safe_dump({**data, "train": {"lora": {"trainable_token_indices": ids}}}, sort_keys=False))
        with pytest.raises(SpecError) as err:
            load_spec(path)
        line = next(i for i, s in enumerate(path.read_text().splitlines(), 1) if "trainable_token_indices" in s)
        assert f"{path}:{line}: train.lora.trainable_token_indices: " in str(err.value) and words in str(err.value)
    data["model"]["config"] = str(llama_dir / "config.json")  # ids below its 128 rows: no word on them
    path.write_text(yaml.safe_dump({**data, "train": {"lora": {"trainable_token_indices": [3, 127]}}}))
    with pytest.raises(SpecError) as err:  # the byte tokenizer's 256 ids are still past the model's rows
        load_spec(path)
    assert "model.tokenizer" in str(err.value) and "trainable_token_indices" not in str(err.value)


def test_the_new_fields_keep_a_spec_hash_and_reach_the_settings():
    from nightloom.spec import RunSpec

    data = {"name": "pinned", "dataset": {"path": "/data/corpus.jsonl"}}
    assert RunSpec.model_validate(data).spec_hash() == "4852eacf88b24184"
    spec = RunSpec.model_validate({**data, "train": {"lora": {"modules_to_save": ["lm_head", "embed_tokens"]}}})
    assert LoraSettings.from_spec(spec.train.lora).saved == ("embed_tokens", "lm_head")
    spec = RunSpec.model_validate({**data, "train": {"lora": {"trainable_token_indices": [9, 4]}}})
    assert LoraSettings.from_spec(spec.train.lora).tokens == (9, 4)


@pytest.mark.parametrize("lora", [SAVED, ROWS], ids=["modules_to_save", "trainable_tokens"])
def test_resume_restores_them_and_their_optimizer_state(llama_dir, tmp_path, one_rank, lora):
    """The trainer's save and load (train/checkpoint.py) of an adapter-only checkpoint: the saved modules or token
    rows and their AdamW moments come back, the frozen base is not written, and the next step is the same."""
    from types import SimpleNamespace

    from nightloom.train import checkpoint
    from nightloom.train.lora import trainable
    from nightloom.train.optim import make_optimizer

    t = SimpleNamespace(optimizer="adamw", lr=1e-2, weight_decay=0.01)
    ids = _ids(torch.Generator().manual_seed(6))

    def step(model, opt):
        loss_fn(model(ids[:, :-1]), ids[:, 1:]).backward()
        opt.step()
        opt.zero_grad()

    model = _native(llama_dir, lora)
    opt = make_optimizer(trainable(model), t)
    step(model, opt)
    path, _ = checkpoint.save(tmp_path, 1, [model], [opt], 0, {"adapters_only": True, "base": "b"})
    written = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    beside = ["model.tok_embeddings.weight", "model.output.weight"] if lora.saved else []
    beside += ["model.tok_embeddings.lora_tokens_delta"] if lora.tokens else []
    assert all(k in written for k in beside) and "model.layers.0.attn.wq.weight" not in written
    assert any(k.startswith("optim.state.tok_embeddings.") and k.endswith("exp_avg") for k in written), list(written)
    fresh = _native(llama_dir, lora)
    fresh_opt = make_optimizer(trainable(fresh), t)
    checkpoint.load(path, [fresh], [fresh_opt])
    step(model, opt)
    step(fresh, fresh_opt)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=0, msg=name)
