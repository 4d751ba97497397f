"""Quality filters of pretraining text, natively, each with the same decision as datatrove 0.10.1's on every
document (tests/unit/sharding/test_filters_vs_datatrove.py checks it on a real corpus, document for document).

- Gopher repetition and quality: Rae et al. 2021, "Scaling Language Models: Methods, Analysis & Insights from
  Training Gopher", appendix A.1.1 and table A1 (datatrove's GopherRepetitionFilter, GopherQualityFilter).
- C4: Raffel et al. 2020, "Exploring the Limits of Transfer Learning ...", section 2.2, and TFDS's c4_utils
  (datatrove's C4QualityFilter, lines split on newlines). Its line rules decide the document and what the filters
  after it see, and a document it keeps is stored as its kept lines (`check_edit`; the shard stage rewrites it).
- FineWeb: Penedo et al. 2024, "The FineWeb Datasets", section 3.4 (datatrove's FineWebQualityFilter).
- Length bounds, in characters and whitespace words.

Words are whitespace-separated (what datatrove's word tokenizer gives on this text without spaCy; see
text_norm.py), sentences datatrove's regex splitter. Each filter returns why it removes a document (datatrove's
reason names), or None to keep it; `check` runs the enabled ones in FineWeb's order and names the first that
removes it.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

from nightloom.sharding.text_norm import PUNCTUATION_SET, TERMINAL_PUNCTUATION, sentences
from nightloom.spec.quality import (
    C4Spec,
    FiltersSpec,
    FineWebQualitySpec,
    GopherQualitySpec,
    GopherRepetitionSpec,
    LengthSpec,
)

_PARAGRAPHS = re.compile(r"\n{2,}")
_LINES = re.compile(r"\n+")
_CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
_END_PUNCTUATION = (".", "?", "!", '"', "'")
_POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")
_STOP_CHARS = tuple(TERMINAL_PUNCTUATION)


def duplicates(items: list[str]) -> tuple[int, int]:
    """(elements that repeat an earlier one, their characters)."""
    seen: set[str] = set()
    count = chars = 0
    for x in items:
        if x in seen:
            count += 1
            chars += len(x)
        else:
            seen.add(x)
    return count, chars


def _top_ngram_chars(words: list[str], n: int) -> int | None:
    """Characters of the most frequent word n-gram (space-joined) times its count; ties: the first seen."""
    grams = [" ".join(words[i : i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return None
    gram, count = Counter(grams).most_common(1)[0]
    return len(gram) * count


def _repeated_ngram_chars(words: list[str], n: int) -> int:
    """Characters in n-grams (joined without spaces) seen before, skipping past each repeat (Gopher's count)."""
    seen: set[str] = set()
    chars = i = 0
    while i < len(words) - n + 1:
        gram = "".join(words[i : i + n])
        if gram in seen:
            chars += len(gram)
            i += n
        else:
            seen.add(gram)
            i += 1
    return chars


def gopher_repetition(text: str, s: GopherRepetitionSpec) -> str | None:
    if not text:
        return "empty"
    paragraphs = _PARAGRAPHS.split(text.strip())
    dup, chars = duplicates(paragraphs)
    if s.dup_para_frac and dup / len(paragraphs) > s.dup_para_frac:
        return "dup_para_frac"
    if s.dup_para_char_frac and chars / len(text) > s.dup_para_char_frac:
        return "dup_para_char_frac"
    lines = _LINES.split(text)
    dup, chars = duplicates(lines)
    if s.dup_line_frac and dup / len(lines) > s.dup_line_frac:
        return "dup_line_frac"
    if s.dup_line_char_frac and chars / len(text) > s.dup_line_char_frac:
        return "dup_line_char_frac"
    words = text.split()
    for n, frac in s.top_n_grams:
        top = _top_ngram_chars(words, n)
        if top is not None and top / len(text) > frac:
            return f"top_{n}_gram"
    for n, frac in s.dup_n_grams:
        if _repeated_ngram_chars(words, n) / len(text) > frac:
            return f"duplicated_{n}_n_grams"
    return None


def gopher_quality(text: str, s: GopherQualitySpec) -> str | None:
    words = text.split()
    n_words = len(words)
    plain = [w for w in words if any(c not in PUNCTUATION_SET for c in w)]
    if s.min_doc_words and len(plain) < s.min_doc_words:
        return "gopher_short_doc"
    if s.max_doc_words and len(plain) > s.max_doc_words:
        return "gopher_long_doc"
    mean = sum(map(len, plain)) / len(plain) if plain else float("nan")  # nan compares False, as numpy's mean
    if s.min_avg_word_length and mean < s.min_avg_word_length:
        return "gopher_below_avg_threshold"
    if s.max_avg_word_length and mean > s.max_avg_word_length:
        return "gopher_above_avg_threshold"
    per_word = max(n_words, 1)  # no words: the ratios are 0 (datatrove divides by zero)
    if s.max_symbol_word_ratio and text.count("#") / per_word > s.max_symbol_word_ratio:
        return "gopher_too_many_hashes"
    if s.max_symbol_word_ratio and (text.count("...") + text.count("…")) / per_word > s.max_symbol_word_ratio:
        return "gopher_too_many_ellipsis"
    lines = text.splitlines() or [""]
    bullets = sum(x.lstrip().startswith(("•", "-")) for x in lines)
    if s.max_bullet_lines_ratio and bullets / len(lines) > s.max_bullet_lines_ratio:
        return "gopher_too_many_bullets"
    ellipses = sum(x.rstrip().endswith(("...", "…")) for x in lines)
    if s.max_ellipsis_lines_ratio and ellipses / len(lines) > s.max_ellipsis_lines_ratio:
        return "gopher_too_many_end_ellipsis"
    alpha = sum(any(c.isalpha() for c in w) for w in words)
    if s.min_alpha_words_ratio and alpha / per_word < s.min_alpha_words_ratio:
        return "gopher_below_alpha_threshold"
    if s.min_stop_words and len(set(s.stop_words).intersection(words)) < s.min_stop_words:
        return "gopher_enough_stop_words"
    return None


def c4(text: str, s: C4Spec) -> str | None:
    return c4_lines(text, s)[0]


def c4_lines(text: str, s: C4Spec) -> tuple[str | None, str]:
    """(why C4 removes the document or None, the text of its kept lines: what the filters after it see)."""
    found, kept = 0, []
    for line in text.splitlines():
        line = line.strip()
        words = line.split()
        if s.max_word_length != -1 and any(len(w) > s.max_word_length for w in words):
            continue
        if s.remove_citations:
            line = _CITATION.sub("", line)
        if s.filter_no_terminal_punct and (not line.endswith(_END_PUNCTUATION) or line.endswith("...")):
            continue
        if len(words) < s.min_words_per_line:
            continue
        lower = line.lower()
        if s.filter_lorem_ipsum and "lorem ipsum" in lower:
            return "lorem_ipsum", text
        if s.filter_javascript and "javascript" in lower:
            continue
        if s.filter_curly_bracket and "{" in line:
            return "curly_bracket", text
        if s.filter_policy and any(p in lower for p in _POLICY):
            continue
        if s.min_num_sentences != -1:
            found += max(1, len(sentences(line)))  # a line without a sentence end is one piece
        kept.append(line)
    if found < s.min_num_sentences:
        return "too_few_sentences", text
    return None, "\n".join(kept).strip()


def fineweb(text: str, s: FineWebQualitySpec) -> str | None:
    lines = [x for x in text.split("\n") if x.strip() != ""]
    if not lines:
        return "empty"
    ratio = sum(x.endswith(_STOP_CHARS) for x in lines) / len(lines)
    if ratio < s.line_punct_thr and not (ratio == 0 and s.line_punct_exclude_zero):
        return "line_punct_ratio"
    if sum(len(x) <= s.short_line_length for x in lines) / len(lines) > s.short_line_thr:
        return "short_line_ratio"
    if duplicates(lines)[1] / len(text.replace("\n", "")) > s.char_duplicates_ratio:
        return "char_dup_ratio"
    if text.count("\n") / len(text.split()) > s.new_line_ratio:
        return "list_ratio"
    return None


def length(text: str, s: LengthSpec) -> str | None:
    if len(text) < s.min_chars:
        return "too_few_chars"
    if s.max_chars is not None and len(text) > s.max_chars:
        return "too_many_chars"
    if s.min_words or s.max_words is not None:
        n = len(text.split())
        if n < s.min_words:
            return "too_few_words"
        if s.max_words is not None and n > s.max_words:
            return "too_many_words"
    return None


FILTERS: dict[str, Callable[[str, object], str | None]] = {
    "length": length,
    "gopher_repetition": gopher_repetition,
    "gopher_quality": gopher_quality,
    "c4": c4,
    "fineweb": fineweb,
}


def check(text: str, spec: FiltersSpec) -> tuple[str, str] | None:
    """(filter, reason) of the first enabled filter that removes the document, in FineWeb's order; None: kept.
    The filters after C4 see the lines C4 keeps, as in datatrove's pipeline, where C4 rewrites the text."""
    return check_edit(text, spec)[0]


def check_edit(text: str, spec: FiltersSpec) -> tuple[tuple[str, str] | None, str]:
    """(`check`'s verdict, the document as the chain leaves it): a document C4 keeps is its kept lines, joined
    by newlines (datatrove's C4QualityFilter output text); any other document is returned as it came."""
    out = text
    for name in spec.enabled():
        if name == "c4":
            why, out = c4_lines(out, spec.c4)
        else:
            why = FILTERS[name](out, getattr(spec, name))
        if why is not None:
            return (name, why), text
    return None, out
