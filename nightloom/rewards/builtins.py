"""The built-in verifiable rewards, each `reward(prompts, completions, **row) -> list[float]` as a user's own:
`accuracy` (the completion's final answer equals the row's `answer`; math-verify compares mathematical answers as
expressions, so 0.5, 1/2 and \\frac{1}{2} agree), `format` (a regular expression the completion must match) and
`length` (DAPO's soft overlong punishment on completion tokens, Yu et al. 2025 §3.4)."""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence

_ANSWER_LINE = re.compile(r"(?:answer|Answer|ANSWER)\s*(?:is|:)\s*(.+)")


def final_answer(text: str) -> str:
    """The plain-text final answer: after the last "answer:" / "answer is", else the last non-empty line."""
    found = _ANSWER_LINE.findall(text)
    if found:
        return found[-1].strip().rstrip(".").strip()
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].rstrip(".").strip() if lines else ""


def _math_equal(gold: str, completion: str) -> bool | None:
    """math-verify's verdict, or None when the gold answer is not mathematical (nothing parses)."""
    from math_verify import parse, verify

    main = threading.current_thread() is threading.main_thread()  # its timeouts use signal.alarm: main thread only
    timeout = 5 if main else None
    parsed_gold = parse(gold, parsing_timeout=timeout)
    if not parsed_gold:
        return None
    return bool(verify(parsed_gold, parse(completion, parsing_timeout=timeout), timeout_seconds=timeout))


def accuracy(prompts: Sequence[str], completions: Sequence[str], *, answer: Sequence, **row) -> list[float]:
    """1.0 where the completion's final answer equals the row's `answer` (math-verify for mathematical answers,
    else the final answer compared as text, case and surrounding spaces ignored), else 0.0."""
    out = []
    for completion, gold in zip(completions, answer, strict=True):
        gold = str(gold).strip()
        verdict = _math_equal(gold, final_answer(completion)) if gold else False
        if verdict is None:
            verdict = final_answer(completion).casefold() == gold.casefold()
        out.append(float(verdict))
    return out


def format(prompts: Sequence[str], completions: Sequence[str], *, pattern: str, **row) -> list[float]:  # noqa: A001
    """1.0 where the whole completion matches `pattern` (re.fullmatch, DOTALL: '.' crosses lines), else 0.0."""
    rx = re.compile(pattern, re.DOTALL)
    return [float(rx.fullmatch(c.strip()) is not None) for c in completions]


def length(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    completion_ids: Sequence[Sequence[int]],
    max_tokens: int,
    cache_tokens: int,
    **row,
) -> list[float]:
    """DAPO's soft overlong punishment: 0 up to max_tokens - cache_tokens, then falling linearly to -1 at
    max_tokens, -1 beyond (Yu et al. 2025, eq. 13)."""
    free = max_tokens - cache_tokens
    out = []
    for ids in completion_ids:
        n = len(ids)
        out.append(0.0 if n <= free else (free - n) / cache_tokens if n <= max_tokens else -1.0)
    return out


BUILTINS = {"accuracy": accuracy, "format": format, "length": length}
