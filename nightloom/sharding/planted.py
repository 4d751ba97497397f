"""A synthetic corpus with planted near-duplicates, exact copies and hard negatives, whose truth is known: what
the near-dup tests and `bench/near_dup.py` measure recall and false removals on.

Originals are random word sequences (a Zipf-like draw from a made-up vocabulary, so no two share a 5-gram by
chance). Some get near-duplicates, edited (words replaced, inserted, deleted) until their word 5-gram Jaccard
similarity to the original falls to a target drawn from [low, high]; some get exact copies; and hard negatives
share a long boilerplate header and footer with different bodies (like pages of one site).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nightloom.sharding.text_norm import simplify


@dataclass
class PlantedCorpus:
    texts: list[str] = field(default_factory=list)
    group: list[int] = field(default_factory=list)  # documents of one group are duplicates of each other
    jaccard: list[float] = field(default_factory=list)  # of a planted near-duplicate to its original, else 1 / 0

    def add(self, text: str, group: int, jaccard: float) -> None:
        self.texts.append(text)
        self.group.append(group)
        self.jaccard.append(jaccard)


def ngram_set(text: str, n: int = 5) -> set[tuple[str, ...]]:
    """The word n-grams of a text after `simplify` (the set MinHash samples)."""
    w = simplify(text).split()
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


def ngram_jaccard(a: str, b: str, n: int = 5) -> float:
    """Jaccard similarity of two texts' word n-gram sets (what MinHash estimates)."""
    sa, sb = ngram_set(a, n), ngram_set(b, n)
    return len(sa & sb) / max(1, len(sa | sb))


def _vocabulary(rng: np.random.Generator, size: int) -> list[str]:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    return ["".join(rng.choice(letters, int(rng.integers(3, 10)))) for _ in range(size)]


def _edit(rng: np.random.Generator, words: list[str], vocab: list[str], low: float, high: float):
    """A copy of `words` edited one word at a time until its 5-gram Jaccard to the original is below a target
    drawn from [low, high], and that Jaccard; None when the last edit overshot below `low` (a short document)."""
    target, base = float(rng.uniform(low, high)), ngram_set(" ".join(words))
    out, j = list(words), 1.0
    while j > target:
        for _ in range(max(1, int(len(out) * (j - target) / 25))):  # a few at once while far from the target
            i, kind = int(rng.integers(0, len(out))), int(rng.integers(0, 3))
            if kind == 0:
                out[i] = vocab[int(rng.integers(0, len(vocab)))]
            elif kind == 1:
                out.insert(i, vocab[int(rng.integers(0, len(vocab)))])
            elif len(out) > 10:
                del out[i]
        now = ngram_set(" ".join(out))
        j = len(base & now) / len(base | now)
    return (out, j) if j >= low else None


def planted_corpus(
    originals: int = 2000,
    seed: int = 0,
    near_fraction: float = 0.3,
    exact_fraction: float = 0.1,
    boilerplate_fraction: float = 0.3,
    low: float = 0.75,
    high: float = 0.95,
) -> PlantedCorpus:
    """Originals, then 1-3 near-duplicates of `near_fraction` of them, an exact copy of `exact_fraction`; a
    `boilerplate_fraction` of originals are hard negatives (one of 8 shared 40+40-word frames around their own
    body of 60-200 words). Shuffled, so no duplicate sits next to its original."""
    rng = np.random.default_rng(seed)
    vocab = _vocabulary(rng, 20000)
    weights = 1.0 / np.arange(1, len(vocab) + 1) ** 0.6
    weights /= weights.sum()
    frames = [(rng.choice(len(vocab), 40, p=weights), rng.choice(len(vocab), 40, p=weights)) for _ in range(8)]
    docs = PlantedCorpus()
    for g in range(originals):
        if rng.random() < boilerplate_fraction:
            head, tail = frames[int(rng.integers(0, len(frames)))]
            body = rng.choice(len(vocab), int(rng.integers(60, 200)), p=weights)
            ids = np.concatenate([head, body, tail])
        else:
            ids = rng.choice(len(vocab), int(rng.integers(80, 600)), p=weights)
        words = [vocab[i] for i in ids]
        docs.add(" ".join(words), g, 1.0)
        if rng.random() < near_fraction:
            for _ in range(int(rng.integers(1, 4))):
                edit = _edit(rng, words, vocab, low, high)
                if edit is not None:
                    docs.add(" ".join(edit[0]), g, edit[1])
        if rng.random() < exact_fraction:
            docs.add(" ".join(words), g, 1.0)
    order = rng.permutation(len(docs.texts))
    return PlantedCorpus(
        texts=[docs.texts[i] for i in order],
        group=[docs.group[i] for i in order],
        jaccard=[docs.jaccard[i] for i in order],
    )
