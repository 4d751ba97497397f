"""parallel.offload_layers on one process (train/offload.py): the offloaded layers' saved tensors leave the device
during forward and come back one layer ahead of their backward, and the step's loss and gradients are exactly the
ones without offload. The per-pipeline-rank memory against the planner: tests/distributed/test_pipeline_memory.py."""

from __future__ import annotations

import pytest
import torch

from nightloom.catalog import get_model
from nightloom.parallel import ParallelDims
from nightloom.planner.activations import activation_bytes_per_layer
from nightloom.train.model import build_model
from nightloom.train.offload import offloaded_layers
from nightloom.train.pipeline_memory import ActivationMeter

SEQ = 64
SHAPE = get_model("tiny").with_(layers=4)


def _step(offload: set[int], dtype=torch.float32):
    """(loss, grads, saved-tensor peak on the device, the offload's stats) of one forward and backward."""
    torch.manual_seed(0)
    model = build_model(SHAPE, SEQ, device="cpu").to(dtype)
    model.init_weights(3)
    model.set_offload(offload, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, SHAPE.vocab, (2, SEQ), generator=g)
    y = torch.randint(0, SHAPE.vocab, (2, SEQ), generator=g)
    meter = ActivationMeter.over([model], offloads=[model.offload] if model.offload else [])
    with meter:
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, meter.reading.saved_peak, model.offload.stats if model.offload else None


@pytest.mark.parametrize("layers", [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}], ids=str)
def test_same_loss_and_gradients_less_on_the_device(layers):
    base_loss, base_grads, base_peak, _ = _step(set())
    loss, grads, peak, stats = _step(layers)
    assert torch.equal(loss, base_loss)
    for name, g in base_grads.items():
        assert torch.equal(grads[name], g), name
    # every offloaded layer's tensors went to host and all came back; each group fetched ahead of its backward
    assert stats.sent_bytes > 0 and stats.host_bytes == 0 and stats.device_bytes == 0
    assert stats.prefetched == len(layers) and stats.late == 0
    # the offloaded layers' saved bytes leave the device but the model's input (the embedding's output, kept);
    # one layer may be back for its backward while the next one still runs (planner/stage_memory.py)
    layer = 2 * activation_bytes_per_layer(SHAPE, SEQ, 2, 1, False, "none")  # fp32: twice the 16-bit count
    saved = base_peak - peak
    print(f"offload {sorted(layers)}: device peak {base_peak} -> {peak} (-{saved}), layer {layer:.0f}, stats {stats}")
    embedded, back = 4 * 2 * SEQ * SHAPE.hidden, 2 if len(layers) == SHAPE.layers else 1  # the last: it and one more
    assert (len(layers) - back) * layer - embedded <= saved <= len(layers) * layer - embedded + 0.01 * layer
    assert stats.host_peak == pytest.approx(len(layers) * layer - embedded, rel=0.05)


def test_bf16_round_trip_is_exact():
    base_loss, base_grads, _, _ = _step(set(), torch.bfloat16)
    loss, grads, _, _ = _step({1, 2}, torch.bfloat16)
    assert torch.equal(loss, base_loss)
    assert all(torch.equal(grads[n], g) for n, g in base_grads.items())


def test_which_layers_a_rank_offloads():
    """Each rank's first n layers in model order, its chunks in turn (chunk j on rank j mod pp)."""
    assert offloaded_layers([4, 5, 12, 13], 3) == {4, 5, 12}
    c = ParallelDims(pp=2, virtual_stages=2, schedule="interleaved_1f1b", grad_accum=4, offload_layers=3)
    assert c.offloaded_per_chunk(8) == (2, 2, 1, 1)  # 2 layers a chunk: rank 0 chunks 0, 2; rank 1 chunks 1, 3
    assert c.offloaded_per_chunk(16) == (3, 3, 0, 0)
    ends = ParallelDims(pp=2, virtual_stages=2, schedule="interleaved_1f1b", stages=(0, 8, 8, 0), offload_layers=2)
    assert ends.offloaded_per_chunk(16) == (0, 2, 2, 0)


def test_refused_with_recompute_or_more_than_a_rank_holds():
    c = ParallelDims(pp=2, grad_accum=2, offload_layers=3, recompute="selective")
    why = c.check(SHAPE, SEQ, None)
    assert any("offload_layers (3) exceeds the layers a pipeline rank holds (2)" in w for w in why), why
    assert any("recompute 'selective'" in w for w in why), why
    assert ParallelDims(pp=2, grad_accum=2, offload_layers=2).check(SHAPE, SEQ, None) == []
