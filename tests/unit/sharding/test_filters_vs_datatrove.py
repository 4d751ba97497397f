"""filters.py decides as datatrove 0.10.1's filters on real text, document for document: each filter alone and
the chain in FineWeb's order (where C4 rewrites what the filters after it see), on the stdlib-docstring sample
corpus and on the package descriptions (METADATA) of this venv. datatrove's English word tokenizer needs spaCy,
so it gets a whitespace one, with its own regex sentence splitter (bench/_datatrove.py, shared with the bench)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import orjson
import pytest

from nightloom.sharding import filters
from nightloom.sharding.corpus import ensure_sample_corpus
from nightloom.spec.quality import FiltersSpec, LengthSpec

pytest.importorskip("datatrove.pipeline.filters")
from datatrove.data import Document  # noqa: E402

from bench._datatrove import datatrove_filters, filter_kwargs  # noqa: E402  (the bench configures datatrove the same way)


def _docstrings() -> list[str]:
    path = ensure_sample_corpus(Path(__file__).resolve().parents[3] / "datasets" / "sample" / "corpus.jsonl")
    return [orjson.loads(line)["text"] for line in path.read_bytes().splitlines()]


def _descriptions() -> list[str]:
    site = Path(sys.prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    out = []
    for f in sorted(site.glob("*.dist-info/METADATA")):
        parts = f.read_text(encoding="utf-8", errors="replace").split("\n\n", 1)
        if len(parts) == 2 and parts[1].strip():
            out.append(parts[1])
    return out


@pytest.fixture(scope="module")
def corpora():
    return {"docstrings": _docstrings(), "descriptions": _descriptions()}


def _theirs():
    return datatrove_filters(filter_kwargs(FiltersSpec.published()))


def _verdict(result) -> str | None:
    return None if result is True else result[1]


@pytest.mark.slow
def test_each_filter_decides_as_datatrove(corpora):
    spec = FiltersSpec.published()
    for corpus, texts in corpora.items():
        assert len(texts) > (10_000 if corpus == "docstrings" else 100)
        for name, theirs in _theirs().items():
            docs = [Document(text=t, id=str(i)) for i, t in enumerate(texts)]
            want = [_verdict(theirs.filter(d)) for d in docs]
            got = [filters.FILTERS[name](t, getattr(spec, name)) for t in texts]
            wrong = [i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b]
            assert not wrong, f"{corpus}/{name}: {len(wrong)} differ, first {texts[wrong[0]][:200]!r}"
            kept = sum(w is None for w in want)
            assert 0 < kept < len(texts), (corpus, name)  # each filter both keeps and removes here
            if name == "c4":  # datatrove's C4 rewrites a kept document to its kept lines: the same text here
                pairs = [(d.text, t) for d, t, w in zip(docs, texts, want, strict=True) if w is None]
                assert [filters.c4_lines(t, spec.c4)[1] for _, t in pairs] == [a for a, _ in pairs], corpus
                assert sum(a != t for a, t in pairs) > kept // 10  # lines were removed from many


@pytest.mark.slow
def test_the_chain_decides_as_datatrove(corpora):
    spec = FiltersSpec.published()
    theirs = _theirs()
    for corpus, texts in corpora.items():
        want = []
        for i, t in enumerate(texts):
            doc, first = Document(text=t, id=str(i)), None
            for name, f in theirs.items():
                if f.filter(doc) is not True:
                    first = name
                    break
            want.append(first)
        got = [(filters.check(t, spec) or (None,))[0] for t in texts]
        assert got == want, corpus
        assert len(Counter(got)) == 5, Counter(got)  # every filter removes some document, and some are kept


def test_length_bounds():
    s = LengthSpec(min_chars=5, max_chars=20, min_words=2, max_words=3)
    assert [filters.length(t, s) for t in ("abc", "a" * 21, "abcdef", "a b c d", "a b c")] == [
        "too_few_chars",
        "too_many_chars",
        "too_few_words",
        "too_many_words",
        None,
    ]
