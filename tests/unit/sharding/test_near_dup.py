"""near_dup.py on a planted corpus (recall, false removals, the same kept set on reruns, in any order and in
partitions) and its parts against plain references (union-find, MinHash's collision rate)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from nightloom.sharding.near_dup import (
    MinHashParams,
    Signer,
    band_keys,
    cluster,
    components,
    content_keys,
    keep_one,
    near_duplicates,
    shingles,
)
from nightloom.sharding.planted import ngram_jaccard, planted_corpus


@pytest.fixture(scope="module")
def corpus():
    return planted_corpus(1500, seed=3)


def _kept_texts(texts, removed) -> set[str]:
    return {t for t, r in zip(texts, removed, strict=True) if not r}


@pytest.mark.slow
def test_planted_recall_and_false_removal(corpus):
    removed = near_duplicates(corpus.texts)
    g = np.asarray(corpus.group)
    size = np.bincount(g)
    kept = np.bincount(g[~removed], minlength=len(size))
    near = np.asarray(corpus.jaccard)
    assert ((near > 0.74) & (near < 0.96)).sum() > 500  # the planted edits sit in [0.75, 0.95]
    recall = (size - np.maximum(kept, 1)).sum() / (size - 1).sum()
    lost = int((kept == 0).sum())  # groups (distinct documents) with no copy left: false removals
    assert recall >= 0.95, recall
    assert lost / len(size) <= 0.005, lost
    assert (kept <= size).all() and removed.sum() == (size - kept).sum()


@pytest.mark.slow
def test_same_kept_set_on_reruns_in_any_order_and_partitioning(corpus):
    texts = corpus.texts
    first = _kept_texts(texts, near_duplicates(texts))
    assert _kept_texts(texts, near_duplicates(texts)) == first
    order = np.random.default_rng(1).permutation(len(texts))
    shuffled = [texts[i] for i in order]
    assert _kept_texts(shuffled, near_duplicates(shuffled)) == first
    # signatures per partition (as scan units compute them), bands joined for the clustering
    p = MinHashParams()
    parts = np.array_split(np.arange(len(shuffled)), 5)
    signed = [Signer(p).sign([shuffled[i] for i in part]) for part in parts]
    keys = np.concatenate([band_keys(s, p) for s, _ in signed])
    has = np.concatenate([h for _, h in signed])
    removed = ~keep_one(cluster(keys, has), content_keys(shuffled))
    assert _kept_texts(shuffled, removed) == first


def test_components_match_a_plain_union_find():
    rng = np.random.default_rng(0)
    n = 3000
    u, v = rng.integers(0, n, 2500), rng.integers(0, n, 2500)
    parent = list(range(n))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in zip(u.tolist(), v.tolist(), strict=True):
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    want = np.array([find(x) for x in range(n)])
    got = components(n, [(u, v)])
    assert (got == want).all()  # labels: each component's smallest member


@pytest.mark.slow
def test_band_collisions_follow_the_banding_curve():
    """A pair at 5-gram Jaccard J shares a band with probability 1 - (1 - J^8)^14 (J 0.5: 5%; 0.9: 99.9%)."""
    rng = random.Random(5)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=7)) for _ in range(5000)]  # no digits: simplify
    p = MinHashParams()
    for target, lo, hi in ((0.5, 0.0, 0.2), (0.9, 0.95, 1.0)):
        hits = []
        for _ in range(150):
            base = rng.choices(words, k=300)
            other = list(base)
            while ngram_jaccard(" ".join(base), " ".join(other)) > target:
                other[rng.randrange(len(other))] = rng.choice(words)
            sigs, has = Signer(p).sign([" ".join(base), " ".join(other)])
            k = band_keys(sigs, p)
            hits.append(bool((k[0] == k[1]).any()))
        assert lo <= np.mean(hits) <= hi, (target, np.mean(hits))


def test_short_documents_have_no_signature_and_normalisation_applies():
    sigs, has = Signer().sign(["four words only here", "The Cat sat, on 12 mats!", "the cat sat on 7 mats"])
    assert has.tolist() == [False, True, True]
    assert (sigs[1] == sigs[2]).all()  # case, punctuation and digits normalised as datatrove's simplify_text
    assert len(shingles("a b c d e f", 5)) == 2
