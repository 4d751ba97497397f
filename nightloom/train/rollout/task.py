"""train.task grpo inside the trainer: this rank's prompts (prompts.py), one optimizer step's rollout, scoring and
backward (step.py's GRPOStep), the step's figures under TRL's names over every rank, the held-out prompts' mean
reward, and the table of sampled completions every `log_completions_every` steps. The Trainer
(nightloom/train/trainer.py) keeps the layout, the optimizer, checkpoints and reporting.

One generated batch serves `iterations` optimizer steps (GRPO's μ); each prompt group's RNG is seeded by (seed,
step // iterations, the group's global index), so any layout samples the same completions and a run resumed at a round's first step samples what the first attempt did. A resume in the middle of a
round (a checkpoint at a step that is not a multiple of iterations) generates that round again from the resumed
weights."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from nightloom.metrics import read_metrics
from nightloom.rewards.resolve import RewardRef
from nightloom.spec.grpo import GRPOSpec
from nightloom.train.parallelize import IGNORE_INDEX
from nightloom.train.rollout.chat_prompts import prompt_template
from nightloom.train.rollout.engine import NativeEngine, RolloutEngine
from nightloom.train.rollout.logps import rollout_batch
from nightloom.train.rollout.prompts import PromptStream, read_prompt_file, read_prompt_tables, to_prompts
from nightloom.train.rollout.rewards import load_rewards
from nightloom.train.rollout.step import GRPOSettings, GRPOStep, ScoredRollout, decoder, reduction
from nightloom.train.rollout.table import CompletionsTable, write_table
from nightloom.train.sft_batch import step_counts


@dataclass(frozen=True)
class GRPOLayout:
    """What the task needs of the trainer's layout: DP size and rank, the copies of one DP slice (tp), and
    whether FSDP syncs gradients."""

    dp: int
    dp_rank: int
    copies: int
    fsdp: bool
    micro_batch: int  # completions per training forward


class GRPOTask:
    """train.task grpo for one rank: its prompts, the rewards and GRPOStep, the batch being reused."""

    def __init__(self, job, layout: GRPOLayout, log: Callable[[str], None] = print):
        t = job.train
        g = t.grpo or GRPOSpec()
        self.job, self.g, self.layout, self.log = job, g, layout, log
        table, tok = read_prompt_tables(job.manifest, job.tokenizer, job.s3, heldout=False)
        room = t.seq_len - g.max_completion_tokens
        if room < 1:
            raise ValueError(
                f"train.seq_len: {t.seq_len} leaves no room for a prompt before train.grpo.max_completion_tokens "
                f"{g.max_completion_tokens}"
            )
        held = None
        if job.eval_every and g.eval_prompts:  # validate.eval_data, else the held-out split
            held = read_prompt_file(job.eval_data, job.manifest, job.s3) if job.eval_data else None
            held = held or read_prompt_tables(job.manifest, job.tokenizer, job.s3, heldout=True)[0]
        texts = table.texts + (held.texts if held is not None else [])
        template = prompt_template(g.chat_template, texts, job.tokenizer.path, job.chat_template)
        prompts = to_prompts(table, tok, room, template)
        self.stream = PromptStream(prompts, g.prompts_per_step, t.seed, layout.dp, layout.dp_rank)
        self.heldout = to_prompts(held, tok, room, template)[: g.eval_prompts] if held is not None else []
        rewards = load_rewards([RewardRef(r.fn, r.weight, r.args) for r in g.rewards], ".", "train.grpo.rewards")
        settings = GRPOSettings.from_spec(g, layout.micro_batch)
        engine = make_engine(job, [tok.eos_id], tok.eos_id, decoder(tok))
        self.step = GRPOStep(settings, rewards, decoder(tok), [tok.eos_id], tok.eos_id, t.seed, layout.dp_rank, engine)
        self.batch: ScoredRollout | None = None
        self.batch_round = -1
        self.initial: dict[str, float] | None = None  # the held-out figures before the first step
        self.tokens = 0  # ids computed by training forwards, over every rank (TrainResult.tokens)
        self.num_tokens = 0  # TRL's num_tokens: prompt + completion tokens generated so far, over every rank

    def prepare(self, model, start: int) -> None:
        """On a fresh start with held-out prompts: their mean reward before any step."""
        if self.heldout and start == 0:
            self.step.engine.sync(model, start)
            self.initial = self.evaluate(model)
            self.log(eval_line(0, self.initial))
        if start > 0:
            self.num_tokens = resumed_num_tokens(Path(self.job.metrics_path), start)

    def _num_tokens(self, batch: ScoredRollout, device) -> float | None:
        """dapo's denominator: the generation batch's loss tokens over every rank, divided by dp (FSDP averages
        the ranks' gradients)."""
        if self.g.loss_type != "dapo":
            return None
        r = batch.rollout
        mask = r.mask & ~r.truncated[:, None] if self.g.mask_truncated else r.mask
        t = torch.tensor([float(mask.sum())], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return float(t[0]) / self.layout.copies / self.layout.dp

    def forward_backward(self, model, step: int, device, flops, autocast=nullcontext):
        """This rank's share of step `step`: (its loss, the global StepCounts, the step's figures). `autocast`:
        the trainer's (bf16 compute without FSDP; log-probs and the loss are taken in fp32)."""
        lay = self.layout
        rnd = step // self.g.iterations
        if self.batch is None or self.batch_round != rnd:
            self.step.engine.sync(model, step)  # the vllm engine: the weights after `step` optimizer steps
            with autocast():
                self.batch = self.step.rollout(model, self.stream.round(rnd), step)
            self.batch_round = rnd
            self.num_tokens += self._generated_tokens(self.batch, device)
        sync = (lambda last: model.set_requires_gradient_sync(last)) if lay.fsdp else None
        with autocast():
            loss, figures = self.step.train(model, self.batch, self._num_tokens(self.batch, device), sync)
        whole = rollout_batch(self.batch.prompt_ids, self.batch.pad, self.batch.rollout)
        targets = torch.where(whole.doc_ids[:, 1:] == 1, whole.ids[:, 1:], IGNORE_INDEX)
        counts = step_counts([(whole.ids[:, :-1], targets)], flops, True, lay.dp, lay.copies, device)
        self.tokens += counts.computed
        figures = self._global(figures, self.batch.scores.total, device)
        figures["generation_s"], figures["scoring_s"] = self.batch.generation_s, self.batch.scoring_s
        figures["num_tokens"] = float(self.num_tokens)
        return torch.tensor(loss, device=device), counts, figures

    def _generated_tokens(self, batch: ScoredRollout, device) -> int:
        """The batch's prompt + completion tokens over every DP rank (each completion with its prompt, unpadded,
        truncated ones whole: TRL's num_input_tokens_seen increment); tensor-parallel copies counted once."""
        mine = generated_tokens([p.ids for p in batch.prompts], batch.rollout.lengths)
        t = torch.tensor([mine], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return round(float(t[0]) / self.layout.copies)

    def _global(self, figures: dict[str, float], totals: torch.Tensor, device) -> dict[str, float]:
        """Every rank's figures averaged (each DP rank holds as many completions; the loss's token means, kl and
        the clip ratios, weighted by each rank's loss tokens as TRL's; a min or max figure the min or max over
        ranks), `reward` and `reward_std` from every completion's total reward."""
        out, tokens = {}, figures.pop("loss_tokens")  # the loss's token means weigh each rank by its tokens
        token_mean = {
            k for k in figures if k in ("kl", "entropy") or (k.startswith("clip_ratio/") and k.endswith("_mean"))
        }
        for how, op in (("mean", dist.ReduceOp.SUM), ("min", dist.ReduceOp.MIN), ("max", dist.ReduceOp.MAX)):
            names = sorted(k for k in figures if reduction(k) == how)  # the same names on every rank
            vals = [figures[k] * (tokens if k in token_mean else 1.0) for k in names] + [tokens]
            t = torch.tensor(vals, dtype=torch.float64, device=device)
            dist.all_reduce(t, op=op)
            if how == "mean":
                t = torch.tensor([v / (t[-1] if k in token_mean else dist.get_world_size()) for k, v in zip(names, t)])
            out |= dict(zip(names, t.tolist(), strict=False))
        gathered = [torch.zeros_like(totals) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, totals.to(device))
        every = torch.cat(gathered[:: self.layout.copies]) if self.layout.copies > 1 else torch.cat(gathered)
        out["reward"] = float(every.mean())
        out["reward_std"] = float(every.std()) if every.numel() > 1 else 0.0
        return out

    def figures(self, model, step: int, start: int, local: dict[str, float]) -> dict[str, float]:
        """The step's figures, with the held-out prompts' (eval_*) when due and the ones before the first step
        (start_eval_*) on the first step after a fresh start; the completions table when due."""
        out = dict(local)
        every, last = self.job.eval_every, self.job.train.steps
        if self.heldout and (step == 1 or step % every == 0 or step == last):
            self.step.engine.sync(model, step)
            ev = self.evaluate(model)
            self.log(eval_line(step, ev))
            out |= {f"eval_{k}": v for k, v in ev.items()}
        if step == start + 1 and self.initial is not None:
            out |= {f"start_eval_{k}": v for k, v in self.initial.items()}
        n = self.g.log_completions_every
        if n and (step % n == 0 or step == last) and dist.get_rank() == 0:
            self.write_table(step)
        return out

    def evaluate(self, model) -> dict[str, float]:
        return self.step.evaluate(model, self.heldout)

    def write_table(self, step: int) -> Path:
        """Rank 0's completions of the current batch with their rewards (table.py)."""
        b = self.batch
        texts = [self.step.decode(ids) for ids in b.rollout.completion_ids()]
        rows = []
        for i, (p, text) in enumerate(zip(b.prompts, texts, strict=True)):
            row = {"prompt": p.text, "completion": text, "reward": round(float(b.scores.total[i]), 4)}
            row |= {name: round(float(b.scores.per_fn[i, j]), 4) for j, name in enumerate(b.scores.names)}
            row["advantage"] = round(float(b.advantages.values[i]), 4)
            rows.append(row)
        return write_table(self.job.run_dir, CompletionsTable(step=step, rows=rows))


def make_engine(job, eos_ids: list[int], pad_id: int, decode: Callable[[list[int]], str]) -> RolloutEngine:
    """train.grpo.engine of a run: native generation over the training model, or vLLM colocated in this rank
    (vllm_engine.py: started from the run's config and tokenizer, the weights pushed before the first rollout)."""
    g = job.train.grpo or GRPOSpec()
    if g.engine == "native":
        return NativeEngine(eos_ids, pad_id, decode)
    from nightloom.train.rollout.vllm_engine import VLLMEngine, model_folder

    dtype = "fp32" if job.train.precision == "fp32" else "bf16"
    folder = model_folder(job.model, job.hf_config, job.tokenizer_dir or job.tokenizer.path, dtype)
    if g.stop and not (folder / "tokenizer.json").is_file():
        raise ValueError("train.grpo.stop: the vllm engine matches stop strings with a Hugging Face tokenizer "
                         f"(tokenizer.json); {job.tokenizer.path or job.tokenizer.kind} is not one")  # fmt: skip
    lora = job.train.lora
    return VLLMEngine(folder, job.model, g.vllm_settings, seed=job.train.seed, max_model_len=job.train.seq_len,
                      dtype=dtype, eos_ids=eos_ids, pad_id=pad_id, dora=bool(lora and lora.use_dora))  # fmt: skip


def generated_tokens(prompt_ids: list[list[int]], completion_lengths: torch.Tensor) -> int:
    """Prompt + completion tokens of a generated batch, one prompt per completion (TRL 1.16's GRPOTrainer adds
    sum(prompt_lengths) + sum(completion_lengths) to `num_input_tokens_seen`, its `num_tokens` figure)."""
    return sum(len(p) for p in prompt_ids) + int(completion_lengths.sum())


def resumed_num_tokens(metrics_path: Path, start: int) -> int:
    """num_tokens at step `start` from an earlier attempt's metrics.jsonl (0 when it holds none), so the running
    total goes on across a resume."""
    if not metrics_path.is_file():
        return 0
    seen = [m.model_extra.get("num_tokens") for m in read_metrics(metrics_path, allow_empty=True) if m.step <= start]
    seen = [v for v in seen if v is not None]
    return round(seen[-1]) if seen else 0


def eval_line(step: int, figures: dict[str, float]) -> str:
    """The terminal's held-out line of a grpo run."""
    return (
        f"eval step {step}: held-out mean reward {figures['reward']:.4f} ± {figures['reward_se']:.4f} (SE) "
        f"std {figures['reward_std']:.4f}"
    )
