"""The rollout engine seam on CPU (nightloom.train.rollout.engine, push, vllm_engine): the state pushed to vLLM has
the Hugging Face export's names and shapes and, LoRA (and DoRA) merged, makes transformers' Llama compute what the
trainer's model computes; vLLM's SamplingParams built from train.grpo; completions as the protocol's records
turned into a Rollout; per-row request seeds that do not depend on the layout; and an engine whose log-probs are
not the trainer's gets them taken again by the training forward."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from nightloom.spec.grpo import GRPOSpec
from nightloom.train.lora import LoraSettings
from nightloom.train.rollout.engine import GroupDraw, NativeEngine
from nightloom.train.rollout.push import hf_state
from nightloom.train.rollout.sampling import SamplingParams
from nightloom.train.rollout.step import GRPOSettings, GRPOStep, Prompt
from nightloom.train.rollout.vllm_engine import Completion, rollout_of, sampling_kwargs
from tests.support.tiny_llama import MODULES, native_lora_model, save_tiny_llama


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("llama"))


def _hf_logits(folder, state: dict, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf.load_state_dict(state, strict=True)  # every name known, none missing
    return hf(ids).logits


@pytest.mark.parametrize("dora", [False, True])
def test_pushed_state_is_the_hf_export_with_lora_merged(llama_dir, dora):
    exported = load_file(str(llama_dir / "model.safetensors"))
    lora = LoraSettings(rank=4, alpha=8.0, dropout=0.0, modules=MODULES, dora=dora)
    model, shape = native_lora_model(llama_dir, lora)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # adapters that change the output (B is zero at init)
        for name, p in model.named_parameters():
            if ".lora_B." in name or "magnitude" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    state = dict(hf_state(model, shape, dora=dora))
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: tuple(v.shape) for k, v in exported.items()}
    assert torch.equal(state["model.norm.weight"], exported["model.norm.weight"])  # not adapted: as exported
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(state[q], exported[q])  # merged
    ids = torch.randint(0, 128, (2, 9), generator=gen)
    with torch.no_grad():
        ours = model(ids)
        theirs = _hf_logits(llama_dir, state, ids)
    torch.testing.assert_close(theirs, ours, atol=2e-5, rtol=1e-4)


def test_sampling_params_from_the_spec():
    g = GRPOSpec(max_completion_tokens=12, temperature=0.7, top_p=0.9, top_k=5, stop=["\n\n"])
    kw = sampling_kwargs(GRPOSettings.from_spec(g, 4).sampling, 123, [2])
    assert (kw["max_tokens"], kw["temperature"], kw["top_p"], kw["top_k"], kw["seed"]) == (12, 0.7, 0.9, 5, 123)
    assert (
        kw["stop"] == ["\n\n"] and kw["stop_token_ids"] == [2] and kw["include_stop_str_in_output"] and kw["ignore_eos"]
    )
    assert kw["logprobs"] == 0 and kw["detokenize"] and kw["n"] == 1
    greedy = sampling_kwargs(SamplingParams(max_new_tokens=8, temperature=0.0), 9, [2])
    assert greedy["seed"] is None and greedy["temperature"] == 0.0 and greedy["stop"] is None
    assert not greedy["detokenize"]


def test_completions_become_a_rollout():
    done = Completion([5, 6, 2], [-0.1, -0.2, -0.3], truncated=False)
    cut = Completion([7, 8, 9, 10], [-1.0, -1.5, -2.0, -2.5], truncated=True)
    r = rollout_of([done, cut], 4, pad_id=0)
    assert r.completion_ids() == [[5, 6, 2], [7, 8, 9, 10]]
    assert r.tokens[0].tolist() == [5, 6, 2, 0] and r.lengths.tolist() == [3, 4]
    assert r.logprobs[0].tolist() == pytest.approx([-0.1, -0.2, -0.3, 0.0])
    assert r.truncated.tolist() == [False, True]
    with pytest.raises(ValueError, match="completion 1: 4 tokens, over max_new_tokens 3"):
        rollout_of([done, cut], 3, pad_id=0)
    with pytest.raises(ValueError, match="2 token ids but 1 log-probs"):
        Completion([1, 2], [-0.5], truncated=False)


def test_row_seeds_do_not_depend_on_the_layout():
    whole = GroupDraw(3, 7, 0, 4, 2).row_seeds()
    halves = GroupDraw(3, 7, 0, 2, 2).row_seeds() + GroupDraw(3, 7, 2, 2, 2).row_seeds()
    assert whole == halves and len(set(whole)) == 8
    assert set(whole).isdisjoint(GroupDraw(3, 8, 0, 4, 2).row_seeds())  # another round, other seeds


class _Foreign(NativeEngine):
    """The native sampler standing in for an engine whose log-probs are not the trainer's (vLLM's): zeroed."""

    recomputes_logps = True

    def generate(self, model, prompts, params, draw):
        out = super().generate(model, prompts, params, draw)
        return type(out)(out.tokens, torch.zeros_like(out.logprobs), out.mask, out.truncated)


def test_another_engines_logps_are_taken_again_by_the_training_forward(llama_dir):
    model, _ = native_lora_model(llama_dir, LoraSettings(rank=4, alpha=8.0, dropout=0.0, modules=("q_proj",)))
    settings = GRPOSettings.from_spec(GRPOSpec(num_generations=2, max_completion_tokens=5), micro_batch=3)
    rewards = []
    gen = torch.Generator().manual_seed(1)
    prompts = [Prompt(torch.randint(3, 128, (2 + i,), generator=gen).tolist(), "") for i in range(3)]
    native = GRPOStep(settings, rewards, str, eos_ids=[1], pad_id=0, seed=4).rollout(model, prompts, 0)
    foreign = GRPOStep(settings, rewards, str, [1], 0, 4, engine=_Foreign([1], 0, str)).rollout(model, prompts, 0)
    assert torch.equal(native.rollout.tokens, foreign.rollout.tokens)
    assert float(foreign.rollout.logprobs.abs().sum()) > 0
    torch.testing.assert_close(foreign.rollout.logprobs, native.rollout.logprobs, atol=1e-5, rtol=1e-5)


def test_fsdp2_shards_are_pushed_whole_under_the_same_names(llama_dir, one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    lora = LoraSettings(rank=4, alpha=8.0, dropout=0.0, modules=("q_proj", "down_proj"))
    model, shape = native_lora_model(llama_dir, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.fill_(0.01)
    plain = {k: v.clone() for k, v in hf_state(model, shape)}
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert any(isinstance(p, DTensor) for p in model.parameters())
    sharded = dict(hf_state(model, shape))
    assert sharded.keys() == plain.keys()
    assert all(not isinstance(t, DTensor) and torch.equal(t, plain[k]) for k, t in sharded.items())
