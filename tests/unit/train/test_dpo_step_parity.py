"""The native trainer's DPO step (PreferenceStep.forward_backward: its pairs, micro-batches, accumulation, the
reference and the loss scaling) for ipo, sigmoid, simpo and orpo on the tiny pref Qwen2, three SGD steps in one process,
against TRL 1.16 on transformers' own model of the same weights fed the same pairs: every step's loss and reward
figures, and the weights after the third step, within 1e-5.

ipo and sigmoid through DPOTrainer.compute_loss itself with a frozen reference model (ours: the precomputed table
for ipo, train.preference.reference frozen_copy for sigmoid); simpo
through CPOTrainer's log-prob and loss functions (cpo_alpha 0: TRL has no SimPO-only trainer step); ORPO through
ORPOTrainer's log-prob and odds-ratio functions plus the chosen completion's NLL (the paper's L_SFT: TRL's
ORPOTrainer also counts the prompt's tokens in it, so its own step is not the reference here)."""

from __future__ import annotations

import copy
import json
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from nightloom.chat import ChatSettings
from nightloom.chat_pairs import split_pair
from nightloom.spec import DatasetSpec, ShardingSpec, TokenizerSpec
from tests.support.chat import CHATML, QWEN2, build_chat_tokenizer, chat_messages
from tests.support.harness import make_job

pytest.importorskip("trl")
TOL = 1e-5
STEPS, MICRO, ACCUM, LR = 3, 2, 2, 0.5


def _pairs(n: int) -> list[dict]:
    convs = chat_messages(n, seed=17)
    wrong = [" ".join(reversed(c[-1]["content"].split())) + " no" for c in convs]
    return [
        {"prompt": c[:-1], "chosen": [c[-1]], "rejected": [{"role": "assistant", "content": w}]}
        for c, w in zip(convs, wrong, strict=True)
    ]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import transformers

    from nightloom.hf.random_model import build_random_model
    from nightloom.sharding import shard_dataset

    root = tmp_path_factory.mktemp("dpo-step")
    tok = build_chat_tokenizer(root / "tok")
    weights = build_random_model(root / "qwen2", "qwen2", seed=7, **QWEN2)
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(p) + "\n" for p in _pairs(12)), encoding="utf-8")
    chat = ChatSettings(template=CHATML, seq_len=128, task="dpo")
    sharding = ShardingSpec(output=str(root / "shards"), num_shards=1, tolerance=0.9)
    shard_dataset(DatasetSpec(path=str(pairs)), sharding, tokenizer=TokenizerSpec(path=str(tok)), chat=chat)
    owns = not dist.is_initialized()
    if owns:  # the trainer's one-rank group (its figures are all-reduced)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(weights), dtype=torch.float32)
    yield SimpleNamespace(
        root=root, tok=tok, weights=weights, hf=hf, hf_tok=transformers.AutoTokenizer.from_pretrained(str(tok))
    )
    if owns:
        dist.destroy_process_group()


def _native(setup, loss: str, reference: str):
    """(PreferenceStep, native model with the HF weights) of a one-process dpo job with `loss`."""
    from nightloom.hf.load import load_hf_weights
    from nightloom.train.job import TrainJob
    from nightloom.train.model import build_model
    from nightloom.train.preference.step import Layout, PreferenceStep

    pref = {"loss": loss, "reference": reference}
    train = {"task": "dpo", "preference": pref, "optimizer": "sgd", "lr": LR, "warmup_steps": 0, "export": "none"}
    path = make_job(
        setup.root / "runs" / f"{loss}-{reference}",
        setup.root / "shards",
        hf=setup.weights,
        steps=STEPS,
        seq_len=128,
        global_batch=MICRO * ACCUM,
        micro_batch=MICRO,
        grad_accum=ACCUM,
        train_kw=train,
        job_kw={"tokenizer": TokenizerSpec(path=str(setup.tok))},
    )
    job = TrainJob.model_validate_json(path.read_text())
    model = build_model(job.model, job.train.seq_len, device="cpu")
    model.init_weights(job.train.seed)
    load_hf_weights([model], setup.weights, job.model, log=lambda _: None)
    step = PreferenceStep(job, Layout(1, 0, 1, MICRO, ACCUM, False), lora=False, log=lambda _: None)
    step.prepare(model, 0, nullcontext, torch.device("cpu"))
    return step, model.train()


def _run_native(step, model) -> list[dict[str, float]]:
    """STEPS optimizer steps of the trainer's DPO step: each step's figures, `loss` the step's loss."""
    from nightloom.train.sft_batch import FlopCounter

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    flops = FlopCounter(step.job.model, "none", frozen_base=False)
    out = []
    for s in range(STEPS):
        opt.zero_grad()
        local, _, figures = step.forward_backward(model, s, torch.device("cpu"), nullcontext, flops)
        opt.step()
        out.append(figures | {"loss": float(local)})  # one rank: its share is the step's loss (ORPO's NLL in it)
    return out


def _trl_batch(docs, pad: int) -> dict[str, torch.Tensor]:
    """The same pairs as TRL's DPO collator gives them: [chosen; rejected] rows of whole sequences, right-padded,
    with attention and completion masks."""
    rows = []
    for ids, labels in docs:
        k = split_pair(ids, labels)
        rows.append((ids[:k], labels[:k]))
    for ids, labels in docs:
        k = split_pair(ids, labels)
        rows.append((ids[k:], labels[k:]))
    width = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention, completion = torch.zeros_like(ids), torch.zeros_like(ids)
    for j, (a, lab) in enumerate(rows):
        ids[j, : len(a)] = torch.as_tensor(a.astype("int64"))
        attention[j, : len(a)] = 1
        completion[j, : len(a)] = torch.as_tensor(lab.astype("int64"))
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def _micro_batches(step, s: int):
    """The micro-batches of step `s` in the order the trainer's step takes them, in TRL's form."""
    first = s * MICRO * ACCUM
    pad = step.rows.tokenizer.eos_id
    return [_trl_batch(step.rows.docs(first + i * MICRO, MICRO), pad) for i in range(ACCUM)]


def _dpo_trl(setup, policy, loss_type: str):
    """TRL's DPOTrainer(loss_type) over the same micro-batches, its reference a frozen copy of the start."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(
        output_dir=str(setup.root / "trl"),
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        report_to="none",
        beta=0.1,
        loss_type=[loss_type],
        dataset_num_proc=None,
    )
    trainer = DPOTrainer(
        model=policy,
        ref_model=copy.deepcopy(policy).eval(),
        args=args,
        train_dataset=Dataset.from_list(_pairs(2)),
        processing_class=setup.hf_tok,
    )

    def micro_loss(batch):
        loss = trainer.compute_loss(policy, batch)
        m = trainer._metrics["train"]
        return loss, {k: m[k][-1] for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies")}

    return micro_loss


def _labels(batch) -> torch.Tensor:
    return batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)


def _simpo_trl(policy):
    from trl.experimental.cpo import CPOTrainer

    ns = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu")),
        loss_type="simpo",
        alpha=0.0,
        beta=0.1,
        simpo_gamma=0.5,
        label_smoothing=0.0,
    )

    def micro_loss(batch):
        logits = policy(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logps = CPOTrainer.get_batch_logps(logits, _labels(batch), average_log_prob=True)
        losses, c, r = CPOTrainer.cpo_loss(ns, *logps.chunk(2))
        return losses.mean(), _rewards(c, r)

    return micro_loss


def _orpo_trl(policy):
    from trl.experimental.orpo import ORPOTrainer

    ns = SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu")), beta=0.1)

    def micro_loss(batch):
        logits = policy(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = _labels(batch)
        logps = ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
        losses, c, r, _, _ = ORPOTrainer.odds_ratio_loss(ns, *logps.chunk(2))
        n = len(labels) // 2  # the chosen completion's NLL, averaged over its tokens (ORPOTrainer's cross_entropy)
        nll = torch.nn.functional.cross_entropy(
            logits[:n, :-1].reshape(-1, logits.shape[-1]), labels[:n, 1:].reshape(-1), ignore_index=-100
        )
        return nll - losses.mean(), _rewards(c, r)

    return micro_loss


def _rewards(c: torch.Tensor, r: torch.Tensor) -> dict[str, float]:
    return {
        "rewards/chosen": float(c.mean()),
        "rewards/rejected": float(r.mean()),
        "rewards/accuracies": float((c > r).float().mean()),
    }


def _run_trl(micro_loss, policy, step) -> list[dict[str, float]]:
    """STEPS SGD steps of TRL's loss over the trainer's micro-batches (accumulated as transformers' Trainer does:
    each micro-batch's mean loss divided by the accumulation steps)."""
    opt = torch.optim.SGD(policy.parameters(), lr=LR)
    out = []
    for s in range(STEPS):
        opt.zero_grad()
        total, figures = 0.0, {}
        for batch in _micro_batches(step, s):
            loss, got = micro_loss(batch)
            (loss / ACCUM).backward()
            total += float(loss.detach()) / ACCUM
            for k, v in got.items():
                figures[k] = figures.get(k, 0.0) + v / ACCUM
        opt.step()
        out.append({"loss": total, **figures})
    return out


CASES = [("ipo", "precomputed"), ("sigmoid", "frozen_copy"), ("simpo", "auto"), ("orpo", "auto")]


@pytest.mark.parametrize(("loss", "reference"), CASES)
def test_trainer_dpo_step_equals_trl_over_three_steps(setup, loss, reference):
    from nightloom.hf.names import to_hf

    step, model = _native(setup, loss, reference)
    assert (step.table is not None) == (reference == "precomputed")
    assert (step.reference_model is not None) == (reference == "frozen_copy")
    ours = _run_native(step, model)
    policy = copy.deepcopy(setup.hf).train()
    micro_loss = {"simpo": lambda: _simpo_trl(policy), "orpo": lambda: _orpo_trl(policy)}
    micro_loss |= {k: (lambda k=k: _dpo_trl(setup, policy, k)) for k in ("ipo", "sigmoid")}
    theirs = _run_trl(micro_loss[loss](), policy, step)
    for s, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for name in b:
            assert a[name] == pytest.approx(b[name], rel=TOL, abs=TOL), (loss, s, name)
    assert ours[-1]["loss"] < ours[0]["loss"], loss  # it trains: three steps are a real comparison
    hf_params = dict(policy.named_parameters())
    for name, p in model.named_parameters():
        assert torch.allclose(p.detach(), hf_params[to_hf(name, step.job.model)].detach(), atol=TOL, rtol=0), name


def test_frozen_copy_is_frozen_and_keeps_the_initial_weights(setup):
    """train.preference.reference frozen_copy: the copy has no trainable parameter, is a separate model (training
    the policy leaves it at model.weights), and starts equal to the policy, so step 1's DPO loss is ln 2."""
    from nightloom.hf.names import to_hf

    step, model = _native(setup, "sigmoid", "frozen_copy")
    copy_ = step.reference_model
    assert copy_ is not model and not copy_.training
    assert not any(p.requires_grad for p in copy_.parameters())
    figures = _run_native(step, model)
    assert figures[0]["loss"] == pytest.approx(0.6931471805599453, abs=1e-6)
    hf_params = dict(setup.hf.named_parameters())
    moved = 0
    for (name, p), q in zip(copy_.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, hf_params[to_hf(name, step.job.model)].detach()), name
        moved += not torch.equal(p, q)
    assert moved > 0  # the policy trained away from it
