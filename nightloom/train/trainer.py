"""The training loop one rank runs: build the layout, train, checkpoint, report metrics, stop cleanly.

Launched by torchrun (`python -m torch.distributed.run ... -m nightloom.train --job job.json`) or as one
plain process. Rank 0 appends StepMetrics JSONL and writes TrainResult; every rank may serve Prometheus.
"""

from __future__ import annotations

import math
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from nightloom import perf
from nightloom.track.attempt import attach_trackers
from nightloom.train import checkpoint
from nightloom.train.adapter_ckpt import base_fingerprint, check_base
from nightloom.train.data import ConversationRows, PackedWindows, StepLoader, read_eval_rows, read_eval_windows
from nightloom.train.job import TrainJob, TrainResult
from nightloom.train.lora import LoraSettings, trainable
from nightloom.train.moe import ExpertLoad
from nightloom.train.optim import grad_norm_and_clip, lr_at, make_optimizer, set_lr, step_and_zero
from nightloom.train.parallelize import IGNORE_INDEX, build_parts, label_nll_sum
from nightloom.train.preempt import PREEMPTED, PREEMPTED_EXIT, Preemption
from nightloom.train.preference.step import Layout, PreferenceStep, eval_line
from nightloom.train.rank import (  # re-exported: tests and bench/ import them from here
    Context,
    check_pack,
    init_distributed,
    measure_peak,
    peak_memory_bytes,
    precision_dtype,
    reset_peak_memory,
    write_pid,
)
from nightloom.train.reporting import MetricsFileSink, PromSink, StdoutSink, StepRecord, StepReporter
from nightloom.train.rollout.task import GRPOLayout, GRPOTask
from nightloom.train.sft_batch import (
    FlopCounter,
    label_scale,
    step_counts,
    trim_to_labels,
    width_multiple,
)
from nightloom.util import atomic_write_text

__all__ = ["Context", "Trainer", "check_pack", "export_result", "main", "precision_dtype"]
_init_distributed = init_distributed  # bench/dpo.py and bench/sft_vs_trl.py build a Trainer by this name


class Trainer:
    """One rank's training run; `run()` returns the TrainResult (rank 0 also writes it)."""

    def __init__(self, job: TrainJob, ctx: Context):
        self.job, self.ctx = job, ctx
        self.plan = job.plan
        self.dims = job.plan.dims()
        self.shape = job.model
        if self.plan.tp > 1 and self.shape.vocab % self.plan.tp:  # embedding rows padded for TP, cut on export
            self.shape = self.shape.padded_for_tp(self.plan.tp)
        self.param_dtype = precision_dtype(job.train.precision, ctx.device.type)
        torch.manual_seed(job.train.seed)
        self.lora = LoraSettings.from_spec(job.train.lora)
        # a LoRA run over model.weights checkpoints its adapters only (train/adapter_ckpt.py); the base's fingerprint
        self.adapters_only, self.base_fp = self.lora is not None and bool(job.weights), None
        self.parts = build_parts(
            self.shape,
            self.plan,
            self.dims,
            ctx.mesh,
            job.train.seq_len,
            job.train.seed,
            ctx.device,
            self.param_dtype,
            lora=self.lora,
            compile=job.train.compile,
            fp8=job.train.fp8_recipe if job.train.precision == "fp8" else None,
            loss_chunk=job.train.loss_chunk_tokens,
        )
        if self.plan.cp > 1:  # ring attention (CP) runs SDPA over every query head's K/V
            for part in self.parts.parts:
                part.expand_kv_heads()
        t = job.train
        self.optims = [make_optimizer(trainable(m), t) for m in self.parts.parts]  # LoRA: the adapters only
        dp_rank = self.dims.dp_rank(ctx.rank)
        self.sft = t.task == "sft"  # one conversation per row, the loss over label tokens (assistant turns) only
        data = dict(seed=t.seed, tokenizer=job.tokenizer, s3=job.s3)
        rows = ConversationRows(job.manifest, t.seq_len, pack=t.pack, **data) if self.sft else None
        self.grpo = None  # train.task grpo: prompts, rollouts, rewards and the GRPO loss (train/rollout/task.py)
        if t.task == "grpo":
            lay = GRPOLayout(self.dims.dp, dp_rank, self.plan.tp, self.dims.dp > 1, self.plan.micro_batch)
            self.grpo = GRPOTask(job, lay, self._log)
        self.pref = None  # train.task dpo: preference pairs, their loss and reference (train/preference/step.py)
        if t.task == "dpo":
            p = self.plan
            wm = width_multiple(p.pp, p.cp, p.tp, p.sp, ctx.device.type) or 1  # pp = cp = 1 (spec/preference.py)
            layout = Layout(
                self.dims.dp, dp_rank, p.tp * p.pp * p.cp, p.micro_batch, p.grad_accum, self.dims.dp > 1, wm
            )
            self.pref = PreferenceStep(job, layout, self.lora is not None, self._log)
            rows = self.pref.rows
        self.pack_stats = rows.stats() if t.pack else None  # conversations per packed row, logged and in result
        self.loader = (
            None
            if self.grpo is not None
            else StepLoader(
                rows or PackedWindows(job.manifest, t.seq_len, **data),
                self.plan.micro_batch,
                self.plan.grad_accum,
                self.dims.dp,
                dp_rank,
                width_multiple(self.plan.pp, self.plan.cp, self.plan.tp, self.plan.sp, ctx.device.type),
                t.group_by_length,
            )
        )
        self.tokens_per_step = self.loader.global_batch * t.seq_len if self.loader is not None else 0
        self.pp_group = ctx.mesh["pp"].get_group() if self.plan.pp > 1 else None
        self.fsdp = self.dims.dp > 1
        self.flops = FlopCounter(self.shape, self.plan.recompute, frozen_base=self.lora is not None)  # as computed
        self.moe = ExpertLoad(self.shape.router_aux_loss_coef, self.shape.num_experts) if self.shape.moe else None
        self.peak, self.peak_source = measure_peak(job, ctx)
        self.eval_batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        if job.eval_every and self.pref is None and self.grpo is None:
            self.eval_batches = self._eval_set()
        # train.async_checkpoint: periodic saves written by a thread while the next steps run
        self.saver = checkpoint.AsyncSaver(job.checkpoint_dir, ctx.rank) if t.async_checkpoint else None
        self._attach_sinks()

    def _attach_sinks(self) -> None:
        """The step reporter's sinks: rank 0 metrics.jsonl and the step line; every rank its Prometheus gauges
        (train.metrics_port); the trackers (track: MLflow, W&B, TensorBoard on rank 0, sent by their own threads)."""
        job, rank = self.job, self.ctx.rank
        self.prom = None
        if job.train.metrics_port is not None:
            from nightloom.train.prom import RankMetrics

            self.prom = RankMetrics(job.train.metrics_port + rank, job.run_id, rank)
        self.reporter = StepReporter()
        if rank == 0:
            self.reporter.add(MetricsFileSink(job.metrics_path))
            self.reporter.add(StdoutSink())
        if self.prom is not None:
            self.reporter.add(PromSink(self.prom))
        self.trackers = attach_trackers(self.reporter, job.track, job.run_dir, job.run_id, rank)

    # -- one step --------------------------------------------------------------------------------------
    def _autocast(self):
        if self.param_dtype is not None and not self.fsdp:  # FSDP's MixedPrecisionPolicy casts instead
            return torch.autocast(self.ctx.device.type, dtype=self.param_dtype)
        return nullcontext()

    def _context_parallel(self, model, x: torch.Tensor, y: torch.Tensor):
        """CP (GPU only): shard inputs, targets and rope tables on the sequence; SDPA becomes ring attention."""
        if self.plan.cp == 1:
            return nullcontext()
        from torch.distributed.tensor.experimental import context_parallel

        bufs = [x, y, model.rope_cos, model.rope_sin]
        return context_parallel(
            self.ctx.mesh["cp"], buffers=bufs, buffer_seq_dims=[1, 1, 0, 0], no_restore_buffers={x, y}
        )

    def _forward_backward(self, step: int) -> torch.Tensor:
        """Local mean loss of this rank's share (0 on non-last pipeline stages); sft: this rank's share of the
        global mean over label tokens, times dp·cp (the mean over ranks in `_global_loss` gives the global mean)."""
        if self.grpo is not None:  # rollout (or the round's batch again), rewards, advantages, loss, backward
            local, self.counts, self.pref_figures = self.grpo.forward_backward(
                self.parts.parts[0], step, self.ctx.device, self.flops, self._autocast
            )
            return local
        if self.pref is not None:
            m = self.parts.parts[0]
            local, self.counts, self.pref_figures = self.pref.forward_backward(
                m, step, self.ctx.device, self._autocast, self.flops
            )
            return local
        batch = self.loader.batch(step)
        dev = self.ctx.device
        p = self.plan  # label tokens, ids computed and their FLOPs over the global batch: metrics and the sft loss
        self.counts = step_counts(batch.micro, self.flops, self.sft, self.dims.dp, p.tp * p.pp * p.cp, dev)
        if self.sft:
            self.parts.loss.scale = label_scale(self.counts, step, self.dims.dp, p.cp, len(batch.micro))
        if self.parts.schedule is not None:
            x, y = batch.inputs.to(dev), batch.targets.to(dev)
            losses: list[torch.Tensor] = []
            args = (x,) if self.parts.has_first else ()
            kwargs = {"target": y, "losses": losses} if self.parts.has_last else {}
            with self._autocast():
                self.parts.schedule.step(*args, **kwargs)
            if self.parts.has_last:
                return torch.stack([x.detach().float() for x in losses]).mean()
            return torch.zeros((), device=dev)
        model = self.parts.parts[0]
        total = torch.zeros((), device=dev)
        n = len(batch.micro)
        for i, (x, y) in enumerate(batch.micro):
            if self.fsdp:  # reduce-scatter only after the last micro-batch (or each: parallel.reduce_each_micro_batch)
                model.set_requires_gradient_sync(i == n - 1 or p.reduce_each_micro_batch)
            x, y = x.to(dev), y.to(dev)
            with self._autocast(), self._context_parallel(model, x, y):
                # train.pack: each row's document ids make attention block-causal and positions per conversation
                docs = None if batch.docs is None else batch.docs[i].to(dev)
                loss = self.parts.loss.of(model, x, y, docs) / n  # chunked with the head where it is whole
                if self.moe is not None:  # MoE: + coef · router load-balancing loss (transformers'), experts' load
                    loss = loss + self.moe.loss(model) / n
                loss.backward()
            total += loss.detach().float()
        return total

    # -- held-out evaluation ---------------------------------------------------------------------------
    def _eval_set(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This DP rank's slices of the fixed eval set, one (inputs, targets) pair of mb·ga rows per global batch:
        windows of the held-out stream, or for sft conversations (targets IGNORE_INDEX where not a label).

        The window count is rounded down to whole global batches (at least one), so the eval set depends only on
        the spec (global_batch), never on the layout; each eval batch has a training batch's shape (PP schedule)."""
        t, tok = self.job.train, self.loader.w.tokenizer
        if self.sft:
            chat = self.job.chat_settings() if self.job.eval_data else None
            _, x, y = read_eval_rows(
                self.job.manifest, self.job.eval_data, tok, t.seq_len, self.job.eval_windows, chat, s3=self.job.s3
            )
        else:
            _, wins = read_eval_windows(
                self.job.manifest, self.job.eval_data, tok, t.seq_len, self.job.eval_windows, s3=self.job.s3
            )
            x, y = wins[:, :-1], wins[:, 1:]
        g = self.loader.global_batch
        n = max(1, len(x) // g) * g
        if len(x) < g:
            reps = -(-g // len(x))
            x, y = x.repeat(reps, 1), y.repeat(reps, 1)  # fewer than one batch: repeated (the mean is unchanged)
        local = self.loader.mb * self.loader.ga
        r = self.loader.dp_rank
        return [
            (x[b + r * local : b + (r + 1) * local], y[b + r * local : b + (r + 1) * local]) for b in range(0, n, g)
        ]

    @torch.no_grad()
    def evaluate(self) -> tuple[float, int]:
        """(token-weighted mean NLL, predicted tokens) over the eval set: the NLL sum and token count of the last
        pipeline stage of each rank are all-reduced over every rank; TP (and CP) ranks of one DP group count
        the same windows alike, so the ratio is the global mean. sft: label targets only."""
        dev = self.ctx.device
        nll = torch.zeros((), dtype=torch.float64, device=dev)
        count = torch.zeros((), dtype=torch.float64, device=dev)
        for m in self.parts.parts:
            m.eval()
        try:
            for x, y in self.eval_batches:
                x, y = x.to(dev), y.to(dev)
                if self.parts.schedule is not None:
                    losses: list[torch.Tensor] = []
                    args = (x,) if self.parts.has_first else ()
                    kwargs = {"target": y, "losses": losses} if self.parts.has_last else {}
                    self.parts.loss.scale, scale = 1.0, self.parts.loss.scale  # each micro-batch's NLL sum
                    try:
                        with self._autocast():
                            self.parts.schedule.eval(*args, **kwargs)
                    finally:
                        self.parts.loss.scale = scale
                    if self.parts.has_last:
                        nll += torch.stack([v.detach().double() for v in losses]).sum()
                        count += (y != IGNORE_INDEX).sum().double()
                    continue
                model = self.parts.parts[0]
                for i in range(0, len(x), self.plan.micro_batch):
                    xb, yb = x[i : i + self.plan.micro_batch], y[i : i + self.plan.micro_batch]
                    xb, yb = trim_to_labels(xb, yb, self.loader.width_multiple)  # as training's micro-batches
                    with self._autocast(), self._context_parallel(model, xb, yb):
                        nll += label_nll_sum(model(xb), yb).double()
                        count += (yb != IGNORE_INDEX).sum().double()
        finally:
            for m in self.parts.parts:
                m.train()
        t = torch.stack([nll, count]).to(torch.float64)
        dist.all_reduce(t)
        return float(t[0] / t[1]), int(round(float(t[1]) / self.plan.tp / self.plan.cp))

    def _should_stop(self, est_step_s: float) -> tuple[str | None, float]:
        """All ranks agree on a preemption notice any of them got, or the deadline (MAX all-reduce), so they
        stop at the same step: "preempted", "deadline" or None; the all-reduce time is the collective latency."""
        dl = self.job.deadline_unix
        late = 1.0 if dl is not None and time.time() + est_step_s >= dl else 0.0
        flag = torch.tensor([1.0 if Preemption.received else 0.0, late], device=self.ctx.device)
        t0 = time.perf_counter()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop = PREEMPTED if flag[0].item() > 0 else "deadline" if flag[1].item() > 0 else None
        return stop, time.perf_counter() - t0

    def _global_loss(self, local: torch.Tensor) -> float:
        is_last = 1.0 if self.parts.has_last else 0.0
        t = torch.stack([local.float() * is_last, torch.tensor(is_last, device=local.device)])
        dist.all_reduce(t)
        return float(t[0] / t[1])

    # -- the run ---------------------------------------------------------------------------------------
    def _log(self, msg: str) -> None:
        if self.ctx.rank == 0:
            print(msg, flush=True)

    def run(self) -> TrainResult:
        job, t = self.job, self.job.train
        t_start = time.time()
        start = self._resume()
        self._announce(start)
        if self.pref is not None:  # the reference's log-probs, and the held-out pairs before any step
            self.pref.prepare(self.parts.parts[0], start, self._autocast, self.ctx.device)
        if self.grpo is not None:  # the held-out prompts' mean reward before any step
            self.grpo.prepare(self.parts.parts[0], start)
        step, stopped, last_loss, last_ckpt, saved_at = start, "completed", None, None, None
        est = 0.0
        reset_peak_memory(self.ctx.device)
        while step < t.steps:
            if job.stop_after_steps is not None and step >= job.stop_after_steps:
                stopped = "stop_after_steps"
                break
            if self.saver is not None and (done := self.saver.poll()) is not None:
                self._log(f"[nightloom.train] async checkpoint written: {done}")
            stop, latency = self._should_stop(est)
            if stop:
                stopped = stop
                if stop == PREEMPTED:
                    self._log(
                        f"[nightloom.train] preemption notice ({Preemption.received or 'a peer'}): saving step {step}"
                    )
                break
            record = self._train_step(step, start, latency)
            step, est, last_loss = record.step, record.step_time_s, record.loss
            self.reporter.emit(record)
            if t.checkpoint_every and step % t.checkpoint_every == 0 and step < t.steps:
                last_ckpt = self._save(step, periodic=True)
                saved_at = step
        if self.saver is not None:  # the save in flight is written and published before the run ends
            self.saver.wait()
        if saved_at != step and step > start:
            last_ckpt = self._save(step)
        elif saved_at is None and step == start and start > 0:
            last_ckpt = str(checkpoint.latest(job.checkpoint_dir)[0])
        return self._finish(step, stopped, last_loss, last_ckpt, t_start)

    def _resume(self) -> int:
        """The step to start from: a resumed native checkpoint's (it wins over the initial weights), else 0."""
        job = self.job
        found = checkpoint.latest(job.checkpoint_dir) if job.resume else None
        if found is not None:
            path, start = found
            meta = checkpoint.read_meta(path)
            if self.adapters_only or meta.get("adapters_only"):  # the base from model.weights (fingerprinted),
                self._load_weights(job.weights)  # checked against an adapter-only checkpoint's, then the adapters
                check_base(meta, path, self.base_fp, job.weights)
            checkpoint.load(path, self.parts.parts, self.optims)
            self._log(f"[nightloom.train] resumed from {path} at step {start} in layout {self.plan.layout()}")
            return start
        if job.weights:
            self._load_weights(job.weights)
        return 0

    def _announce(self, start: int) -> None:
        """The run's opening lines: job, layout, batch and peak; packing; LoRA's trainable share."""
        job, t = self.job, self.job.train
        g = self.grpo.g if self.grpo is not None else None  # grpo: prompts x completions each
        batch = f"{g.prompts_per_step}x{g.num_generations}" if g else f"{self.loader.global_batch}x{t.seq_len}"
        self._log(
            f"[nightloom.train] run {job.run_id} attempt {job.attempt}: {self.shape.name} layout "
            f"{self.plan.layout()} world {self.ctx.world} device {self.ctx.device.type} steps {start}->{t.steps} "
            f"global batch {batch}{' completions' if g else ''} peak {self.peak / 1e9:.1f} GFLOP/s "
            f"({self.peak_source})"
        )
        if self.pack_stats is not None:
            self._log(f"[nightloom.train] {self.pack_stats.line()}")
        if self.lora is not None:
            params = {id(p): p for m in self.parts.parts for p in m.parameters()}.values()
            n_train, n_all = sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
            self._log(
                f"[nightloom.train] LoRA rank {self.lora.rank} alpha {self.lora.alpha:g} on "
                f"{','.join(self.lora.modules)}: {n_train:,} trainable of {n_all:,} parameters"
                f"{' on this stage' if self.plan.pp > 1 else ''} ({n_train / max(n_all, 1):.2%}); the base is frozen"
            )

    def _train_step(self, step: int, start: int, latency: float) -> StepRecord:
        """One optimizer step at `step` (0-based), its evaluation when due; the record of step + 1."""
        job, t, dev = self.job, self.job.train, self.ctx.device
        t0 = time.perf_counter()
        lr = lr_at(step, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
        set_lr(self.optims, lr)
        local = self._forward_backward(step)
        if self.parts.tied is not None:  # a tied matrix's two pipeline copies: one summed gradient
            self.parts.tied.sum_grads()
        gnorm = float(grad_norm_and_clip(self.parts, t.grad_clip, self.pp_group))
        step_and_zero(self.optims)
        loss = self._global_loss(local)
        experts, aux = self.moe.take(dev) if self.moe is not None else (None, None)
        mem = torch.tensor([float(peak_memory_bytes(dev))], device=dev)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        dt = time.perf_counter() - t0
        step += 1
        c = self.counts  # MFU from the FLOPs computed: unpacked sft rows as wide as their micro-batch's longest
        mfu, hfu = (perf.mfu(1 / dt, f, self.ctx.world, self.peak) for f in (c.flops, c.hflops))
        ev_loss = ev_ppl = ev_tokens = None
        figures = self._preference_figures(step, start)
        if figures and "eval_loss" in figures:
            ev_loss = figures["eval_loss"]
        if self.eval_batches and (step == 1 or step % job.eval_every == 0 or step == t.steps):
            ev_loss, ev_tokens = self.evaluate()
            ev_ppl = math.exp(min(ev_loss, 700.0))
            self._log(f"eval step {step}: loss {ev_loss:.4f} ppl {ev_ppl:.2f} over {ev_tokens:,} tokens")
        return StepRecord(
            step=step,
            total_steps=t.steps,
            loss=loss,
            grad_norm=gnorm,
            lr=lr,
            tokens=c.computed,
            tokens_per_s=c.computed / dt,
            label_tokens=c.labels,
            label_tokens_per_s=c.labels / dt,
            flops=c.flops,
            hardware_flops=c.hflops,
            step_time_s=dt,
            peak_mem_bytes=mem.item(),
            local_mem_bytes=peak_memory_bytes(dev),
            mfu=mfu,
            hfu=hfu,
            time=time.time(),
            attempt=job.attempt,
            gap=step == start + 1 and start > 0,
            world_size=self.ctx.world,
            collective_latency_s=latency,
            eval_loss=ev_loss,
            eval_ppl=ev_ppl,
            eval_tokens=ev_tokens,
            router_aux_loss=aux,
            expert_tokens=experts,
            preference=figures,
        )

    def _preference_figures(self, step: int, start: int) -> dict[str, float] | None:
        """train.task dpo (and grpo: train/rollout/task.py): the step's figures under TRL's names, with the held-out
        pairs' (eval_*) when due; the first step after a fresh start also carries them before training (start_eval_*)."""
        if self.grpo is not None:
            return self.grpo.figures(self.parts.parts[0], step, start, self.pref_figures)
        if self.pref is None:
            return None
        figures = dict(self.pref_figures)
        every, last = self.job.eval_every, self.job.train.steps
        if self.pref.eval_docs and (step == 1 or step % every == 0 or step == last):  # eval_docs: every > 0
            ev = self.pref.evaluate(self.parts.parts[0], self.ctx.device, self._autocast)
            self._log(eval_line(step, ev))
            figures |= {f"eval_{k}": v for k, v in ev.items()}
        if step == start + 1 and self.pref.initial is not None:
            figures |= {f"start_eval_{k}": v for k, v in self.pref.initial.items()}
        return figures

    def _finish(self, step: int, stopped: str, last_loss, last_ckpt, t_start: float) -> TrainResult:
        """The run's TrainResult; rank 0 writes result.json and says where it stopped."""
        job, t = self.job, self.job.train
        result = TrainResult(
            steps_done=step,
            total_steps=t.steps,
            stopped=stopped,
            final_loss=last_loss,
            tokens=step * self.tokens_per_step if self.grpo is None else self.grpo.tokens,
            wall_s=time.time() - t_start,
            last_checkpoint=last_ckpt,
            peak_flops=self.peak,
            peak_source=self.peak_source,
            conversations_per_row=self.pack_stats.per_row if self.pack_stats else None,
            pack_fill=self.pack_stats.fill if self.pack_stats else None,
            checkpoint_bytes=checkpoint.size_bytes(Path(last_ckpt)) if last_ckpt else None,
        )
        if self.trackers is not None:  # what each tracker took, or lost, within track.flush_s
            for status in self.trackers.close():
                self._log(f"[nightloom.train] tracker {status.note()}")
        if self.ctx.rank == 0:
            atomic_write_text(job.result_path, result.model_dump_json(indent=2) + "\n")
            self._log(f"[nightloom.train] {stopped} at step {step}/{t.steps}; checkpoint {last_ckpt}")
        return result

    def _load_weights(self, uri: str) -> None:
        """Hugging Face weights into this rank's shards (collective); every tensor checked before any step."""
        from nightloom.hf.load import fetch_weights, load_hf_weights

        first = int(os.environ.get("LOCAL_RANK", "0")) == 0  # one download per node for an s3:// prefix
        folder = fetch_weights(uri, self.job.s3, log=self._log) if first else None
        dist.barrier()
        if folder is None:  # the node's copy is in the cache now: found, not fetched
            folder = fetch_weights(uri, self.job.s3, log=lambda _: None)
        t0 = time.perf_counter()
        index = load_hf_weights(self.parts.parts, folder, self.shape)
        if self.adapters_only:  # rank 0 fingerprints the base the adapters train on, every rank keeps it
            fp = [base_fingerprint(folder, self.lora.quant) if self.ctx.rank == 0 else None]
            dist.broadcast_object_list(fp, src=0)
            self.base_fp = fp[0]
            if self.saver is not None:
                self.saver.extra = self._ckpt_meta()
        if self.parts.tied is not None:  # the last stage's head is the loaded embedding
            self.parts.tied.sync_weights()
        secs = time.perf_counter() - t0
        self._log(
            f"[nightloom.train] loaded {len(index.tensors)} tensors ({index.total_bytes / 2**20:.1f} MiB) from "
            f"{uri} in {secs:.2f} s ({index.total_bytes / 2**20 / max(secs, 1e-9):.0f} MiB/s)"
        )

    def _save(self, step: int, periodic: bool = False) -> str:
        """A checkpoint at `step`; a periodic one under train.async_checkpoint is written in the background."""
        if periodic and self.saver is not None:
            path, secs = self.saver.save(step, self.parts.parts, self.optims)
            self._log(f"[nightloom.train] async checkpoint step {step} -> {path} (blocked {secs:.2f} s)")
            return str(path)
        if self.saver is not None:
            self.saver.wait()
        path, secs = checkpoint.save(
            self.job.checkpoint_dir, step, self.parts.parts, self.optims, self.ctx.rank, self._ckpt_meta()
        )
        what = "adapters only, " if self.adapters_only else ""
        if self.ctx.rank == 0:
            what += f"{checkpoint.size_bytes(path) / 2**20:.1f} MiB, "
        self._log(f"[nightloom.train] checkpoint step {step} -> {path} ({what}{secs:.2f} s)")
        return str(path)

    def _ckpt_meta(self) -> dict | None:
        """meta.json's extra fields: an adapter-only checkpoint and the fingerprint of its base."""
        return {"adapters_only": True, "base": self.base_fp} if self.adapters_only else None

    def close(self) -> None:
        if self.prom is not None:
            self.prom.close()


def export_result(job: TrainJob, result: TrainResult, dtype: str) -> TrainResult:
    """Rank 0, after the process group is gone (no peer waits on a collective meanwhile): the Hugging Face
    export of the final checkpoint, then result.json again with its path."""
    from nightloom.hf.export import ADAPTER_DIR, export_checkpoint

    t0 = time.perf_counter()
    out = export_checkpoint(
        Path(result.last_checkpoint),
        job.model,
        job.export_dir,
        dtype=dtype,
        source_config=job.hf_config,
        tokenizer=job.tokenizer_dir,
        lora=LoraSettings.from_spec(job.train.lora),
        base=job.weights,
        chat_template=job.chat_template,
    )
    adapter = str(out / ADAPTER_DIR) if job.train.lora is not None else None
    result = result.model_copy(update={"export_dir": str(out), "adapter_dir": adapter})
    atomic_write_text(job.result_path, result.model_dump_json(indent=2) + "\n")
    print(f"[nightloom.train] exported {out} ({dtype}, {time.perf_counter() - t0:.2f} s)", flush=True)
    return result


def main(job: TrainJob) -> int:
    """One rank's run; 0, or PREEMPTED_EXIT after a preemption signal (the checkpoint saved first)."""
    Preemption.install(job.preempt_signal)
    ctx = init_distributed(job)
    write_pid(job, ctx.rank)
    trainer = None
    result = None
    try:
        trainer = Trainer(job, ctx)
        result = trainer.run()
        dist.barrier()
    except Exception as e:
        print(f"[nightloom.train] rank {ctx.rank} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized() and ctx.owns_group:
            dist.destroy_process_group()
    if ctx.rank == 0 and job.export_format == "hf" and result.stopped == "completed" and result.last_checkpoint:
        export_result(job, result, "fp32" if trainer.param_dtype is None else "bf16")
    return PREEMPTED_EXIT if result.stopped == PREEMPTED else 0
