"""train.grpo prompts through the tokenizer's chat template (nightloom.train.rollout.chat_prompts): a chat-shaped
prompt (a messages list) gets exactly transformers' apply_chat_template ids with the generation prompt, as TRL's
GRPOTrainer renders it; plain text keeps the tokenizer's own ids unless train.grpo.chat_template is true; validate
refuses a chat-shaped dataset for a tokenizer without a chat template, naming FILE and field. Sharded prompts reach
the task rendered alike whether the text field held the messages list or that list JSON-encoded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
import yaml

from nightloom.chat import ChatError
from nightloom.spec import SpecError, TokenizerSpec
from nightloom.spec.load import load_spec
from nightloom.tokenizer import load_tokenizer
from nightloom.train.rollout.chat_prompts import prompt_template
from nightloom.train.rollout.prompts import PromptTable, to_prompts
from tests.support.chat import build_chat_tokenizer

MESSAGES = [{"role": "system", "content": "add the numbers"}, {"role": "user", "content": "two plus three"}]
PLAIN = "one plus four ="


def _hf_ids(folder: Path, messages: list[dict]) -> list[int]:
    out = transformers.AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo-chat")
    return build_chat_tokenizer(root / "tok"), build_chat_tokenizer(root / "bare", template=None)


def test_chat_shaped_prompts_get_transformers_template_ids(folders):
    tok_dir, _ = folders
    tok = load_tokenizer(TokenizerSpec(path=str(tok_dir)))
    table = PromptTable("prompts", [json.dumps(MESSAGES), PLAIN], {"answer": ["5", "5"]})
    template = prompt_template(None, table.texts, str(tok_dir), None)
    chat, plain = to_prompts(table, tok, 200, template)
    assert chat.ids == _hf_ids(tok_dir, MESSAGES) and chat.text == table.texts[0] and chat.columns == {"answer": "5"}
    assert plain.ids == tok.encode(PLAIN)  # plain text: the tokenizer's own ids
    always = prompt_template(True, table.texts, str(tok_dir), None)
    _, plain = to_prompts(table, tok, 200, always)  # chat_template true: a text is one user message
    assert plain.ids == _hf_ids(tok_dir, [{"role": "user", "content": PLAIN}])
    assert prompt_template(None, [PLAIN], str(tok_dir), None) is None  # nothing chat-shaped: no template


def test_chat_prompts_without_a_template_are_refused(folders):
    tok_dir, bare = folders
    chat = [json.dumps(MESSAGES)]
    with pytest.raises(ChatError, match=r"train.grpo.chat_template: false, but prompt 0 is a list of messages"):
        prompt_template(False, chat, str(tok_dir), None)
    with pytest.raises(ChatError, match=r"has no chat template"):
        prompt_template(None, chat, str(bare), None)
    with pytest.raises(ChatError, match=r"model.tokenizer: .* got 'bytes'"):
        prompt_template(True, [PLAIN], None, None)


def _spec(tmp_path: Path, tok, rows: list[dict], **grpo) -> Path:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    spec = {
        "name": "grpo-chat",
        "model": {"tokenizer": str(tok), "vocab": "tokenizer"},
        "dataset": {"path": str(data), "text_field": "prompt", "keep_columns": ["answer"]},
        "train": {"task": "grpo", "grpo": grpo},
    }
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(spec, sort_keys=False))
    return p


def test_validate_refuses_a_chat_dataset_for_a_tokenizer_without_a_template(tmp_path, folders):
    tok_dir, bare = folders
    chats = [{"prompt": MESSAGES, "answer": "5"}]
    assert load_spec(_spec(tmp_path, tok_dir, chats)).train.grpo.chat_template is None
    p = _spec(tmp_path, bare, chats)
    with pytest.raises(SpecError) as ei:
        load_spec(p)
    (err,) = ei.value.errors
    assert f"{p}:" in err and "dataset.text_field:" in err and f"tokenizer {bare} has no chat template" in err
    p = _spec(tmp_path, bare, [{"prompt": json.dumps(MESSAGES), "answer": "5"}])  # the list JSON-encoded
    with pytest.raises(SpecError) as ei:
        load_spec(p)
    assert "dataset.text_field: 'prompt' holds messages lists (chats)" in ei.value.errors[0]
    p = _spec(tmp_path, bare, [{"prompt": PLAIN, "answer": "5"}], chat_template=True)
    with pytest.raises(SpecError) as ei:
        load_spec(p)
    assert any(f"{p}:" in e and "train.grpo.chat_template:" in e for e in ei.value.errors), ei.value.errors
    assert load_spec(_spec(tmp_path, bare, [{"prompt": PLAIN, "answer": "5"}])).train.task == "grpo"


def test_the_grpo_task_renders_sharded_chat_prompts(tmp_path, folders):
    from nightloom.sharding import shard_dataset
    from nightloom.spec import DatasetSpec, ShardingSpec
    from nightloom.train.job import TrainJob
    from nightloom.train.rollout.task import GRPOLayout, GRPOTask
    from tests.support.harness import make_job

    tok_dir, _ = folders
    chats = [[{"role": "user", "content": f"{i} plus {i + 1}"}] for i in range(6)]
    data = tmp_path / "prompts.jsonl"
    # odd rows hold the messages list itself, even rows the list JSON-encoded: the shard stage stores both alike
    data.write_text("".join(json.dumps({"prompt": c if i % 2 else json.dumps(c), "answer": str(2 * i + 1)}) + "\n"
                            for i, c in enumerate(chats)))  # fmt: skip
    tokenizer = TokenizerSpec(path=str(tok_dir))
    sharding = ShardingSpec(output=str(tmp_path / "shards"), num_shards=1, tolerance=0.9)
    shard_dataset(
        DatasetSpec(path=str(data), text_field="prompt", keep_columns=["answer"]), sharding, tokenizer=tokenizer
    )
    grpo = {"prompts_per_step": 2, "num_generations": 2, "max_completion_tokens": 4}
    path = make_job(tmp_path / "run", tmp_path / "shards", steps=1, seq_len=64, global_batch=4,
                    train_kw={"task": "grpo", "grpo": grpo}, job_kw={"tokenizer": tokenizer})  # fmt: skip
    task = GRPOTask(TrainJob.model_validate_json(path.read_text()), GRPOLayout(1, 0, 1, False, 4), log=lambda _: None)
    got = sorted(p.ids for p in task.stream.prompts)
    assert got == sorted(_hf_ids(tok_dir, c) for c in chats)
