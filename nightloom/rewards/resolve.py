"""Resolving a spec's reward functions (a built-in name, `path/to/file.py:function` relative to the spec's folder,
or `package.module:function`) and checking them before anything runs: at validate and when the trainer starts.

A reward is `reward(prompts, completions, **row) -> list[float]`: `row` holds the dataset's columns for each
completion (lists, one entry per completion) and `completion_ids`, as TRL's GRPOTrainer passes them. A function
that does not import, is not callable or cannot take that call is refused naming it (RewardError)."""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nightloom.rewards.builtins import BUILTINS

RewardFn = Callable[..., Sequence[float]]
#: what a built-in reads from the row, not from its args
ROW_FIELDS = {"answer", "completion_ids"}


class RewardError(ValueError):
    """A reward function that cannot be used; the message names it and what is wrong."""


@dataclass(frozen=True)
class RewardRef:
    """One reward of a run: `fn` (a built-in name, `file.py:function` or `package.module:function`), its weight
    in the total and keyword arguments bound to it (a built-in's `pattern`, `max_tokens`, ...)."""

    fn: str
    weight: float = 1.0
    args: Mapping[str, object] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The metric's name: the function's own name (TRL's `rewards/<name>/mean`)."""
        return self.fn.rsplit(":", 1)[-1]


@dataclass(frozen=True)
class Reward:
    ref: RewardRef
    fn: RewardFn


def _from_file(path: Path, func: str, where: str) -> object:
    if not path.is_file():
        raise RewardError(f"{where}: no file {path}")
    tag = hashlib.blake2b(str(path.resolve()).encode(), digest_size=6).hexdigest()
    spec = importlib.util.spec_from_file_location(f"nightloom_reward_{path.stem}_{tag}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's module: any error it raises is the reason it is refused
        raise RewardError(f"{where}: importing {path} failed: {type(e).__name__}: {e}") from e
    if not hasattr(module, func):
        raise RewardError(f"{where}: {path} has no function {func!r}")
    return getattr(module, func)


def _from_module(module_name: str, func: str, where: str) -> object:
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise RewardError(f"{where}: importing module {module_name!r} failed: {type(e).__name__}: {e}") from e
    if not hasattr(module, func):
        raise RewardError(f"{where}: module {module_name!r} has no function {func!r}")
    return getattr(module, func)


def _check_signature(fn: object, ref: RewardRef, where: str) -> None:
    """Callable as fn(prompts, completions, **row, **args)."""
    if not callable(fn):
        raise RewardError(f"{where}: {ref.fn} is not a function")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise RewardError(f"{where}: {ref.fn}: its signature cannot be read ({e})") from e
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_pos = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(positional) < 2 and not var_pos:
        raise RewardError(f"{where}: {ref.fn} must take (prompts, completions, **row); its signature is {sig}")
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        raise RewardError(
            f"{where}: {ref.fn} must accept **row (the dataset's columns are passed by name); its signature is {sig}"
        )
    try:
        sig.bind_partial([], [], **ref.args)
    except TypeError as e:
        raise RewardError(f"{where}: {ref.fn} with args {dict(ref.args)}: {e}") from e
    if ref.fn in BUILTINS:  # a built-in's own settings are known: each must be given, no other
        own = {p.name for p in params if p.kind == p.KEYWORD_ONLY} - ROW_FIELDS
        missing, unknown = sorted(own - set(ref.args)), sorted(set(ref.args) - own)
        if missing or unknown:
            raise RewardError(
                f"{where}: built-in {ref.fn} takes args {sorted(own) or 'none'}"
                + (f"; missing {missing}" if missing else "")
                + (f"; unknown {unknown}" if unknown else "")
            )


def load_reward(ref: RewardRef, base_dir: str | Path = ".", where: str = "rewards") -> Reward:
    """Resolve and check one reward (`where` names it in errors, e.g. `spec.yaml:12: train.grpo.rewards[0]`)."""
    if ref.fn in BUILTINS:
        fn = BUILTINS[ref.fn]
    elif ":" in ref.fn:
        target, func = ref.fn.rsplit(":", 1)
        if target.endswith(".py"):
            fn = _from_file(Path(base_dir) / target, func, where)
        else:
            fn = _from_module(target, func, where)
    else:
        raise RewardError(
            f"{where}: {ref.fn!r} is neither a built-in ({', '.join(BUILTINS)}) nor 'file.py:function' "
            "or 'package.module:function'"
        )
    if not math.isfinite(ref.weight):
        raise RewardError(f"{where}: weight {ref.weight} is not a finite number")
    _check_signature(fn, ref, where)
    return Reward(ref=ref, fn=functools.partial(fn, **ref.args) if ref.args else fn)


def load_rewards(refs: Sequence[RewardRef], base_dir: str | Path = ".", where: str = "rewards") -> list[Reward]:
    """Every reward resolved and checked; all the errors at once in one RewardError."""
    out, errors = [], []
    for i, ref in enumerate(refs):
        try:
            out.append(load_reward(ref, base_dir, f"{where}[{i}]"))
        except RewardError as e:
            errors.append(str(e))
    if errors:
        raise RewardError("\n".join(errors))
    return out


def reward_errors(entries: object, base_dir: str | Path) -> list[tuple[int, str]]:
    """(index, reason) of each reward of a raw spec's train.grpo.rewards that cannot be used: validate's check,
    before anything is rented (the shapes of the entries are the schema's to refuse)."""
    if not isinstance(entries, list):
        return []
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("fn"), str):
            continue
        args = entry.get("args") if isinstance(entry.get("args"), dict) else {}
        weight = entry.get("weight", 1.0)
        ref = RewardRef(entry["fn"], float(weight) if isinstance(weight, int | float) else 1.0, args)
        try:
            load_reward(ref, base_dir, where="reward")
        except RewardError as e:
            out.append((i, str(e).removeprefix("reward: ")))
    return out
