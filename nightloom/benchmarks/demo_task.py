"""The demos' local task folder, built on first use from the run's held-out conversations: a multiple-choice task
"which is the real answer?" where the other choices are the same answer's words shuffled. A base that knows no
English scores about 1/choices; a model that learned the answers' language picks the fluent one.

The held-out shard holds rendered ChatML text (`<|im_start|>user ... <|im_end|>`), which the demos use; other
templates give no pairs (and so no demo task).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from nightloom.util import atomic_write_text

_TURN = re.compile(r"<\|im_start\|>(user|assistant)\n(.*?)<\|im_end\|>", re.S)


def chatml_pairs(texts: list[str]) -> list[tuple[str, str]]:
    """(first user turn, the answer to it) of each rendered ChatML conversation that has both."""
    out = []
    for text in texts:
        turns = _TURN.findall(text)
        for (r1, q), (r2, a) in zip(turns, turns[1:], strict=False):
            if r1 == "user" and r2 == "assistant":
                out.append((q.strip(), a.strip()))
                break
    return out


def heldout_split(shards_dir: str | Path) -> dict[str, list]:
    """The held-out split of a local shard folder as columns: `text` (the manifest's text field: a chat's rendered
    text, a GRPO prompt) and each kept column, e.g. `answer` (empty when there is no held-out split)."""
    import pyarrow.parquet as pq

    manifest = Path(shards_dir) / "manifest.json"
    if not manifest.is_file():
        return {}
    m = json.loads(manifest.read_text())
    if not (held := m.get("heldout")):
        return {}
    field = m.get("text_field") or "text"
    keep = [c for c in m.get("keep_columns") or [] if c != field]
    table = pq.read_table(Path(shards_dir) / held["path"], columns=[field, *keep])
    return {"text": table.column(field).to_pylist()} | {c: table.column(c).to_pylist() for c in keep}


def heldout_texts(shards_dir: str | Path) -> list[str]:
    """The held-out split's texts from a local shard folder's manifest (none when it has no held-out split)."""
    return [t for t in heldout_split(shards_dir).get("text", []) if t]


def _shuffles(answer: str, n: int, rng: random.Random) -> list[str]:
    words, seen, out = answer.split(), {answer}, []
    for _ in range(50):
        if len(out) == n:
            break
        w = words[:]
        rng.shuffle(w)
        if (s := " ".join(w)) not in seen:
            seen.add(s)
            out.append(s)
    return out


def demo_docs(pairs: list[tuple[str, str]], choices: int = 4, seed: int = 0) -> list[dict]:
    """One document per pair whose answer has enough words to shuffle into `choices - 1` other orders."""
    rng = random.Random(seed)
    docs = []
    for q, a in pairs:
        wrong = _shuffles(a, choices - 1, rng)
        if len(wrong) < choices - 1:
            continue
        gold = rng.randrange(choices)
        docs.append({"question": q, "choices": wrong[:gold] + [a] + wrong[gold:], "gold": gold})
    return docs


def task_yaml(name: str) -> str:
    """The task's YAML: data beside it (`<name>.jsonl`), acc and acc_norm, the answer right after the prompt."""
    return (
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {name}.jsonl\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{gold}}'\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"
    )


def ensure_demo_task(folder: str | Path, name: str, texts: list[str]) -> int | None:
    """Write `<name>.jsonl` then `<name>.yaml` (last: a folder with the YAML is whole) unless the YAML is there;
    the documents written, None when it was there already. ValueError when no conversation makes a document."""
    folder = Path(folder)
    if (folder / f"{name}.yaml").is_file():
        return None
    docs = demo_docs(chatml_pairs(texts))
    if not docs:
        raise ValueError(f"validate.benchmarks.demo_task {name!r}: no held-out ChatML conversation to build it from")
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / f"{name}.jsonl", "".join(json.dumps(d) + "\n" for d in docs))
    atomic_write_text(folder / f"{name}.yaml", task_yaml(name))
    return len(docs)
