"""Bad sft specs are refused at validate time, before anything is rented: a tokenizer without a chat template
(naming the field and the tokenizer), a tokenizer that is not a Hugging Face folder, chat styles without
train.task sft, XTuner with sft, and a dataset whose first record is no chat; a good spec loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nightloom.spec import SpecError
from nightloom.spec.load import load_spec
from tests.support.chat import CHATML, build_chat_tokenizer, chat_messages, write_chats


@pytest.fixture
def files(tmp_path):
    tok = build_chat_tokenizer(tmp_path / "tok")
    bare = build_chat_tokenizer(tmp_path / "bare", template=None)
    chats = write_chats(tmp_path / "chats.jsonl", chat_messages(4))
    return tok, bare, chats


def _spec(tmp_path: Path, tok, data, **sections) -> Path:
    spec = {
        "name": "sft",
        "model": {"tokenizer": str(tok), "vocab": "tokenizer"},
        "dataset": {"path": str(data)},
        "train": {"task": "sft"},
    }
    for k, v in sections.items():
        spec[k] = {**spec.get(k, {}), **v}
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(spec, sort_keys=False))
    return p


def _errors(p: Path) -> list[str]:
    with pytest.raises(SpecError) as ei:
        load_spec(p)
    return ei.value.errors


def test_a_good_sft_spec_loads_and_keeps_its_template_path(tmp_path, files):
    tok, bare, chats = files
    assert load_spec(_spec(tmp_path, tok, chats)).train.task == "sft"
    (tmp_path / "chatml.jinja").write_text(CHATML)
    spec = load_spec(_spec(tmp_path, bare, chats, model={"chat_template": "chatml.jinja"}))
    assert spec.model.chat_template == str(tmp_path / "chatml.jinja")  # relative to the spec's folder


def test_a_tokenizer_without_a_chat_template_is_refused_naming_field_and_tokenizer(tmp_path, files):
    _, bare, chats = files
    p = _spec(tmp_path, bare, chats)
    (err,) = _errors(p)
    assert f"{p}:" in err and f"model.chat_template: tokenizer {bare} has no chat template" in err
    (err,) = _errors(_spec(tmp_path, bare, chats, model={"chat_template": "missing.jinja"}))
    assert "model.chat_template: file not found: " + str(tmp_path / "missing.jinja") in err


@pytest.mark.parametrize(
    ("sections", "field", "words"),
    [
        ({"model": {"tokenizer": "bytes", "vocab": None}}, "model.tokenizer", "a Hugging Face tokenizer folder"),
        ({"train": {"task": "pretrain"}, "dataset": {"style": "messages"}}, "dataset.style", "train.task: sft"),
        ({"train": {"backend": "xtuner", "xtuner": {}}}, "train.task", "native backend"),
    ],
    ids=["bytes-tokenizer", "chat-style-pretrain", "xtuner"],
)
def test_other_sft_misconfigurations_name_their_field(tmp_path, files, sections, field, words):
    tok, _, chats = files
    errs = _errors(_spec(tmp_path, tok, chats, **sections))
    assert any(f"{field}: " in e and words in e for e in errs), errs


def test_a_dataset_of_plain_text_for_sft_is_refused(tmp_path, files):
    tok, _, _ = files
    (tmp_path / "text.jsonl").write_text('{"text": "just text"}\n')
    (err,) = _errors(_spec(tmp_path, tok, tmp_path / "text.jsonl"))
    assert "dataset.style: train.task sft reads chat records; the first record has none of messages" in err
