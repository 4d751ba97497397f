"""Native generation (nightloom.train.rollout.generate) against transformers' `generate` (software we did not
write), greedy, token for token, on tiny random Llama, Qwen3 and Gemma 3 (sliding window shorter than the
completion, its own RoPE base, soft-capped logits); prompts of different lengths (left padding), an EOS id the
model does emit, stop strings; and seeded sampling repeatable from the (step, rank) generator."""

from __future__ import annotations

import pytest
import torch
import transformers

from nightloom.hf.load import model_from_hf
from nightloom.hf.random_model import build_random_model
from nightloom.train.rollout.generate import generate, left_padded
from nightloom.train.rollout.logps import completion_logps, rollout_batch
from nightloom.train.rollout.sampling import SamplingParams, filter_logits, rollout_generator

BASE = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "initializer_range": 0.3,
}
CASES = {
    "llama": ("llama", {"rope_theta": 10000.0}),
    "qwen3": ("qwen3", {"rope_theta": 1e6, "head_dim": 16, "tie_word_embeddings": True}),
    "gemma3": (
        "gemma3_text",
        {
            "head_dim": 16,
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "query_pre_attn_scalar": 16,
            "final_logit_softcapping": 10.0,
        },
    ),
}
PROMPTS = [[5, 17, 33, 2, 9, 61, 40], [8, 71], [12, 13, 14, 15]]
NEW = 20
PAD = 0


@pytest.fixture(scope="module", params=sorted(CASES))
def models(request, tmp_path_factory):
    arch, cfg = CASES[request.param]
    folder = build_random_model(
        tmp_path_factory.mktemp(request.param) / "hf", arch, seed=4, norm_std=0.2, **BASE, **cfg
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return request.param, hf, model_from_hf(folder, 64).eval()


def _hf_greedy(hf, eos: int | None) -> list[list[int]]:
    ids, pad = left_padded(PROMPTS, None, PAD)
    mask = torch.arange(ids.shape[1])[None, :] >= pad[:, None]
    out = hf.generate(
        ids,
        attention_mask=mask.long(),
        max_new_tokens=NEW,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=PAD,
    )[:, ids.shape[1] :]
    rows = []
    for row in out.tolist():
        cut = row.index(eos) + 1 if eos is not None and eos in row else len(row)
        rows.append(row[:cut])
    return rows


def test_greedy_equals_transformers_generate(models):
    name, hf, ours = models
    free = _hf_greedy(hf, None)
    eos = free[0][NEW // 2]  # a token the model does emit mid-way: row 0 (at least) stops there
    ref = _hf_greedy(hf, eos)
    out = generate(ours, PROMPTS, SamplingParams(max_new_tokens=NEW, temperature=0), eos_ids=[eos], pad_id=PAD)
    assert out.completion_ids() == ref, name
    assert len(ref[0]) <= NEW // 2 + 1 and not bool(out.truncated[0])
    assert out.truncated.tolist() == [len(r) == NEW and r[-1] != eos for r in ref]
    # greedy log-probs are the model's log-softmax at the chosen token: <= 0, and 0 past each row's end
    assert bool((out.logprobs[out.mask] <= 0).all()) and bool((out.logprobs[~out.mask] == 0).all())


def test_right_padded_batch_equals_token_lists(models):
    _, _, ours = models
    width = max(map(len, PROMPTS))
    ids = torch.tensor([p + [PAD] * (width - len(p)) for p in PROMPTS])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in PROMPTS])
    params = SamplingParams(max_new_tokens=8, temperature=0)
    a = generate(ours, ids, params, eos_ids=[], pad_id=PAD, attention_mask=mask)
    b = generate(ours, PROMPTS, params, eos_ids=[], pad_id=PAD)
    assert torch.equal(a.tokens, b.tokens)
    with pytest.raises(ValueError, match="row 1: its attention mask has holes"):
        generate(ours, ids, params, eos_ids=[], pad_id=PAD, attention_mask=torch.tensor([[1] * 7, [1, 0, 1] + [0] * 4]))


def test_seeded_sampling_repeats_after_recreating_the_generator(models):
    _, _, ours = models
    params = SamplingParams(max_new_tokens=12, temperature=1.3, top_k=40, top_p=0.9)

    def run(step, rank):
        return generate(ours, PROMPTS, params, eos_ids=[], pad_id=PAD, generator=rollout_generator(7, step, rank))

    first, again, other = run(3, 0), run(3, 0), run(4, 0)
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.logprobs, again.logprobs)
    assert not torch.equal(first.tokens, other.tokens)
    assert not torch.equal(first.tokens, run(3, 1).tokens)


def test_stop_strings_end_a_row_at_the_completing_token(models):
    _, _, ours = models
    free = generate(ours, PROMPTS, SamplingParams(max_new_tokens=NEW, temperature=0), eos_ids=[], pad_id=PAD)
    row = free.completion_ids()[1]

    def decode(ids):
        return "".join(f"<{i}>" for i in ids)

    stop = decode(row[4:6])  # two tokens of row 1's completion
    params = SamplingParams(max_new_tokens=NEW, temperature=0, stop=(stop,))
    out = generate(ours, PROMPTS, params, eos_ids=[], pad_id=PAD, decode=decode)
    got = out.completion_ids()[1]
    assert stop in decode(got) and stop not in decode(got[:-1]) and len(got) <= 6
    assert not bool(out.truncated[1])
    with pytest.raises(ValueError, match="stop strings need a decode"):
        generate(ours, PROMPTS, params, eos_ids=[], pad_id=PAD)


def test_top_k_and_top_p_keep_transformers_sets():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    for k, p in ((2, 1.0), (0, 0.8), (3, 0.5)):
        ref = transformers.TopPLogitsWarper(p)(None, transformers.TopKLogitsWarper(k)(None, logits)) if k else None
        if ref is None:
            ref = transformers.TopPLogitsWarper(p)(None, logits)
        ours = filter_logits(logits, k, p)
        assert torch.equal(torch.isinf(ours), torch.isinf(ref)), (k, p)


def test_training_forward_log_probs_equal_the_sampled_ones(models):
    """The log-probs kept at sampling equal the training forward's (padding as documents of their own): the GRPO
    ratio is exactly 1 before the first update."""
    _, _, ours = models
    params = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.95)
    out = generate(ours, PROMPTS, params, eos_ids=[3], pad_id=PAD, generator=rollout_generator(0, 0, 0))
    ids, pad = left_padded(PROMPTS, None, PAD)
    with torch.no_grad():
        logps = completion_logps(ours, rollout_batch(ids, pad, out), temperature=0.8)
    assert torch.allclose(logps, out.logprobs, atol=1e-5), float((logps - out.logprobs).abs().max())
    with torch.no_grad():  # negative control: the left padding attended as if it were text moves them
        plain = ours(torch.cat([ids, out.tokens], 1))[:, ids.shape[1] - 1 : -1].float() / 0.8
    moved = plain.log_softmax(-1).gather(-1, out.tokens[..., None])[..., 0] * out.mask
    assert not torch.allclose(moved[1], out.logprobs[1], atol=1e-3)
