"""The chunked cross-entropy fused with the head (train/loss.py) equals the plain loss (whole logits, then
F.cross_entropy) in fp32: the loss and the gradients of the hidden states and the head weight, within 1e-6, with
uneven chunks, ignored targets, TP-padded head rows and Gemma's soft-capping; and through the model's forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nightloom.train.loss import IGNORE_INDEX, HeadLoss, chunked_nll_sum


def _plain(h, w, y, vocab, softcap):
    logits = F.linear(h, w)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits[..., :vocab]
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


@pytest.mark.parametrize(
    ("rows", "vocab", "softcap", "chunk"),
    [(1000, 1000, None, 7), (1008, 1000, 30.0, 16), (512, 512, None, 10_000)],
)
def test_chunked_equals_plain(rows, vocab, softcap, chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 37, 64, generator=g, dtype=torch.float64).float().requires_grad_()
    w = (torch.randn(rows, 64, generator=g) * 0.1).requires_grad_()
    y = torch.randint(0, vocab, (3, 37), generator=g)
    y[0, :5] = IGNORE_INDEX  # sft: not labels
    n = (y != IGNORE_INDEX).sum()  # the trainer's mean over label tokens
    ref = _plain(h, w, y, vocab, softcap) / n
    gh, gw = torch.autograd.grad(ref, (h, w))
    got = chunked_nll_sum(h, w, y, vocab, softcap, chunk) / n
    ch, cw = torch.autograd.grad(got, (h, w))
    assert abs(float(got.detach()) - float(ref.detach())) < 1e-6
    assert torch.allclose(ch, gh, atol=1e-6, rtol=0) and torch.allclose(cw, gw, atol=1e-6, rtol=0)
    with torch.no_grad():  # eval: no checkpoint, the same sum
        assert abs(float(chunked_nll_sum(h, w, y, vocab, softcap, chunk) / n - got)) < 1e-6


def test_model_forward_with_head_loss_equals_plain():
    """Transformer.forward(head_loss=...) gives the mean CE of its logits, and the same parameter gradients."""
    from nightloom.catalog import get_model
    from nightloom.train.model import build_model
    from nightloom.train.parallelize import loss_fn

    shape = get_model("tiny")
    m = build_model(shape, 32, device="cpu")
    m.init_weights(1)
    x = torch.randint(0, shape.vocab, (2, 32), generator=torch.Generator().manual_seed(3))
    y = torch.roll(x, -1, 1)
    plain = loss_fn(m(x), y)
    plain.backward()
    ref = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    fused = m(x, head_loss=HeadLoss(y, shape.vocab, shape.final_logit_softcap, None, 9))
    fused.backward()
    assert abs(float(fused.detach()) - float(plain.detach())) < 1e-6
    for n, p in m.named_parameters():
        assert torch.allclose(p.grad, ref[n], atol=1e-6, rtol=0), n
