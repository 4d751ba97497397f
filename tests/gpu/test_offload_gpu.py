"""parallel.offload_layers on CUDA (train/offload.py's side stream, pinned host copies, record_stream): the same loss
and gradients as without offload, and the device's peak lower by about the offloaded layers' saved bytes (the
planner's count, planner/activations.py), one layer's copy in flight allowed. The CPU bookkeeping is tested in
tests/unit/train/test_offload.py; this is the part only a GPU runs. Skipped without CUDA."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu  # tests/conftest.py skips every gpu-marked test without CUDA

SEQ, BATCH = 2048, 2


def _step(offload: set[int]):
    from nightloom.catalog import get_model
    from nightloom.train.model import build_model

    shape = get_model("llama3.2-1b").with_(layers=8, tied_embeddings=False)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = build_model(shape, SEQ, device="cpu").to(torch.bfloat16)
    model.init_weights(3)
    model = model.to(dev)
    model.set_offload(offload, dev)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, shape.vocab, (BATCH, SEQ), generator=g).to(dev)
    y = torch.randint(0, shape.vocab, (BATCH, SEQ), generator=g).to(dev)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters()}
    return shape, float(loss), grads, peak, model.offload.stats if model.offload else None


@pytest.mark.timeout(300)
def test_offload_on_cuda_same_gradients_lower_peak():
    from nightloom.planner.activations import activation_bytes_per_layer

    shape, base_loss, base_grads, base_peak, _ = _step(set())
    _, loss, grads, peak, stats = _step({0, 1, 2, 3})
    assert loss == base_loss
    for name, g in base_grads.items():
        assert torch.equal(grads[name], g), name
    assert stats.late == 0 and stats.host_bytes == 0 and stats.prefetched == 4
    layer = activation_bytes_per_layer(shape, SEQ, BATCH, 1, False, "none")
    saved = base_peak - peak
    print(
        f"peak {base_peak / 2**20:.1f} -> {peak / 2**20:.1f} MiB (-{saved / 2**20:.1f}), layer {layer / 2**20:.1f} MiB"
    )
    assert saved >= 2 * layer, (saved, layer)  # 4 offloaded, up to 2 on the device at once (planner/offload.py)
