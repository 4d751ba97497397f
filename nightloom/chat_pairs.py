"""Preference pairs (train.task dpo) as the shard stage stores them: a record checked, rendered with the chat
template by SFT's prefix rule (nightloom/chat.py), and stored as one document.

Record forms (TRL's): conversational, `prompt` (messages) with `chosen` and `rejected` (assistant messages); plain
text, `prompt`, `chosen` and `rejected` strings (the tokenizer's EOS appended to a completion that lacks it, as
TRL does); implicit prompt, `chosen` and `rejected` two whole conversations whose shared leading messages are the
prompt. A bad record is a ChatError naming the field (`rejected: missing`, `rejected: equals chosen`,
`chosen[0].content: empty completion`, `prompt[1].role: unknown role 'bot'`), which the shard stage and the
pre-scan report as FILE:LINE.

Ids: a conversational completion is the ids the template of prompt + completion adds after the template of the
prompt with the generation prompt (which must be a prefix, else refused, as for SFT), plus the EOS when the
completion ends in no end token; a plain-text one starts where prompt and prompt + completion first differ
(`common prefix`, as TRL 1.16). Truncation, TRL's `keep_start`: each of the two sequences is cut to seq_len + 1
ids (its completion's tail is lost, counted as cut); a pair whose prompt alone leaves no completion id in either
is dropped (None).

Stored document: the chosen sequence then the rejected one, labels 1 on each completion and 0 elsewhere (the
first id of each sequence is never a label), so `split_pair` finds the boundary where a run of 1s meets a 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from nightloom.chat import ROLES, ChatError, ChatRenderer, Conversation, common_prefix, require_added, require_prefix


@dataclass(frozen=True)
class Pair:
    """A checked pair: prompt and completions as messages (conversational) or strings (plain text)."""

    prompt: list[dict[str, str]] | str
    chosen: list[dict[str, str]] | str
    rejected: list[dict[str, str]] | str

    @property
    def conversational(self) -> bool:
        return not isinstance(self.chosen, str)


def _messages(value, field: str, completion: bool) -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise ChatError(f"{field}: expected a list of messages, got {type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ChatError(f"{field}[{i}]: expected an object, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ChatError(f"{field}[{i}].role: unknown role {role!r} (expected {', '.join(ROLES)})")
        if completion and role != "assistant":
            raise ChatError(f"{field}[{i}].role: a completion holds assistant turns only, got {role!r}")
        if not isinstance(content, str):
            raise ChatError(f"{field}[{i}].content: expected a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    if completion and not any(m["content"].strip() for m in out):
        raise ChatError(f"{field}: empty completion" if not out else f"{field}[0].content: empty completion")
    return out


def _implicit(chosen: list, rejected: list) -> tuple[list, list, list]:
    """TRL's extract_prompt: the shared leading messages are the prompt."""
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    if k == 0:
        raise ChatError("chosen, rejected: no shared prompt (the two conversations differ from their first message)")
    return chosen[:k], chosen[k:], rejected[k:]


def to_pair(record: dict) -> Pair:
    """The record as a checked Pair (any of the three forms); ChatError naming the field otherwise."""
    if not isinstance(record, dict):
        raise ChatError(f"expected a JSON object, got {type(record).__name__}")
    for field in ("chosen", "rejected"):
        if record.get(field) is None:
            raise ChatError(f"{field}: missing (a preference pair has `chosen` and `rejected`)")
    chosen, rejected, prompt = record["chosen"], record["rejected"], record.get("prompt")
    if isinstance(chosen, str) or isinstance(rejected, str):
        for field, v in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            if not isinstance(v, str):
                got = "missing" if v is None else f"a {type(v).__name__}"
                raise ChatError(f"{field}: the plain-text form has string prompt, chosen and rejected; got {got}")
        for field, v in (("chosen", chosen), ("rejected", rejected)):
            if not v.strip():
                raise ChatError(f"{field}: empty completion")
        pair = Pair(prompt, chosen, rejected)
    elif prompt is None:
        p, c, r = _implicit(_messages(chosen, "chosen", False), _messages(rejected, "rejected", False))
        for field, part in (("chosen", c), ("rejected", r)):
            _messages(part, field, True)
        pair = Pair(p, c, r)
    else:
        pair = Pair(
            _messages(prompt, "prompt", False), _messages(chosen, "chosen", True), _messages(rejected, "rejected", True)
        )
    if pair.chosen == pair.rejected:
        raise ChatError("rejected: equals chosen: nothing to prefer")
    return pair


def _completion(r: ChatRenderer, pair: Pair, which: str) -> tuple[list[int], int]:
    """(the sequence's ids, where its completion starts) of prompt + chosen or rejected."""
    completion = getattr(pair, which)
    if not pair.conversational:
        eos = r.tok.eos_token or ""
        text = completion if completion.endswith(eos) else completion + eos
        prompt_ids, ids = r.encode(pair.prompt), r.encode(pair.prompt + text)
        return ids, common_prefix(prompt_ids, ids)
    prompt_ids = r.ids(pair.prompt, generation_prompt=True)
    ids = r.ids(pair.prompt + completion)
    require_prefix(
        prompt_ids,
        ids,
        f"{which}: the template's ids of the prompt with the generation prompt",
        f"prompt + {which}",
        "the template renders the prompt differently once a completion follows",
    )
    require_added(prompt_ids, ids, which, "this completion")
    if not any(i in r.end_ids for i in ids[len(prompt_ids) :]):
        ids = [*ids, r.eos_id]
    return ids, len(prompt_ids)


def _text(r: ChatRenderer, pair: Pair, which: str) -> str:
    if not pair.conversational:
        return pair.prompt + getattr(pair, which)
    return r.text(pair.prompt + getattr(pair, which))


def render_pair(r: ChatRenderer, pair: Pair) -> Conversation | None:
    """The pair as one stored document (module docstring), cut keep_start at seq_len + 1 ids per sequence; None
    when the prompt leaves no completion id (dropped)."""
    seqs = [_completion(r, pair, w) for w in ("chosen", "rejected")]
    if seqs[0][0] == seqs[1][0]:
        raise ChatError("rejected: renders to the same ids as chosen: nothing to prefer")
    limit = None if r.seq_len is None else r.seq_len + 1
    ids, labels, cut = [], [], False
    for seq, start in seqs:
        if limit is not None and len(seq) > limit:
            if start >= limit:
                return None
            seq, cut = seq[:limit], True
        lab = [0] * start + [1] * (len(seq) - start)
        lab[0] = 0
        ids += seq
        labels += lab
    text = _text(r, pair, "chosen") + "\n" + _text(r, pair, "rejected")
    return Conversation(ids, labels, text, cut)


def split_pair(ids, labels) -> int:
    """Where the rejected sequence starts in a stored pair document: the first 0 label after the first 1."""
    seen = False
    for i, lab in enumerate(labels):
        if lab:
            seen = True
        elif seen:
            return i
    raise ValueError("a stored preference pair has no rejected sequence (labels never return to 0 after a 1)")
