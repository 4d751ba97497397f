"""train.task grpo's prompts, from the shard stage's output: each Parquet shard row is a prompt (its text field,
`dataset.text_field`) with the row's `dataset.keep_columns` (e.g. `answer`) that reward functions read by name.
The held-out split (`sharding.heldout`), or a JSONL file (`validate.eval_data`), holds the prompts scored at
`validate.eval_every`.

The training prompts are one seeded permutation of every shard's rows (by `train.seed`), walked
`prompts_per_step` at a time (wrapping round): the prompts of a generation round depend only on the spec, never on
the layout, and a resumed run draws the same ones. Each data-parallel rank takes its slice of the round's prompts."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nightloom.storage import S3Config, read_bytes
from nightloom.train.data import DataError, base_uri, open_training_manifest
from nightloom.train.rollout.chat_prompts import PromptTemplate
from nightloom.train.rollout.step import Prompt


@dataclass(frozen=True)
class PromptTable:
    """Prompt texts and their kept columns, as stored, with where they came from (for errors)."""

    where: str
    texts: list[str]
    columns: dict[str, list]


def _read_shard(uri: str, text_field: str, keep: list[str], s3: S3Config | None) -> PromptTable:
    import pyarrow.parquet as pq

    table = pq.read_table(io.BytesIO(read_bytes(uri, s3)), columns=[text_field, *keep])
    texts = table.column(text_field).to_pylist()
    return PromptTable(uri, texts, {c: table.column(c).to_pylist() for c in keep})


def read_prompt_tables(manifest: str, tokenizer, s3: S3Config | None, heldout: bool) -> tuple[PromptTable, object]:
    """(every training shard's prompts in shard order, or the held-out split's; the run's tokenizer). DataError
    naming the manifest when it was sharded as chats or has no held-out split."""
    m, tok = open_training_manifest(manifest, tokenizer, s3, chat=False)
    base = base_uri(manifest)
    keep = [c for c in m.keep_columns if c != m.text_field]
    if heldout:
        if m.heldout is None or m.heldout.rows == 0:
            raise DataError(f"{manifest}: validate.eval_every scores held-out prompts: set sharding.heldout")
        shards = [m.heldout]
    else:
        shards = sorted(m.shards, key=lambda s: s.index)
    texts, columns = [], {c: [] for c in keep}
    for s in shards:
        part = _read_shard(f"{base}/{s.path}", m.text_field, keep, s3)
        texts += part.texts
        for c in keep:
            columns[c] += part.columns[c]
    if not texts:
        raise DataError(f"{manifest}: no {'held-out ' if heldout else ''}prompt in the shards")
    return PromptTable(str(manifest), texts, columns), tok


def read_prompt_file(path: str, manifest: str, s3: S3Config | None) -> PromptTable:
    """validate.eval_data for grpo: a JSONL file of prompts read as the shard stage reads them (the manifest's
    text field and kept columns; a kept value that is not a string JSON-encoded, as in the shards). DataError
    naming FILE:LINE and the field when a record lacks one."""
    from nightloom.sharding.manifest import load_manifest

    m = load_manifest(manifest, s3)
    keep = [c for c in m.keep_columns if c != m.text_field]
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: validate.eval_data: file not found")
    texts, columns = [], {c: [] for c in keep}
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise DataError(f"{p}:{n}: not JSON ({e})") from None
        for field in (m.text_field, *keep):
            if not isinstance(rec, dict) or field not in rec:
                raise DataError(f"{p}:{n}: {field}: missing (the prompts' text field and dataset.keep_columns)")
        text = rec[m.text_field]  # a messages list (a chat-shaped prompt) JSON-encoded, as chat_prompts reads it
        texts.append(text if isinstance(text, str) else json.dumps(text))
        for c in keep:
            v = rec[c]
            columns[c].append(v if v is None or isinstance(v, str) else json.dumps(v))
    if not texts:
        raise DataError(f"{p}: validate.eval_data holds no prompt")
    return PromptTable(str(p), texts, columns)


def to_prompts(
    table: PromptTable, tokenizer, max_prompt_tokens: int, template: PromptTemplate | None = None
) -> list[Prompt]:
    """Each row as a Prompt (its ids by the run's tokenizer, no EOS; through `template`, the chat template, when
    it renders the row); a prompt longer than `max_prompt_tokens` (seq_len minus max_completion_tokens: prompt and
    completion share the model's positions) is refused by row."""
    out = []
    for i, (text, ids) in enumerate(zip(table.texts, tokenizer.encode_batch(table.texts), strict=True)):
        rendered = template.ids(text) if template is not None else None
        ids = ids if rendered is None else rendered
        if not ids:
            raise DataError(f"{table.where}: prompt {i} is empty")
        if len(ids) > max_prompt_tokens:
            raise DataError(
                f"{table.where}: prompt {i} has {len(ids)} tokens; train.seq_len minus "
                f"train.grpo.max_completion_tokens leaves {max_prompt_tokens}"
            )
        out.append(Prompt(ids, text, {c: v[i] for c, v in table.columns.items()}))
    return out


class PromptStream:
    """The training prompts in a seeded order: round r's global prompts are [r·n, (r+1)·n) of the permutation
    (mod the count), n = prompts_per_step; rank k of dp takes its n / dp of them."""

    def __init__(self, prompts: list[Prompt], per_step: int, seed: int, dp: int, dp_rank: int):
        if per_step % dp:
            raise ValueError(
                f"train.grpo.prompts_per_step: {per_step} is not a multiple of the {dp} data-parallel ranks "
                "(each rank generates whole groups)"
            )
        self.prompts, self.per_step, self.dp, self.dp_rank = prompts, per_step, dp, dp_rank
        self.order = np.random.default_rng([seed, 54]).permutation(len(prompts))

    def round(self, r: int) -> list[Prompt]:
        local = self.per_step // self.dp
        first = r * self.per_step + self.dp_rank * local
        return [self.prompts[int(self.order[j % len(self.prompts)])] for j in range(first, first + local)]
