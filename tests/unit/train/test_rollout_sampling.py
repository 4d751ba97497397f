"""Per-group sampling (nightloom.train.rollout.sampling.GroupGenerators): the inverse-CDF draw samples the filtered
distribution (never a token of probability 0), and a group's draws depend on its seed, step and global index only,
not on the other groups of its batch, so a data-parallel split samples what one process samples."""

from __future__ import annotations

import torch

from nightloom.train.rollout.sampling import SamplingParams, group_generators, inverse_cdf, next_tokens


def test_inverse_cdf_samples_the_distribution_and_skips_zero_probability():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]]).expand(40000, -1)
    tokens = inverse_cdf(
        probs,
        torch.rand(
            40000,
            generator=torch.Generator().manual_seed(0),
        ),
    )
    freq = torch.bincount(tokens, minlength=6).double() / 40000
    assert freq[[0, 2, 5]].sum() == 0  # a zero-probability token, even at u = 0 or at the end
    assert torch.allclose(freq, probs[0].double(), atol=0.01)  # 4 standard errors of a 0.5 share: 0.01
    edge = inverse_cdf(probs[:2], torch.tensor([0.0, 1.0]))  # u at both ends (u * total rounded up to it)
    assert edge.tolist() == [1, 4]


def test_a_group_draws_the_same_wherever_its_batch_puts_it():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.9, top_p=0.95)
    whole = next_tokens(logits, params, group_generators(5, 2, 0, 3, 2))[0]  # groups 0, 1, 2 of 2 rows
    rank0 = next_tokens(logits[:2], params, group_generators(5, 2, 0, 1, 2))[0]
    rank1 = next_tokens(logits[2:], params, group_generators(5, 2, 1, 2, 2))[0]
    assert torch.equal(whole, torch.cat([rank0, rank1]))
    other_step = next_tokens(logits, params, group_generators(5, 3, 0, 3, 2))[0]
    other_seed = next_tokens(logits, params, group_generators(6, 2, 0, 3, 2))[0]
    assert not torch.equal(whole, other_step) and not torch.equal(whole, other_seed)
