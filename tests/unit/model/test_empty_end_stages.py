"""Pipeline stage lists whose first and last chunk hold no transformer layer (an embedding-only first chunk, a
head-only last chunk, as Llama 3 405B ran: Grattafiori et al. 2024 §3.3.2) are accepted; an empty inner chunk
is refused with the values named."""

from __future__ import annotations

import re

import pytest
import torch

from nightloom.catalog import get_model
from nightloom.parallel import LayoutError, ParallelDims, ParallelPlan, stage_list_errors
from nightloom.train.model import build_model
from nightloom.train.parallelize import validate_plan

TINY = get_model("tiny")  # 4 layers


def _dims(stages, v=2) -> ParallelDims:
    sched = "interleaved_1f1b" if v > 1 else "1f1b"
    return ParallelDims(pp=2, micro_batch=2, grad_accum=4, virtual_stages=v, schedule=sched, stages=tuple(stages))


@pytest.mark.parametrize(
    "stages,v",
    [
        ((0, 2, 2, 0), 2),  # both ends empty, interleaved
        ((0, 1, 2, 1), 2),  # the first only
        ((1, 2, 1, 0), 2),  # the last only
        ((0, 4), 1),  # PP2 with one chunk per rank: rank 0 holds the embedding only
    ],
)
def test_empty_end_chunks_are_accepted(stages, v):
    assert _dims(stages, v=v).check(TINY, 32, 8) == []
    assert stage_list_errors(stages, 2 * v) == []  # without the model's layer count (a spec before its model)


def test_empty_end_chunks_keep_no_layer():
    assert _dims((0, 2, 2, 0)).stage_bounds(4) == [(0, 0), (0, 2), (2, 4), (4, 4)]
    plan = ParallelPlan(pp=2, schedule="interleaved_1f1b", virtual_stages=2, stages=[0, 2, 2, 0], grad_accum=4)
    assert validate_plan(TINY, plan, 32, 4, 2, "cpu").stage_sizes(4) == (0, 2, 2, 0)


@pytest.mark.parametrize(
    "stages,message",
    [
        ((2, 0, 2, 0), r"stages \[2, 0, 2, 0\]: chunk 1 = 0; every chunk needs >= 1 layer except the first and last"),
        ((0, 2, 0, 2), r"stages \[0, 2, 0, 2\]: chunk 2 = 0;"),
        ((0, 0, 4, 0), r"stages \[0, 0, 4, 0\]: chunk 1 = 0;"),
        ((-1, 3, 2, 0), r"stages \[-1, 3, 2, 0\]: chunk 0 = -1;"),
        (
            (0, 2, 2, 1),
            r"stages \[0, 2, 2, 1\] must be pp\*virtual_stages \(2\*2\) sizes summing to layers \(4\), got 4 "
            r"summing to 5",
        ),
        ((0, 4, 0), r"stages \[0, 4, 0\] must be pp\*virtual_stages \(2\*2\) sizes summing to layers \(4\), got 3"),
    ],
)
def test_empty_inner_chunks_and_bad_lists_are_refused(stages, message):
    why = _dims(stages).check(TINY, 32, 8)
    assert any(re.search(message, w) for w in why), why
    with pytest.raises(LayoutError, match=message):
        validate_plan(TINY, ParallelPlan.of(_dims(stages)), 32, 8, 2, "cpu")


def test_empty_end_chunks_compose_to_the_full_model():
    """The trainer's chunks for stages [0, 2, 2, 0] (model.keep_layers, global layer names kept): the first holds
    the embedding only, the last the final norm and head only; chained they give the full model's logits and
    gradients exactly, also with packed documents (doc_ids)."""

    def built(*keep):
        m = build_model(TINY, seq_len=16)
        if keep:
            m.keep_layers(*keep)
        m.to_empty(device="cpu")
        m.init_weights(7)
        return m

    bounds = _dims((0, 2, 2, 0)).stage_bounds(TINY.layers)
    chunks = [built(*b, s == 0, s == len(bounds) - 1) for s, b in enumerate(bounds)]
    assert [sorted(c.layers.keys()) for c in chunks] == [[], ["0", "1"], ["2", "3"], []]
    assert chunks[0].tok_embeddings is not None and chunks[0].output is None and chunks[0].norm is None
    assert chunks[3].tok_embeddings is None and chunks[3].output is not None and chunks[3].norm is not None
    full = built()
    x = torch.randint(0, 256, (2, 16))
    docs = torch.tensor([[0] * 6 + [1] * 10, [0] * 16])
    for d in (None, docs):
        h = x
        for c in chunks:
            h = c(h, d)
        torch.testing.assert_close(h, full(x, d), rtol=0, atol=0)
    h = x
    for c in chunks:
        h = c(h)
    h.float().pow(2).mean().backward()
    full(x).float().pow(2).mean().backward()
    theirs = dict(full.named_parameters())
    for c in chunks:
        for name, p in c.named_parameters():
            torch.testing.assert_close(p.grad, theirs[name].grad, rtol=0, atol=0)


def test_spec_and_cli_accept_empty_end_stages_only():
    """`parallel.stages` in a run spec and `--stages` on the planner CLI take 0 at the ends, not inside."""
    from nightloom.planner.request import parse_stages
    from nightloom.spec import SpecError
    from nightloom.spec.load import parse_spec

    base = {
        "name": "t",
        "dataset": {"path": "x", "sample": True},
        "cluster": {"nodes": 1, "gpus_per_node": 2},
        "train": {"seq_len": 64, "global_batch": 8},
    }
    par = {"pp": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2, "micro_batch": 1}
    assert parse_spec({**base, "parallel": {**par, "stages": [0, 2, 2, 0]}}).parallel.stages == [0, 2, 2, 0]
    with pytest.raises(SpecError, match=r"stages \[2, 0, 2, 0\]: chunk 1 = 0; every chunk needs >= 1 layer"):
        parse_spec({**base, "parallel": {**par, "stages": [2, 0, 2, 0]}})
    with pytest.raises(SpecError, match=r"stages \[0, 2, 2, 1\] must be pp\*virtual_stages \(2\*2\) sizes summing"):
        parse_spec({**base, "parallel": {**par, "stages": [0, 2, 2, 1]}})  # tiny has 4 layers
    assert parse_stages("0:2:2:0") == (0, 2, 2, 0)
    with pytest.raises(ValueError, match=r"'2,0,2,0': give one size per pipeline stage, >= 1 except the first"):
        parse_stages("2,0,2,0")


def test_long_stage_lists_print_as_runs_and_read_back():
    """The plan prints Llama 3 405B's 128 one-layer chunks as `0:1*126:0` (stages_text), and `--stages` reads that
    form back, as it reads the plain one; a run that is not a count is refused, naming the text."""
    from nightloom.planner import plan
    from nightloom.planner.request import parse_stages
    from nightloom.spec.stage_list import stages_text

    meta = (0,) + (1,) * 126 + (0,)
    for sizes, text in [(meta, "0:1*126:0"), ((7,) + (8,) * 14 + (7,), "7:8*14:7"), ((1, 2, 1), "1:2:1")]:
        assert stages_text(sizes) == text and parse_stages(text) == sizes
    with pytest.raises(ValueError, match=r"'1\*x' is not a list of integers"):
        parse_stages("1*x")
    kw = dict(nodes=1024, gpus_per_node=8, seq_len=8192, global_batch=2048, stages="7:8*14:7")
    p = plan("llama3.1-405b", "h100-80gb", layout="tp=8,pp=16,dp=64,v=8,recompute=none", **kw).chosen
    assert p.stages == list(meta)
    assert any(
        "128 chunks (uneven, v=8) of 0:1*126:0 transformer layers, 7:8*14:7 per pp rank" in x for x in p.explanation
    )
