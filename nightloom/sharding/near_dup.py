"""Near-duplicate removal: MinHash signatures over word n-grams, LSH bands, clusters over the whole corpus, one
document kept per cluster.

MinHash (Broder 1997): the probability that two documents' minima under a random permutation agree is the
Jaccard similarity of their n-gram sets. Banding (Leskovec, Rajaraman, Ullman, "Mining of Massive Datasets",
ch. 3.4): `bands` groups of `rows` minima; a pair shares at least one whole band with probability
1 - (1 - J^rows)^bands. FineWeb's settings (Penedo et al. 2024, datatrove's `MinhashConfig`): 5-grams, 14 bands of
8, so J = 0.75 / 0.80 / 0.85 pairs are found 77 / 92 / 99 % of the time. Permutations are datatrove's
(a·x + b) mod (2^61 - 1), a and b from `RandomState(seed)`; shingles are words (as `text_norm.simplify` leaves
them) hashed once each with xxh3 and combined numerically per n-gram, so nothing runs per n-gram in Python.

Clusters are the connected components of "shares a band" (union-find, vectorised: hook every edge to the smaller
root, then compress paths, until no edge joins two roots); each keeps its document with the smallest `key` (a
content hash), so the kept set depends only on the documents, not on their order or partitioning. A document with
fewer than `ngram` words has no signature and is never a near-duplicate (as in datatrove).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from nightloom.sharding.text_norm import simplify

MERSENNE = np.uint64((1 << 61) - 1)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # n-gram combination multiplier (odd, 2^64 / phi)
SHINGLES_PER_CHUNK = 2048  # shingles permuted at once: 2048 x 112 x 8 B = 1.75 MiB per temporary (two)


@dataclass(frozen=True)
class MinHashParams:
    """MinHash and banding settings (FineWeb's by default)."""

    ngram: int = 5
    bands: int = 14
    rows: int = 8
    seed: int = 1

    @property
    def num_perm(self) -> int:
        return self.bands * self.rows


def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) of the universal hashes (a·x + b) mod (2^61 - 1), drawn as datatrove draws them."""
    gen = np.random.RandomState(seed)
    a = gen.randint(1, MERSENNE, dtype=np.uint64, size=num_perm)
    b = gen.randint(0, MERSENNE, dtype=np.uint64, size=num_perm)
    return a, b


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (Steele et al. 2014), in place: spreads combined hashes over all 64 bits."""
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def shingles(text: str, ngram: int) -> np.ndarray:
    """One uint64 per word n-gram of the simplified text (empty when it has fewer than `ngram` words)."""
    words = simplify(text).split()
    m = len(words) - ngram + 1
    if m <= 0:
        return np.zeros(0, dtype=np.uint64)
    h = np.fromiter(map(xxhash.xxh3_64_intdigest, words), dtype=np.uint64, count=len(words))
    g = h[:m].copy()
    for k in range(1, ngram):
        g *= _GOLDEN
        g += h[k : k + m]
    return _mix(g)


def _fold_mersenne(x: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """x mod (2^61 - 1) up to one fold, in place: (x & p) + (x >> 61) is congruent to x and below p + 8, so it
    equals x mod p except where x mod p < 8 (then it is that plus p: 8 values in 2^61, immaterial to a minimum)."""
    np.right_shift(x, np.uint64(61), out=tmp)
    x &= MERSENNE
    x += tmp
    return x


class Signer:
    """Computes MinHash signatures (num_perm uint64 minima per document) a batch of documents at a time."""

    def __init__(self, params: MinHashParams = MinHashParams()):
        self.params = params
        self.a, self.b = permutations(params.num_perm, params.seed)

    def _minima(self, sh: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """Per document (its shingles sh[starts[i]:starts[i+1]], none empty), the minimum of each permutation."""
        out = np.empty((len(starts), self.params.num_perm), dtype=np.uint64)
        ends = np.append(starts[1:], len(sh))
        i = 0
        while i < len(starts):  # documents whole, about SHINGLES_PER_CHUNK shingles per block (a long one alone)
            j = max(i + 1, int(np.searchsorted(ends, starts[i] + SHINGLES_PER_CHUNK, side="right")))
            lo, hi = int(starts[i]), int(ends[j - 1])
            phv = np.multiply(sh[lo:hi, None], self.a[None, :])
            phv += self.b
            out[i:j] = np.minimum.reduceat(_fold_mersenne(phv, np.empty_like(phv)), starts[i:j] - lo, axis=0)
            i = j
        return out

    def sign(self, texts: Iterable[str]) -> tuple[np.ndarray, np.ndarray]:
        """(signatures (n, num_perm) uint64, has (n,) bool): rows of documents without a signature are zero."""
        per_doc = [shingles(t, self.params.ngram) for t in texts]
        n = len(per_doc)
        lengths = np.fromiter(map(len, per_doc), dtype=np.int64, count=n)
        has = lengths > 0
        sigs = np.zeros((n, self.params.num_perm), dtype=np.uint64)
        if has.any():
            sh = np.concatenate([p for p in per_doc if len(p)])
            live = lengths[has]
            sigs[has] = self._minima(sh, np.cumsum(live) - live)
        return sigs, has


def band_keys(sigs: np.ndarray, params: MinHashParams) -> np.ndarray:
    """(n, bands) uint64: each band's `rows` minima folded into one hash (equal bands give equal keys; unequal
    ones collide with probability 2^-64)."""
    n = len(sigs)
    rows = sigs.reshape(n, params.bands, params.rows)
    key = np.zeros((n, params.bands), dtype=np.uint64)
    for r in range(params.rows):
        key ^= rows[:, :, r]
        key = _mix(key * _GOLDEN)
    return key


def band_edges(column: np.ndarray, live: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (i, j) of live documents whose key in one band is equal: each document to the next with its key."""
    idx = np.flatnonzero(live)
    order = idx[np.argsort(column[idx], kind="stable")]
    k = column[order]
    same = k[1:] == k[:-1]
    return order[:-1][same], order[1:][same]


def components(n: int, edges: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Connected components of documents 0..n-1 under the edges: each document's label is its component's
    smallest index (union-find by hooking to the smaller root and compressing paths, vectorised)."""
    parent = np.arange(n, dtype=np.int64)
    if not edges:
        return parent
    u = np.concatenate([e[0] for e in edges]).astype(np.int64)
    v = np.concatenate([e[1] for e in edges]).astype(np.int64)
    while len(u):
        ru, rv = parent[u], parent[v]
        cross = ru != rv
        u, v, ru, rv = u[cross], v[cross], ru[cross], rv[cross]
        if not len(u):
            break
        lo, hi = np.minimum(ru, rv), np.maximum(ru, rv)
        np.minimum.at(parent, hi, lo)  # hook each larger root under the smallest root it meets
        while True:  # compress: every document points at its root
            nxt = parent[parent]
            if np.array_equal(nxt, parent):
                break
            parent = nxt
    return parent


def keep_one(labels: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Kept mask: per cluster (equal labels) the document with the smallest (key, index)."""
    n = len(labels)
    order = np.lexsort((np.arange(n), key, labels))
    first = np.ones(n, dtype=bool)
    first[1:] = labels[order][1:] != labels[order][:-1]
    kept = np.zeros(n, dtype=bool)
    kept[order[first]] = True
    return kept


def cluster(keys: np.ndarray, has: np.ndarray) -> np.ndarray:
    """Cluster labels of documents with band keys `keys` (n, bands); those without a signature stay alone."""
    n = len(keys)
    return components(n, [band_edges(keys[:, b], has) for b in range(keys.shape[1])])


def content_keys(texts: Iterable[str]) -> np.ndarray:
    """A content hash per document (xxh3-64 of its text): which member of a cluster is kept."""
    texts = list(texts)
    return np.fromiter(map(xxhash.xxh3_64_intdigest, texts), dtype=np.uint64, count=len(texts))


def near_duplicates(texts: Sequence[str], params: MinHashParams = MinHashParams()) -> np.ndarray:
    """Removed mask of a list of documents: all but one document of every near-duplicate cluster."""
    sigs, has = Signer(params).sign(texts)
    labels = cluster(band_keys(sigs, params), has)
    return ~keep_one(labels, content_keys(texts))
