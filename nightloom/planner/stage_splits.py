"""The uneven pipeline splits the search tries: lighter end stages (the embedding and the output head cost about a
layer), and a forced list of layers per rank interleaved into v chunks per rank (Llama 3 405B's one-layer chunks)."""

from __future__ import annotations

from functools import lru_cache

#: end stages the search makes lighter hold at most this many layers fewer than the inner ones
MAX_LIGHTER = 2


@lru_cache(maxsize=4096)
def stage_splits(layers: int, pp: int, pinned: bool = False) -> tuple[tuple[int, ...] | None, ...]:
    """Pipeline splits (layers per chunk, `pp` chunks: pp·v with interleaving) the search tries: None (even)
    when pp divides the layers, and the splits with equal inner chunks and lighter end chunks (both ends, or
    the last one that also holds the output head). A pinned pp with neither gets the near-even split (the
    extra layers on the inner stages)."""
    if pp == 1:
        return (None,)
    out: list[tuple[int, ...] | None] = [None] if layers % pp == 0 else []
    # ends lighter by j <= MAX_LIGHTER layers (the output head costs about one layer or less), each keeping >= 1
    for j in range(1, MAX_LIGHTER + 1):
        if pp >= 3 and (layers + 2 * j) % pp == 0 and (layers + 2 * j) // pp - j >= 1:
            k = (layers + 2 * j) // pp
            out.append((k - j,) + (k,) * (pp - 2) + (k - j,))
        if (layers + j) % pp == 0 and (layers + j) // pp - j >= 1:
            k = (layers + j) // pp
            out.append((k,) * (pp - 1) + (k - j,))
    if not out and pinned and layers >= pp:
        base, extra = divmod(layers, pp)
        inner = list(range(1, pp - 1))
        bumped = set(inner[len(inner) - extra :] if extra <= len(inner) else range(pp - extra, pp))
        out.append(tuple(base + (i in bumped) for i in range(pp)))
    return tuple(out)


@lru_cache(maxsize=1024)
def interleave_stages(per_rank: tuple[int, ...], v: int) -> tuple[int, ...] | None:
    """Layers per pipeline rank split into v chunks per rank (pp·v chunks, chunk j on rank j mod pp): every chunk
    holds k = max/v layers, except that a lighter first rank gives up its layers in the model's first chunk and a
    lighter last rank in the model's last one, up to the whole chunk: Llama 3 405B's 7 + 14·8 + 7 in one-layer
    chunks leave the first chunk the embedding only and the last the head only (Grattafiori et al. 2024 §3.3.2;
    ParallelDims' stage rules allow 0 layers there only). None when the list does not split so (a lighter inner
    rank, or an end rank short of more than one chunk's layers, which would empty an inner chunk)."""
    if v == 1:
        return per_rank
    pp, top = len(per_rank), max(per_rank)
    if top % v:
        return None
    k = top // v
    chunks = [k] * (pp * v)
    for r, n in enumerate(per_rank):
        short = top - n
        if not short:
            continue
        if r not in (0, pp - 1) or short > k:
            return None
        chunks[0 if r == 0 else -1] -= short
    return tuple(chunks)
