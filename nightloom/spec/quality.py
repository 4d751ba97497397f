"""The shard stage's data-quality sections: `sharding.near_dup` (MinHash near-duplicate removal) and
`sharding.filters` (published quality heuristics, each with its published thresholds as defaults).

A leaf of the spec package (floor 0): it imports only the section base. The logic is nightloom/sharding/near_dup.py
and nightloom/sharding/filters.py; docs/sharding.md says what each filter removes and what it costs.
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from nightloom.spec.base import Section as _Section


class NearDupSpec(_Section):
    """MinHash over word n-grams with LSH bands; one document kept per cluster of near-duplicates (FineWeb's
    defaults: 5-grams, 112 permutations as 14 bands × 8 rows, so pairs above ~0.75 Jaccard are caught)."""

    ngram: int = Field(5, ge=1, le=32, description="Words per shingle (n-gram size).")
    num_perm: int = Field(112, ge=1, le=1024, description="MinHash permutations (= bands × rows).")
    bands: int = Field(14, ge=1, description="LSH bands: a pair sharing all the rows of one band is a candidate.")
    rows: int = Field(8, ge=1, description="Minima per band; threshold ≈ (1/bands)^(1/rows).")
    seed: int = Field(1, ge=0, description="Seed of the permutations (datatrove's default 1).")

    @model_validator(mode="after")
    def _banding(self) -> NearDupSpec:
        if self.bands * self.rows != self.num_perm:
            raise ValueError(
                f"bands × rows must equal num_perm: {self.bands} × {self.rows} = {self.bands * self.rows}, "
                f"num_perm {self.num_perm}"
            )
        return self

    @property
    def threshold(self) -> float:
        """The Jaccard similarity at which a pair is caught about half the time or more: (1/bands)^(1/rows)."""
        return (1 / self.bands) ** (1 / self.rows)


def _fraction(v: float | None, _info=None) -> float | None:
    if v is not None and not 0 <= v <= 1:
        raise ValueError(f"a fraction in [0, 1], got {v}")
    return v


class GopherRepetitionSpec(_Section):
    """Gopher's repetition rules (Rae et al. 2021, table A1): remove a document whose duplicated lines,
    paragraphs or n-grams take more than these fractions of it. null turns a rule off."""

    dup_line_frac: float | None = Field(0.3, description="Duplicated lines / lines.")
    dup_para_frac: float | None = Field(0.3, description="Duplicated paragraphs / paragraphs.")
    dup_line_char_frac: float | None = Field(0.2, description="Characters in duplicated lines / characters.")
    dup_para_char_frac: float | None = Field(0.2, description="Characters in duplicated paragraphs / characters.")
    top_n_grams: list[tuple[int, float]] = Field(
        [(2, 0.2), (3, 0.18), (4, 0.16)], description="(n, max): characters of the most frequent n-gram / characters."
    )
    dup_n_grams: list[tuple[int, float]] = Field(
        [(5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.10)],
        description="(n, max): characters in repeated n-grams / characters.",
    )

    check_fractions = field_validator("dup_line_frac", "dup_para_frac", "dup_line_char_frac", "dup_para_char_frac")(
        _fraction
    )

    @field_validator("top_n_grams", "dup_n_grams")
    @classmethod
    def _pairs(cls, v: list[tuple[int, float]]) -> list[tuple[int, float]]:
        for n, frac in v:
            if n < 1 or not 0 <= frac <= 1:
                raise ValueError(f"each entry is (n >= 1, fraction in [0, 1]), got ({n}, {frac})")
        return v


class GopherQualitySpec(_Section):
    """Gopher's quality rules (Rae et al. 2021, section A.1.1). null turns a rule off."""

    min_doc_words: int | None = Field(50, ge=0, description="Fewer non-symbol words: removed.")
    max_doc_words: int | None = Field(100_000, ge=0, description="More non-symbol words: removed.")
    min_avg_word_length: float | None = Field(3, ge=0, description="Mean word length below: removed.")
    max_avg_word_length: float | None = Field(10, ge=0, description="Mean word length above: removed.")
    max_symbol_word_ratio: float | None = Field(0.1, ge=0, description="'#' or ellipses per word above: removed.")
    max_bullet_lines_ratio: float | None = Field(0.9, description="Lines starting with a bullet above: removed.")
    max_ellipsis_lines_ratio: float | None = Field(0.3, description="Lines ending in an ellipsis above: removed.")
    min_alpha_words_ratio: float | None = Field(0.8, description="Words with a letter below this fraction: removed.")
    min_stop_words: int | None = Field(2, ge=0, description="Fewer distinct stop words: removed.")
    stop_words: list[str] = Field(
        ["the", "be", "to", "of", "and", "that", "have", "with"], description="The stop words (English)."
    )

    check_fractions = field_validator("max_bullet_lines_ratio", "max_ellipsis_lines_ratio", "min_alpha_words_ratio")(
        _fraction
    )


class C4Spec(_Section):
    """C4's rules (Raffel et al. 2020, section 2.2; TFDS c4_utils): lines without terminal punctuation, with
    fewer than 3 words, with 'javascript' or a cookie/terms notice are removed; a document with fewer than 5
    sentences in the lines left, 'lorem ipsum' or a curly bracket is removed. A kept document is stored as its kept
    lines (as datatrove's C4QualityFilter writes it)."""

    remove_citations: bool = Field(True, description="Strip [1], [edit], [citation needed] before the rules.")
    filter_no_terminal_punct: bool = Field(True, description="A line must end in . ? ! \" ' (not ...).")
    min_num_sentences: int = Field(5, ge=-1, description="Sentences needed in the kept lines (-1: off).")
    min_words_per_line: int = Field(3, ge=-1, description="Words a line needs to count (-1: off).")
    max_word_length: int = Field(1000, ge=-1, description="A line with a longer word is dropped (-1: off).")
    filter_lorem_ipsum: bool = Field(True, description="'lorem ipsum' anywhere in a kept line: removed.")
    filter_javascript: bool = Field(True, description="Lines mentioning javascript do not count.")
    filter_curly_bracket: bool = Field(True, description="A '{' in a kept line: removed (code, templates).")
    filter_policy: bool = Field(True, description="Lines with cookie / terms-of-use phrases do not count.")


class FineWebQualitySpec(_Section):
    """FineWeb's own quality rules (Penedo et al. 2024, section 3.4)."""

    line_punct_thr: float = Field(0.12, ge=0, le=1, description="Lines ending in punctuation below: removed.")
    line_punct_exclude_zero: bool = Field(False, description="Keep documents with no such line at all.")
    short_line_thr: float = Field(0.67, ge=0, le=1, description="Lines of <= short_line_length chars above: removed.")
    short_line_length: int = Field(30, ge=0, description="What a short line is, in characters.")
    char_duplicates_ratio: float = Field(0.01, ge=0, le=1, description="Characters in duplicated lines above: removed.")
    new_line_ratio: float = Field(0.3, ge=0, description="Newlines per word above: removed (lists).")


class LengthSpec(_Section):
    """Length bounds, in characters and whitespace words (0 / null: no bound)."""

    min_chars: int = Field(0, ge=0, description="Shorter documents are removed.")
    max_chars: int | None = Field(None, ge=1, description="Longer documents are removed.")
    min_words: int = Field(0, ge=0, description="Documents with fewer words are removed.")
    max_words: int | None = Field(None, ge=1, description="Documents with more words are removed.")

    @model_validator(mode="after")
    def _order(self) -> LengthSpec:
        if self.max_chars is not None and self.max_chars < self.min_chars:
            raise ValueError(f"max_chars {self.max_chars} is below min_chars {self.min_chars}")
        if self.max_words is not None and self.max_words < self.min_words:
            raise ValueError(f"max_words {self.max_words} is below min_words {self.min_words}")
        return self


FILTER_NAMES = ("length", "gopher_repetition", "gopher_quality", "c4", "fineweb")  # the order they run in


class FiltersSpec(_Section):
    """Quality filters, run in FineWeb's order (length, Gopher repetition, Gopher quality, C4, FineWeb); a
    document removed by one is counted under it. `true` or `{}` turns a filter on with the published thresholds."""

    length: LengthSpec | None = Field(None, description="Length bounds.")
    gopher_repetition: GopherRepetitionSpec | None = Field(None, description="Gopher's repetition rules.")
    gopher_quality: GopherQualitySpec | None = Field(None, description="Gopher's quality rules.")
    c4: C4Spec | None = Field(None, description="C4's line and document rules.")
    fineweb: FineWebQualitySpec | None = Field(None, description="FineWeb's quality rules.")
    samples: int = Field(20, ge=0, le=10_000, description="Removed documents per filter kept in the side file.")

    @model_validator(mode="before")
    @classmethod
    def _true_is_defaults(cls, data):
        if isinstance(data, dict):
            data = {k: ({} if (k in FILTER_NAMES and v is True) else v) for k, v in data.items()}
            data = {k: v for k, v in data.items() if not (k in FILTER_NAMES and v is False)}
        return data

    @model_validator(mode="after")
    def _some(self) -> FiltersSpec:
        if not self.enabled():
            raise ValueError(f"no filter is on: set one of {', '.join(FILTER_NAMES)} (true for its defaults)")
        return self

    def enabled(self) -> list[str]:
        """The filters that are on, in the order they run."""
        return [n for n in FILTER_NAMES if getattr(self, n) is not None]

    @classmethod
    def published(cls) -> FiltersSpec:
        """Every filter on, with its published thresholds (FineWeb's set of them)."""
        return cls(gopher_repetition={}, gopher_quality={}, c4={}, fineweb={})
