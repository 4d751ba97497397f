"""train.grpo.engine vllm: a vLLM engine colocated in each training rank (TRL's GRPOTrainer with
vllm_mode="colocate"), sampling the rank's completions on its GPU from the trainer's weights, pushed before each
round's rollout when an optimizer step changed them (push.hf_state: FSDP2 shards gathered, LoRA merged, Hugging
Face names).

vLLM starts from the model's config.json with dummy weights (`load_format="dummy"`: nothing read from disk; the
first `sync` pushes the trainer's, so a resumed run samples from its resumed weights), in the rank's own process
(`distributed_executor_backend="external_launcher"`, tensor parallel 1: each rank one engine, as TRL's colocated
engines), holding `train.grpo.vllm.gpu_memory_utilization` of the GPU; with `sleep` it frees its weights and KV
cache while the trainer runs (sleep level 2) and is woken and pushed the weights again for each rollout.

Each row is one request seeded by `GroupDraw.row_seeds` (vLLM's per-request seed), so a group's completions do not
depend on the layout or the batch; vLLM's sampler is not the native per-group inverse-CDF draw, so they are not
bit-equal to a native run's. The vLLM records (CompletionOutput: token_ids, logprobs, finish_reason) become
`Completion`s, then a `Rollout` (`rollout_of`)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from nightloom.hf.config import config_for_export, read_config
from nightloom.hf.export import tokenizer_files
from nightloom.shape import ModelShape
from nightloom.spec.grpo import VLLM_PIN, VLLMSpec
from nightloom.train.rollout.engine import GroupDraw
from nightloom.train.rollout.generate import Rollout
from nightloom.train.rollout.push import hf_state
from nightloom.train.rollout.sampling import SamplingParams
from nightloom.util import atomic_write_text


class EngineUnavailable(RuntimeError):
    """train.grpo.engine vllm cannot start here (no CUDA GPU, vllm not importable)."""


@dataclass(frozen=True)
class Completion:
    """One completion as an engine gives it: its token ids (EOS or the stop string's last token included), the
    sampled tokens' log-probs, and whether it stopped at the token limit (truncated)."""

    token_ids: list[int]
    logprobs: list[float]
    truncated: bool

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} token ids but {len(self.logprobs)} log-probs")


def sampling_kwargs(params: SamplingParams, seed: int | None, eos_ids: Sequence[int]) -> dict:
    """vLLM's SamplingParams keyword arguments for one row: one completion, `params`' temperature (0: greedy, no
    seed), top-k (0: all, as vLLM's), top-p, token limit and stop strings (kept in the text, as native keeps the
    token that completes one), the run's EOS ids as the only stop tokens (vLLM's own EOS ignored: a row ends where
    a native one does), the sampled token's log-prob."""
    return {
        "n": 1,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "max_tokens": params.max_new_tokens,
        "seed": None if params.greedy else seed,
        "stop": list(params.stop) or None,
        "stop_token_ids": list(eos_ids),
        "ignore_eos": True,  # the model's own EOS ids (config, tokenizer) do not stop a row: only eos_ids, as native
        "include_stop_str_in_output": True,
        "logprobs": 0,  # the sampled token's only
        "detokenize": bool(params.stop),  # stop strings are matched in the text
    }


def completion_of(output) -> Completion:
    """A vLLM CompletionOutput (token_ids; logprobs: per token a dict token id -> Logprob) as a `Completion`."""
    ids = list(output.token_ids)
    if output.logprobs is None:
        raise ValueError("vLLM returned no log-probs (SamplingParams.logprobs must be 0)")
    lps = [float(step[t].logprob) for t, step in zip(ids, output.logprobs, strict=True)]
    return Completion(ids, lps, output.finish_reason == "length")


def rollout_of(completions: Sequence[Completion], max_new_tokens: int, pad_id: int, device=None) -> Rollout:
    """The `Rollout` of completions: (B, max_new_tokens) tokens right-padded with pad_id, their log-probs (0 past
    a row's end), the mask of each row's own tokens, the truncated rows."""
    b = len(completions)
    tokens = torch.full((b, max_new_tokens), pad_id, dtype=torch.long)
    logprobs = torch.zeros((b, max_new_tokens), dtype=torch.float32)
    lengths = torch.zeros(b, dtype=torch.long)
    for i, c in enumerate(completions):
        n = len(c.token_ids)
        if n > max_new_tokens:
            raise ValueError(f"completion {i}: {n} tokens, over max_new_tokens {max_new_tokens}")
        tokens[i, :n] = torch.as_tensor(c.token_ids, dtype=torch.long)
        logprobs[i, :n] = torch.as_tensor(c.logprobs, dtype=torch.float32)
        lengths[i] = n
    mask = torch.arange(max_new_tokens)[None, :] < lengths[:, None]
    truncated = torch.tensor([c.truncated for c in completions], dtype=torch.bool)
    return Rollout(*(t.to(device) for t in (tokens, logprobs, mask)), truncated=truncated.to(device))


def model_folder(shape: ModelShape, hf_config: str | None, tokenizer: str | None, dtype: str) -> Path:
    """A folder vLLM starts from: the run's config.json (as the export writes it) and its tokenizer files."""
    folder = Path(tempfile.mkdtemp(prefix="nightloom-vllm-"))
    source = read_config(hf_config) if hf_config else None
    cfg = config_for_export(shape, source, dtype)
    atomic_write_text(folder / "config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in tokenizer_files(tokenizer):
        (folder / f.name).write_bytes(f.read_bytes())
    return folder


def launcher_env() -> None:
    """The variables vLLM's external launcher reads, from this rank's process group (TRL sets the same): RANK,
    LOCAL_RANK and WORLD_SIZE as torch.distributed has them, a rendezvous address when none is set."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device()))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")


class VLLMEngine:
    """vLLM colocated in this rank: `sync` pushes the trainer's weights, `generate` samples (RolloutEngine)."""

    recomputes_logps = True

    def __init__(
        self,
        folder: Path,
        shape: ModelShape,
        settings: VLLMSpec,
        *,
        seed: int,
        max_model_len: int,
        dtype: str,
        eos_ids: Sequence[int],
        pad_id: int,
        dora: bool = False,
    ):
        if not torch.cuda.is_available():
            raise EngineUnavailable("train.grpo.engine: vllm needs a CUDA GPU on the node; none found")
        try:
            from vllm import LLM
        except ImportError as err:
            msg = f"train.grpo.engine: vllm is not importable on the node ({err}); it needs {VLLM_PIN}"
            raise EngineUnavailable(msg) from err
        self.shape, self.settings, self.dora = shape, settings, dora
        self.eos_ids, self.pad_id = list(eos_ids), pad_id
        launcher_env()
        has_tokenizer = any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json"))
        self.llm = LLM(
            model=str(folder),
            tensor_parallel_size=1,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            max_model_len=max_model_len,
            enable_sleep_mode=settings.sleep,
            distributed_executor_backend="external_launcher",
            seed=seed,
            load_format="dummy",
            dtype="bfloat16" if dtype == "bf16" else "float32",
            max_num_batched_tokens=max(4096, max_model_len),
            logprobs_mode="processed_logprobs",
            skip_tokenizer_init=not has_tokenizer,
        )
        self.pushed: int | None = None
        self.asleep = False
        if settings.sleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def _runner_model(self) -> nn.Module:
        """vLLM's model in this process (the external launcher runs its worker here; TRL loads weights the same
        way)."""
        return self.llm.llm_engine.model_executor.driver_worker.model_runner.model

    def sync(self, model: nn.Module, version: int) -> None:
        """Push the trainer's weights when they changed (`version`: optimizer steps done) or vLLM slept them away."""
        if version == self.pushed and not self.asleep:
            return
        if self.asleep:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
        target = self._runner_model()
        for name, tensor in hf_state(model, self.shape, self.dora):
            target.load_weights([(name, tensor)])
        self.llm.reset_prefix_cache()
        self.pushed, self.asleep = version, False

    def generate(
        self, model: nn.Module, prompts: Sequence[Sequence[int]], params: SamplingParams, draw: GroupDraw
    ) -> Rollout:
        from vllm import SamplingParams as VSamplingParams

        if len(prompts) != draw.groups * draw.size:
            raise ValueError(f"{len(prompts)} prompt rows for {draw.groups} groups of {draw.size}")
        if self.pushed is None:
            raise RuntimeError("the vllm engine holds dummy weights: sync(model, version) before generate")
        if self.asleep:  # weights slept away after the last rollout: the same weights pushed again
            self.sync(model, self.pushed)
        if self.settings.sleep:
            self.llm.wake_up(tags=["kv_cache"])
        seeds = draw.row_seeds()
        rows = [{"prompt_token_ids": list(p)} for p in prompts]
        sampling = [VSamplingParams(**sampling_kwargs(params, s, self.eos_ids)) for s in seeds]
        with torch.autocast("cuda", enabled=False):  # vLLM keeps its own dtypes, whatever the trainer's autocast
            outputs = self.llm.generate(rows, sampling_params=sampling, use_tqdm=False)
        completions = [completion_of(o.outputs[0]) for o in outputs]
        if self.settings.sleep:
            self.llm.sleep(level=2)
            self.asleep = True
        return rollout_of(completions, params.max_new_tokens, self.pad_id, torch.device("cuda"))
