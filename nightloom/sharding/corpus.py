"""The embedded sample corpus: docstrings of the installed Python standard library, as JSONL.

Built on first use, deterministically (files in sorted order, docstrings in definition order), so no text is
copied into git. Real English text of varied length (one line to a few KB), a few thousand documents and some
exact duplicates (e.g. repeated "Return repr(self)." style docstrings), which exercises dedup and balance.
"""

from __future__ import annotations

import ast
import os
import sysconfig
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import orjson

# Folders of the stdlib left out: installed third-party code and vendored copies.
_SKIP_PREFIXES = ("site-packages/", "dist-packages/", "ensurepip/_bundled/", "__pycache__/")
DEFAULT_MAX_BYTES = 4 * 1024 * 1024  # "a few MB": stop after this much text


def _docstrings(tree: ast.Module, module: str) -> Iterator[tuple[str, str]]:
    """(qualified name, cleaned docstring) in definition order: module, then classes/functions depth-first."""
    doc = ast.get_docstring(tree, clean=True)
    if doc and doc.strip():
        yield module, doc

    def walk(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, str]]:
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{node.name}"
                d = ast.get_docstring(node, clean=True)
                if d and d.strip():
                    yield name, d
                yield from walk(node.body, name)

    yield from walk(tree.body, module)


def iter_stdlib_docstrings(stdlib: Path | None = None) -> Iterator[dict[str, str]]:
    """Yield {"id", "text"} records from the stdlib sources; tests' docstrings come after the library's."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root).as_posix()
        if rel.startswith(_SKIP_PREFIXES) or "/__pycache__/" in rel:
            continue
        is_test = rel.startswith("test/") or "/test/" in rel or "/tests/" in rel or "idle_test/" in rel
        files.append((is_test, rel, p))
    seen: dict[str, int] = {}
    for _, rel, p in sorted(files):
        try:
            with warnings.catch_warnings():  # old test fixtures trigger SyntaxWarning (invalid escapes)
                warnings.simplefilter("ignore")
                tree = ast.parse(p.read_bytes(), filename=rel)
        except (SyntaxError, ValueError, OSError):  # a few test fixtures are deliberately broken
            continue
        module = rel[: -len(".py")].replace("/", ".")
        for qualname, doc in _docstrings(tree, module):
            n = seen[qualname] = seen.get(qualname, 0) + 1  # redefinitions (property setters, overloads)
            yield {"id": qualname if n == 1 else f"{qualname}#{n}", "text": doc}


def alpaca_records(max_rows: int = 2000) -> Iterator[dict[str, str]]:
    """Instruction-tuning rows from the same docstrings: "Explain what `name` does." → its first paragraph."""
    n = 0
    for rec in iter_stdlib_docstrings():
        first = rec["text"].strip().split("\n\n", 1)[0].strip()
        if len(first) < 40 or "#" in rec["id"]:
            continue
        yield {"id": rec["id"], "instruction": f"Explain what `{rec['id']}` does.", "input": "", "output": first[:600]}
        n += 1
        if n >= max_rows:
            return


#: the chat sample's system prompt (on every third conversation: records with and without one)
CHAT_SYSTEM = "You are a concise assistant who explains Python's standard library."


def chat_records(max_rows: int = 1200) -> Iterator[dict]:
    """OpenAI-style chats from the same docstrings: "What does `name` do?" → its first paragraph; every third has a
    system turn and every fourth a second question (the next docstring), so some are multi-turn."""
    docs = alpaca_records(max_rows * 2)
    n = 0
    for rec in docs:
        answer = rec["output"][:400]
        messages = [{"role": "system", "content": CHAT_SYSTEM}] if n % 3 == 0 else []
        messages += [
            {"role": "user", "content": f"What does `{rec['id']}` do?"},
            {"role": "assistant", "content": answer},
        ]
        if n % 4 == 1:
            nxt = next(docs, None)
            if nxt is not None:
                messages += [
                    {"role": "user", "content": f"And `{nxt['id']}`?"},
                    {"role": "assistant", "content": nxt["output"][:400]},
                ]
        yield {"id": rec["id"], "messages": messages}
        n += 1
        if n >= max_rows:
            return


def pair_records(max_rows: int = 1200) -> Iterator[dict]:
    """Preference pairs from the chats (train.task dpo): the conversation up to its last answer is the prompt, that
    answer is chosen, and a wrong answer, the same words in reverse order, is rejected."""
    for rec in chat_records(max_rows):
        *prompt, answer = rec["messages"]
        wrong = " ".join(reversed(answer["content"].split()))
        if wrong == answer["content"]:  # one word, or a palindrome of words: nothing to prefer
            continue
        yield {
            "id": rec["id"],
            "prompt": prompt,
            "chosen": [answer],
            "rejected": [{"role": "assistant", "content": wrong}],
        }


def _sample_rows(kind: str) -> Iterator[tuple[dict, int]]:
    """(record, text bytes) of the sample of `kind`: docstrings, alpaca, chats or pairs."""
    if kind == "docstrings":
        return ((r, len(r["text"].encode())) for r in iter_stdlib_docstrings())
    if kind == "alpaca":
        return ((r, len(r["output"].encode())) for r in alpaca_records())
    if kind == "chats":
        return ((r, sum(len(m["content"].encode()) for m in r["messages"])) for r in chat_records())
    if kind == "pairs":
        return ((r, 2 * len(r["chosen"][0]["content"].encode())) for r in pair_records())
    raise ValueError(f"dataset.sample_kind: {kind!r}; expected docstrings, alpaca, chats or pairs")


def build_sample_corpus(path: Path, max_bytes: int = DEFAULT_MAX_BYTES, kind: str = "docstrings") -> Path:
    """Write the corpus to `path` atomically (temp file in the same folder, then os.replace)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        written = 0
        with os.fdopen(fd, "wb") as f:
            for rec, size in _sample_rows(kind):
                f.write(orjson.dumps(rec) + b"\n")
                written += size
                if written >= max_bytes:
                    break
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def ensure_sample_corpus(path: str | Path, kind: str = "docstrings") -> Path:
    """Return `path`, building the stdlib-docstring sample (`kind` docstrings, alpaca or chats) there if it is
    missing."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    if p.suffix not in (".jsonl", ".json", ".ndjson"):
        raise ValueError(f"{p}: the sample corpus is JSONL; give a path ending in .jsonl")
    return build_sample_corpus(p, kind=kind)
