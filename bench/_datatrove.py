"""datatrove's side of the near-dup and quality-filter comparisons, configured from nightloom's own settings in one
place: bench/near_dup.py and tests/unit/sharding/test_filters_vs_datatrove.py both build datatrove's filters and
MinHash settings here, so the two cannot drift apart.

datatrove's English word tokenizer needs spaCy, which is not installed: `Words` splits words on whitespace (what
datatrove's tokenizer gives on this text; see nightloom/sharding/text_norm.py) and keeps datatrove's own regex
sentence splitter (its WhitespaceTokenizer's).
"""

from __future__ import annotations

from datatrove.pipeline.dedup.minhash import MinhashConfig
from datatrove.pipeline.filters import (
    C4QualityFilter,
    FineWebQualityFilter,
    GopherQualityFilter,
    GopherRepetitionFilter,
)
from datatrove.pipeline.filters.base_filter import BaseFilter
from datatrove.utils.word_tokenizers import WhitespaceTokenizer, WordTokenizer

#: nightloom's filter name -> datatrove's class; `length` has no datatrove counterpart
CLASSES = {
    "gopher_repetition": GopherRepetitionFilter,
    "gopher_quality": GopherQualityFilter,
    "c4": C4QualityFilter,
    "fineweb": FineWebQualityFilter,
}
#: nightloom's field -> datatrove's keyword where they differ (datatrove's own TODO says it means min_alpha)
RENAMED = {"min_alpha_words_ratio": "max_non_alpha_words_ratio"}


class Words(WordTokenizer):
    """Whitespace words; datatrove's own regex sentences (its WhitespaceTokenizer's, which needs no spaCy)."""

    def __init__(self):
        super().__init__("en")
        self.sents = WhitespaceTokenizer()

    def word_tokenize(self, text):
        return text.split()

    def sent_tokenize(self, text):
        return self.sents.sent_tokenize(text)

    def span_tokenize(self, text):
        return self.sents.span_tokenize(text)


def filter_kwargs(spec=None) -> dict[str, dict]:
    """datatrove's keyword arguments for the filters `spec` (a FiltersSpec; every filter at its published
    defaults when None) turns on, in the order nightloom runs them. Plain data, so the bench's datatrove child
    gets them without importing nightloom's spec (its peak memory is datatrove's own)."""
    from nightloom.spec.quality import FiltersSpec

    spec = spec if spec is not None else FiltersSpec.published()
    if spec.length is not None:
        raise ValueError("datatrove has no length filter: compare with sharding.filters.length off")
    return {n: {RENAMED.get(k, k): v for k, v in getattr(spec, n).model_dump().items()} for n in spec.enabled()}


def datatrove_filters(kwargs: dict[str, dict]) -> dict[str, BaseFilter]:
    """datatrove's filters built from `filter_kwargs`, with the whitespace word tokenizer."""
    tok = Words()
    return {name: CLASSES[name](language=tok, **kw) for name, kw in kwargs.items()}


def minhash_kwargs(params=None) -> dict[str, int]:
    """datatrove's MinhashConfig fields equal to nightloom's near_dup.MinHashParams (FineWeb's by default)."""
    from nightloom.sharding.near_dup import MinHashParams

    p = params if params is not None else MinHashParams()
    return {"n_grams": p.ngram, "num_buckets": p.bands, "hashes_per_bucket": p.rows, "seed": p.seed}


def minhash_config(kwargs: dict[str, int]) -> MinhashConfig:
    return MinhashConfig(**kwargs)
