"""train.task dpo inside the trainer: one optimizer step's forward and backward over this rank's pairs, the
reference's log-probs (nightloom/train/preference/reference.py), held-out pairs, and the step's figures under
TRL's names. The Trainer (nightloom/train/trainer.py) keeps the layout, the optimizer, checkpoints and reporting.

A global batch is train.global_batch pairs: each DP rank takes micro_batch pairs per forward (2·micro_batch
rows, chosen then rejected, as wide as the longest) and grad_accum forwards. The step's loss is the mean over all
its pairs: each micro-batch's summed per-pair loss is divided by the rank's pairs (mb·ga), and FSDP's mean over the
DP ranks completes it (ORPO: plus the chosen completions' mean NLL over the micro-batches).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from nightloom.spec.preference import PreferenceSpec
from nightloom.train.data import DataError, base_uri
from nightloom.train.preference import reference as ref
from nightloom.train.preference.data import PairRows, eval_pairs_file, heldout_pairs, pair_batch
from nightloom.train.preference.logps import sequence_logps
from nightloom.train.preference.losses import LossSettings, orpo_nll, pair_loss
from nightloom.train.preference.metrics import PairSums
from nightloom.train.sft_batch import step_counts


@dataclass(frozen=True)
class Layout:
    """What the step needs of the trainer's layout: DP rank and size, the copies of one DP slice (tp·pp·cp),
    micro-batch and accumulation, and whether FSDP syncs gradients."""

    dp: int
    dp_rank: int
    copies: int
    micro_batch: int
    grad_accum: int
    fsdp: bool
    width_multiple: int = 1  # inputs' width rounds up to it (tp under sequence parallel)


class PreferenceStep:
    """train.task dpo for one rank: its pairs, the loss settings and the reference."""

    def __init__(self, job, layout: Layout, lora: bool, log=print):
        t = job.train
        pref = t.preference or PreferenceSpec()
        self.job, self.layout, self.log = job, layout, log
        self.settings = LossSettings(pref.loss, pref.beta, pref.label_smoothing, pref.simpo_gamma)
        self.how = pref.reference_how(lora)
        self.rows = PairRows(job.manifest, t.seed, job.tokenizer, job.s3, layout.width_multiple)
        self.local = layout.micro_batch * layout.grad_accum
        self.eval_docs = self._eval_docs() if job.eval_every else []
        self.table: np.ndarray | None = None  # precomputed: rows of the training stream, then the eval pairs
        self.reference_model = None  # frozen_copy: the initial weights, sharded as the policy
        self.initial: dict[str, float] | None = None  # the held-out figures before the first step

    def _eval_docs(self) -> list:
        job = self.job
        if job.eval_data:
            chat = job.chat_settings().model_copy(update={"task": "dpo"})
            docs = eval_pairs_file(job.eval_data, job.tokenizer.path or "", chat)
        else:
            docs = heldout_pairs(job.manifest, job.tokenizer, job.s3)
        if not docs:
            raise DataError(f"{job.eval_data or job.manifest}: no held-out preference pairs to evaluate")
        return docs

    # -- the reference ---------------------------------------------------------------------------------
    def prepare(self, model, start: int, autocast, device) -> None:
        """Before the first step: the reference (below), then on a fresh start the held-out figures."""
        self._prepare_reference(model, start, autocast, device)
        if self.eval_docs and start == 0:
            self.initial = self.evaluate(model, device, autocast)
            self.log(eval_line(0, self.initial))

    def _prepare_reference(self, model, start: int, autocast, device) -> None:
        """precomputed: load the stored table, or score every pair with the model as it is now (the initial
        weights: refused when resuming at step `start` > 0 without the table). frozen_copy: build the copy."""
        if self.how == "frozen_copy":
            self.reference_model = ref.frozen_copy(self.job, device)
            self.log("[nightloom.train] reference: a frozen copy of the initial weights, sharded as the policy")
            return
        if self.how != "precomputed":
            return
        total = self.rows.total + len(self.eval_docs)
        fp = ref.weights_fingerprint(self.job.weights, self.job.train.seed, self.job.model.name)
        key = ref.reference_key(fp, self.rows.manifest, self.rows.seed, len(self.eval_docs))
        path = ref.table_path(base_uri(self.job.manifest), key)
        self.table = ref.load_table(path, total)
        if self.table is not None:
            self.log(f"[nightloom.train] reference log-probs of {total} pairs loaded from {path}")
            return
        if start > 0:
            raise RuntimeError(
                f"resuming at step {start} with train.preference.reference precomputed, but {path} is missing: "
                "the initial weights are no longer in the model"
            )
        lay = self.layout

        def score(first: int, n: int):
            b = self._batch(first, n)
            return ref.score_pairs(model, b.inputs.to(device), b.targets.to(device), autocast)

        self.table = ref.compute_table(score, total, lay.micro_batch, lay.dp_rank, lay.dp, device)
        if dist.get_rank() == 0:
            ref.save_table(path, self.table)
        self.log(f"[nightloom.train] reference log-probs of {total} pairs computed and stored in {path}")

    def _batch(self, first: int, n: int):
        """Rows [first, first+n) of the training stream followed by the eval pairs (the table's row order)."""
        train = self.rows.total
        if first >= train:
            docs = self.eval_docs[first - train : first - train + n]
            return pair_batch(docs, self.rows.tokenizer.eos_id, self.layout.width_multiple)
        return self.rows.batch(first, n)

    def _reference(self, model, rows: np.ndarray, x, y, autocast):
        if self.how == "none":
            return None
        if self.how == "precomputed":
            t = torch.from_numpy(self.table[rows]).to(device=x.device, dtype=torch.float32)
            return t[:, 0], t[:, 1]
        if self.how == "frozen_copy":
            got = ref.score_pairs(self.reference_model, x, y, autocast).halves()
            return got[0].total, got[1].total
        with ref.adapters_disabled(model):
            got = ref.score_pairs(model, x, y, autocast).halves()
        return got[0].total, got[1].total

    # -- one step --------------------------------------------------------------------------------------
    def _micro(self, model, rows: np.ndarray, batch, device, autocast, scale: float, backward: bool):
        x, y = batch.inputs.to(device), batch.targets.to(device)
        reference = self._reference(model, rows, x, y, autocast)
        with autocast():
            logits = model(x)
        policy = sequence_logps(logits, y).halves()
        result = pair_loss(policy, reference, self.settings)
        loss = result.losses.sum() * scale
        if self.settings.loss == "orpo":
            loss = loss + orpo_nll(policy[0]) * scale * batch.pairs
        if backward:
            loss.backward()
        return loss.detach(), result, policy, (x, y)

    def forward_backward(self, model, step: int, device, autocast, flops):
        """This rank's share of step `step`: (its loss share, the global StepCounts, the step's figures)."""
        lay, g = self.layout, self.layout.micro_batch * self.layout.grad_accum * self.layout.dp
        first = step * g + lay.dp_rank * self.local
        total, sums, shapes = torch.zeros((), device=device), PairSums(), []
        for i in range(lay.grad_accum):
            if lay.fsdp:  # reduce-scatter only after the last micro-batch
                model.set_requires_gradient_sync(i == lay.grad_accum - 1)
            rows = (first + i * lay.micro_batch + np.arange(lay.micro_batch)) % self.rows.total
            batch = self.rows.batch(int(rows[0]), lay.micro_batch)
            loss, result, policy, xy = self._micro(model, rows, batch, device, autocast, 1 / self.local, True)
            total += loss.float()
            sums.add(result, policy, self.settings.loss in ("simpo", "orpo"))
            shapes.append(xy)
        counts = step_counts(shapes, flops, True, lay.dp, lay.copies, device)
        return total, counts, self._global(sums, device)

    def _global(self, sums: PairSums, device) -> dict[str, float]:
        t = sums.as_tensor().to(device)
        dist.all_reduce(t)
        return PairSums.from_tensor(t / self.layout.copies).figures()

    @torch.no_grad()
    def evaluate(self, model, device, autocast) -> dict[str, float]:
        """The held-out pairs' loss and TRL's figures, each DP rank a share (all-reduced)."""
        lay, sums = self.layout, PairSums()
        train, n = self.rows.total, len(self.eval_docs)
        model.eval()
        try:
            for start, count in shares(n, lay.micro_batch, lay.dp_rank, lay.dp):
                rows = train + start + np.arange(max(count, 1))
                batch = self._batch(int(rows[0]), len(rows))
                _, result, policy, _ = self._micro(model, rows, batch, device, autocast, 1.0, False)
                if count:  # a rank past the end runs the forward too (FSDP's collectives), and counts nothing
                    sums.add(result, policy, self.settings.loss in ("simpo", "orpo"))
        finally:
            model.train()
        return self._global(sums, device)


def eval_line(step: int, figures: dict[str, float]) -> str:
    """The terminal's held-out line of a dpo run."""
    return (
        f"eval step {step}: dpo loss {figures['loss']:.4f} reward accuracy {figures['rewards/accuracies']:.3f} "
        f"margin {figures['rewards/margins']:.4f} (chosen {figures['rewards/chosen']:.4f}, rejected "
        f"{figures['rewards/rejected']:.4f})"
    )


def shares(n: int, chunk: int, rank: int, ranks: int) -> list[tuple[int, int]]:
    """(start, count) of rank `rank`'s chunks of n items dealt round-robin in chunks; every rank gets the same
    number of chunks (a forward under FSDP is a collective), count 0 (start 0) where it has run out."""
    rounds = -(-n // (chunk * ranks))
    out = []
    for r in range(rounds):
        start = (r * ranks + rank) * chunk
        out.append((start, min(chunk, n - start)) if start < n else (0, 0))
    return out
