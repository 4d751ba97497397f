"""Chat records for supervised fine-tuning: a record as messages, the chat template, and the assistant labels.

`to_messages` turns an OpenAI (`messages`: role/content), ShareGPT (`conversations`: from/value with human, gpt,
system) or Alpaca (instruction, input, output, optional system) record into checked messages; any problem (an
unknown role, no messages, no assistant turn, a content that is not a string) is a ChatError (a ValueError),
which the shard stage reports as file:line.

`ChatRenderer.render` gives a conversation's ids and labels with transformers' apply_chat_template, by the prefix
rule: assistant message i's labels are the ids that the template of messages[:i+1] adds after the template of
messages[:i] with the generation prompt; every other id is context. Each such prefix must be a prefix of the whole
conversation's ids (else the conversation is refused with the reason), and a template with `{% generation %}`
markers must give the same assistant mask. The first id is never a label (nothing predicts it).

EOS: none is appended when the last assistant turn already ends in an end token (the tokenizer's EOS, or any
special token such as ChatML's <|im_end|> or Llama 3's <|eot_id|>): the conversation's ids are exactly the
template's. A template whose assistant turn adds no end token gets the EOS appended after a conversation that ends
with an assistant turn, as a label, so the model learns to stop.

A conversation longer than `seq_len + 1` ids is cut after its longest run of whole turns that ends with an
assistant turn and fits, or dropped when none does (`Conversation.cut`, or None).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from nightloom.records import FrozenRecord

CHAT_STYLES = ("messages", "sharegpt", "alpaca")
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
TEMPLATE_FILE = "chat_template.jinja"


class ChatError(ValueError):
    """A chat record or template that cannot give labels; the message says which message and why."""


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids `a` and `b` share: where they first differ."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def require_prefix(part: list[int], whole: list[int], part_name: str, whole_name: str, cause: str) -> None:
    """The prefix rule's premise: `part` (the template's ids of a shorter render) starts `whole`; else a ChatError
    naming both, where they differ and the likely `cause`."""
    if whole[: len(part)] != part:
        raise ChatError(
            f"{part_name} are not a prefix of {whole_name} (they differ at id {common_prefix(part, whole)}): {cause}"
        )


def require_added(before: list[int], after: list[int], where: str, what: str) -> None:
    """A completion or assistant turn must add ids to what it follows: else a ChatError naming it."""
    if len(after) <= len(before):
        raise ChatError(f"{where}: the template adds no ids for {what}")


def detect_style(record: dict) -> str:
    """messages (OpenAI), sharegpt (`conversations`), alpaca (instruction/output), else text."""
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    return "text"


def _string(value, where: str) -> str:
    if not isinstance(value, str):
        raise ChatError(f"{where}: expected a string, got {'null' if value is None else type(value).__name__}")
    return value


def _turns(record: dict, field: str, role_key: str, text_key: str, roles: dict[str, str]) -> list[dict[str, str]]:
    turns = record.get(field)
    if not isinstance(turns, list) or not turns:
        got = "missing" if field not in record else "empty" if turns == [] else f"a {type(turns).__name__}, not a list"
        raise ChatError(f"no messages: {field} is {got}")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ChatError(f"{field}[{i}]: expected an object, got {type(turn).__name__}")
        role = turn.get(role_key)
        if role not in roles:
            raise ChatError(f"{field}[{i}].{role_key}: unknown role {role!r} (expected {', '.join(roles)})")
        out.append({"role": roles[role], "content": _string(turn.get(text_key), f"{field}[{i}].{text_key}")})
    return out


def _alpaca(record: dict) -> list[dict[str, str]]:
    """system? + user (instruction, then a blank line and input when input is not empty) + assistant (output)."""
    instruction = _string(record.get("instruction"), "instruction")
    extra = record.get("input")
    extra = "" if extra is None else _string(extra, "input")
    user = f"{instruction}\n\n{extra}" if extra else instruction
    system = record.get("system")
    head = [{"role": "system", "content": _string(system, "system")}] if system not in (None, "") else []
    return [
        *head,
        {"role": "user", "content": user},
        {"role": "assistant", "content": _string(record.get("output"), "output")},
    ]


def to_messages(record: dict, style: str = "auto") -> list[dict[str, str]]:
    """The record's conversation as [{role, content}] (roles system, user, assistant), checked; ChatError if not
    a usable chat (no messages, an unknown role, a content that is not a string, no assistant turn)."""
    if not isinstance(record, dict):
        raise ChatError(f"expected a JSON object, got {type(record).__name__}")
    kind = detect_style(record) if style == "auto" else style
    if kind == "messages":
        messages = _turns(record, "messages", "role", "content", {r: r for r in ROLES})
    elif kind == "sharegpt":
        messages = _turns(record, "conversations", "from", "value", SHAREGPT_ROLES)
    elif kind == "alpaca":
        messages = _alpaca(record)
    else:
        raise ChatError(
            "no messages: a chat record has `messages` (role/content), `conversations` (from/value) or "
            "instruction/input/output" + (f" (dataset.style {style})" if style != "auto" else "")
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatError("no assistant turn: nothing to learn from this conversation")
    return messages


def prompt_messages(value: object) -> list[dict[str, str]] | None:
    """A chat-shaped prompt's messages (train.grpo: a list of {role, content}, or that list JSON-encoded, as the
    shard stage stores it), or None when `value` is plain text or anything else."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in value):
        return None
    return [{"role": m["role"], "content": m["content"]} for m in value]


def template_text(tokenizer_dir: str | Path, chat_template: str | Path | None = None) -> str:
    """The chat template: the `chat_template` file when given, else the tokenizer's own (tokenizer_config.json's
    `chat_template`, or chat_template.jinja beside it). ChatError naming the field and tokenizer when none."""
    import json

    if chat_template is not None:
        p = Path(chat_template).expanduser()
        if not p.is_file():
            raise ChatError(f"model.chat_template: file not found: {p}")
        return p.read_text(encoding="utf-8")
    folder = Path(tokenizer_dir).expanduser()
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    cfg = folder / "tokenizer_config.json"
    found = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template") if cfg.is_file() else None
    if isinstance(found, list):  # [{name, template}]: the default one
        found = next((t.get("template") for t in found if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(found, str) or not found.strip():
        raise ChatError(
            f"model.chat_template: tokenizer {folder} has no chat template (no `chat_template` in "
            f"tokenizer_config.json, no {TEMPLATE_FILE}); set model.chat_template to a Jinja file"
        )
    return found


def template_id(template: str) -> str:
    return "sha256:" + hashlib.sha256(template.encode("utf-8")).hexdigest()


def chat_settings(spec) -> ChatSettings | None:
    """A RunSpec's chat settings (None unless train.task is sft): its style, template and seq_len. ChatError when
    the tokenizer is not a Hugging Face folder or has no template and model.chat_template names none."""
    if spec.train.task not in ("sft", "dpo"):
        return None
    tok = spec.model.tokenizer
    if tok.path is None or tok.kind not in ("auto", "hf") or not Path(tok.path).expanduser().is_dir():
        raise ChatError(
            "model.tokenizer: train.task sft renders chats with transformers' apply_chat_template, which needs a "
            f"Hugging Face tokenizer folder (tokenizer.json), got {tok.path or 'bytes'!r}"
        )
    template = template_text(tok.path, spec.model.chat_template)
    return ChatSettings(style=spec.dataset.style, template=template, seq_len=spec.train.seq_len, task=spec.train.task)


class ChatSettings(FrozenRecord):
    """What the shard stage and evaluation need to turn chat records into ids and labels (the template's text
    itself, so every worker renders with exactly the template the settings hash covers)."""

    style: str = "auto"
    template: str
    seq_len: int  # conversations longer than seq_len + 1 ids are cut or dropped
    task: Literal["sft", "dpo"] = "sft"  # dpo: records are preference pairs (nightloom/chat_pairs.py)

    @property
    def template_id(self) -> str:
        return template_id(self.template)


@dataclass(frozen=True)
class Conversation:
    """A rendered conversation: its ids, a 0/1 label per id (aligned), its text, and whether it was cut."""

    ids: list[int]
    labels: list[int]
    text: str
    cut: bool = False
    eos_added: bool = False

    @property
    def label_tokens(self) -> int:
        return sum(self.labels)


class ChatRenderer:
    """Renders conversations with one tokenizer folder (loaded by transformers) and one template."""

    def __init__(self, tokenizer_dir: str | Path, template: str, seq_len: int | None = None):
        import transformers

        self.tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.template = template
        self.seq_len = seq_len
        self.markers = bool(GENERATION_MARKER.search(template))
        self.eos_id = self.tok.eos_token_id
        if self.eos_id is None:
            raise ChatError(f"model.tokenizer: {tokenizer_dir} has no eos_token")
        special = {i for i, t in self.tok.added_tokens_decoder.items() if getattr(t, "special", False)}
        self.end_ids = frozenset(special | set(self.tok.all_special_ids) | {self.eos_id})
        self._lock = threading.Lock()  # transformers sets truncation/padding on the shared Rust tokenizer per call

    def _ids(self, messages: list[dict], generation_prompt: bool = False, mask: bool = False):
        from jinja2 import TemplateError

        try:
            with self._lock:
                out = self.tok.apply_chat_template(
                    messages,
                    chat_template=self.template,
                    tokenize=True,
                    return_dict=True,
                    add_generation_prompt=generation_prompt,
                    return_assistant_tokens_mask=mask,
                )
        except TemplateError as e:  # the template's own raise_exception (a role order it refuses) or a bad template
            raise ChatError(f"the chat template refused this conversation: {e}") from None
        return (list(out["input_ids"]), list(out["assistant_masks"])) if mask else list(out["input_ids"])

    def ids(self, messages: list[dict], generation_prompt: bool = False) -> list[int]:
        """The template's ids of `messages` (with the generation prompt when asked): ChatError if it refuses."""
        return self._ids(messages, generation_prompt)

    def encode(self, text: str) -> list[int]:
        """A plain text's ids by the tokenizer's own rules (preference pairs in the plain-text form)."""
        with self._lock:
            return list(self.tok(text)["input_ids"])

    def text(self, messages: list[dict]) -> str:
        """The rendered conversation (what the shard's text column keeps)."""
        with self._lock:
            return self.tok.apply_chat_template(messages, chat_template=self.template, tokenize=False)

    def labels(self, messages: list[dict]) -> tuple[list[int], list[int], list[int]]:
        """(ids, labels by the prefix rule, the end of each assistant turn in ids). ChatError with the reason when
        a prefix is not a prefix of the whole, or the template's generation mask disagrees."""
        if messages and messages[0]["role"] == "assistant":
            raise ChatError("messages[0] is an assistant turn: the prefix rule needs a turn before it")
        ids = self._ids(messages)
        labels = [0] * len(ids)
        ends: list[int] = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._ids(messages[:i], generation_prompt=True)
            after = self._ids(messages[: i + 1])
            for what, p in ((f"messages[:{i}] with the generation prompt", before), (f"messages[:{i + 1}]", after)):
                require_prefix(
                    p,
                    ids,
                    f"messages[{i}]: the template's ids of {what}",
                    "the whole conversation's",
                    "the template renders a turn differently once later turns follow, or tokens merge across a "
                    "turn boundary",
                )
            require_added(before, after, f"messages[{i}]", "this assistant turn")
            labels[len(before) : len(after)] = [1] * (len(after) - len(before))
            ends.append(len(after))
        if self.markers:
            _, mask = self._ids(messages, mask=True)
            if mask != labels:
                at = common_prefix(mask, labels)
                raise ChatError(
                    f"the template's {{% generation %}} mask and the prefix rule disagree at id {at} "
                    f"({self.tok.convert_ids_to_tokens(ids[at])!r}: mask {mask[at]}, prefix rule {labels[at]}); "
                    "fix the markers or use a template without them (model.chat_template)"
                )
        return ids, labels, ends

    def render(self, messages: list[dict]) -> Conversation | None:
        """The conversation as ids and labels, cut to seq_len + 1 ids at a turn boundary; None when no run of whole
        turns ending with an assistant turn fits (dropped)."""
        ids, labels, ends = self.labels(messages)
        limit = None if self.seq_len is None else self.seq_len + 1
        cut = False
        needs_eos = messages[-1]["role"] == "assistant" and not self._ends_turn(ids, labels, ends[-1])
        if limit is not None and len(ids) + needs_eos > limit:
            fits = [e for e in ends if e + (not self._ends_turn(ids, labels, e)) <= limit]
            if not fits:
                return None
            end = fits[-1]
            ids, labels, cut = ids[:end], labels[:end], True
            needs_eos = not self._ends_turn(ids, labels, end)
        text = self.text(messages if not cut else messages[: self._turns_in(messages, ends, len(ids))])
        if needs_eos:
            ids, labels = [*ids, self.eos_id], [*labels, 1]
        labels[0] = 0  # nothing predicts the first id
        if not any(labels):
            raise ChatError("no assistant tokens: the template adds no ids for any assistant turn")
        return Conversation(ids, labels, text, cut, needs_eos)

    def _ends_turn(self, ids: list[int], labels: list[int], end: int) -> bool:
        """Whether the assistant turn ending at `end` holds an end token among its labels."""
        start = end
        while start > 0 and labels[start - 1]:
            start -= 1
        return any(i in self.end_ids for i in ids[start:end])

    @staticmethod
    def _turns_in(messages: list[dict], ends: list[int], end: int) -> int:
        """How many messages a cut at `end` keeps (through the assistant turn that ends there)."""
        k = ends.index(end)
        return [i for i, m in enumerate(messages) if m["role"] == "assistant"][k] + 1


_RENDERERS: dict[tuple, ChatRenderer] = {}
_RENDERERS_LOCK = threading.Lock()


def renderer(tokenizer_dir: str | Path, settings: ChatSettings) -> ChatRenderer:
    """One renderer per (tokenizer folder, template, seq_len) in a process."""
    key = (str(Path(tokenizer_dir).expanduser().resolve()), settings.template_id, settings.seq_len)
    with _RENDERERS_LOCK:
        found = _RENDERERS.get(key)
    if found is None:
        found = ChatRenderer(tokenizer_dir, settings.template, settings.seq_len)
        with _RENDERERS_LOCK:
            _RENDERERS[key] = found
    return found
