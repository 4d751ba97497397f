"""The one rule for a list of transformer layers per pipeline chunk (spec, `--stages`, planner and trainer): a leaf
module, so the spec schema can check it without importing the layout code."""

from __future__ import annotations


def stage_list_errors(stages, chunks: int, layers: int | None = None, what: str | None = None) -> list[str]:
    """Why a list of transformer layers per pipeline chunk cannot run ([] = it can): `chunks` sizes (pp·v), summing
    to `layers` (unchecked when None, e.g. a spec read before its model), each >= 1 except the model's first and
    last chunk, which may hold none: an embedding-only first chunk and a head-only (output projection and loss)
    last chunk, as Llama 3 405B's one-layer interleaved chunks ran (Grattafiori et al. 2024 §3.3.2). An inner
    chunk with no layer would only forward activations, so it is refused. `what` names the chunk count."""
    sizes, what = list(stages), what or str(chunks)
    why = []
    if len(sizes) != chunks or (layers is not None and sum(sizes) != layers):
        need = f" summing to layers ({layers})" if layers is not None else ""
        why.append(f"stages {sizes} must be {what} sizes{need}, got {len(sizes)} summing to {sum(sizes)}")
    inner = [(i, n) for i, n in enumerate(sizes) if n < (1 if 0 < i < len(sizes) - 1 else 0)]
    if inner:
        bad = ", ".join(f"chunk {i} = {n}" for i, n in inner)
        why.append(
            f"stages {sizes}: {bad}; every chunk needs >= 1 layer except the first and last, which may hold 0 "
            "(embedding only, head only)"
        )
    return why


def stages_text(sizes) -> str:
    """Stage sizes as `--stages` reads them, runs of three or more written once with their count: Llama 3 405B's 128
    one-layer chunks are `0:1*126:0`, not 128 numbers (parse_stages reads both)."""
    runs: list[list[int]] = []
    for n in sizes:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return ":".join(f"{n}*{k}" if k >= 3 else ":".join([str(n)] * k) for n, k in runs)
