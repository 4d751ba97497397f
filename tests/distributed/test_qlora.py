"""QLoRA on real ranks (train.lora.quantize: nf4): FSDP2 on 2 ranks trains the adapters as one process does over
3 steps; the checkpoints hold the adapters only (the base named by its fingerprint), a one-process checkpoint
resumes under FSDP2 on the uninterrupted curve, and a changed base is refused; the export's PEFT adapter, loaded by PEFT onto the base quantized by
bitsandbytes, scores held-out chats as `nightloom eval` does."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.support.chat import QWEN2, build_chat_tokenizer, chat_messages, prefix_rule_labels, write_chats
from tests.support.harness import launch, launch_many

pytest.importorskip("bitsandbytes")

SEQ = 192
GLOBAL = 8
STEPS = 3


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from nightloom.chat import ChatSettings, template_text
    from nightloom.hf.random_model import build_random_model
    from nightloom.sharding import shard_dataset
    from nightloom.spec import DatasetSpec, ShardingSpec, TokenizerSpec

    root = tmp_path_factory.mktemp("qlora")
    tok = build_chat_tokenizer(root / "tok")
    train = chat_messages(GLOBAL, seed=11)
    write_chats(root / "chats.jsonl", train)
    write_chats(root / "heldout.jsonl", chat_messages(6, seed=29))
    tspec = TokenizerSpec(path=str(tok))
    shard_dataset(
        DatasetSpec(path=str(root / "chats.jsonl")),
        ShardingSpec(output=str(root / "shards"), num_shards=2, tolerance=0.9),
        tokenizer=tspec,
        chat=ChatSettings(template=template_text(tok), seq_len=SEQ),
    )
    weights = build_random_model(root / "qwen2", "qwen2", seed=5, **QWEN2)  # widths bitsandbytes' CPU kernel takes
    return root, tspec, weights


def _job(run_dir, data, weights=None, stop_after=None, checkpoint_every=0, export="none", **plan):
    from nightloom.hf.config import shape_from_hf_config
    from nightloom.parallel import ParallelPlan
    from nightloom.spec import LoraSpec, TrainSpec
    from nightloom.train.job import TrainJob

    root, tspec, base = data
    weights = weights or base
    run_dir.mkdir(parents=True, exist_ok=True)
    job = TrainJob(
        run_id=run_dir.name,
        run_dir=str(run_dir),
        model=shape_from_hf_config(weights / "config.json"),
        plan=ParallelPlan(**plan),
        train=TrainSpec(
            task="sft",
            steps=STEPS,
            seq_len=SEQ,
            global_batch=GLOBAL,
            lr=2e-2,
            warmup_steps=0,
            collective_timeout_s=60,
            checkpoint_every=checkpoint_every,
            lora=LoraSpec(rank=4, alpha=8.0, quantize="nf4"),
            export=export,
        ),
        manifest=str(root / "shards"),
        peak_flops=50e9,
        peak_source="test constant",
        weights=str(weights),
        hf_config=str(weights / "config.json"),
        tokenizer=tspec,
        tokenizer_dir=str(root / "tok"),
        stop_after_steps=stop_after,
    )
    p = run_dir / "job.json"
    p.write_text(job.model_dump_json(indent=2), encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def single(data, tmp_path_factory):
    job = _job(
        tmp_path_factory.mktemp("run") / "single", data, export="hf", checkpoint_every=2, micro_batch=2, grad_accum=4
    )
    return job, launch(1, job, timeout=240)


def _stopped_at_step_2(single, run_dir):
    """A copy of the one-process run as it stood after its step-2 checkpoint."""
    job, _ = single
    shutil.copytree(job.parent / "checkpoints", run_dir / "checkpoints")
    shutil.rmtree(run_dir / "checkpoints" / "step-3")
    (run_dir / "checkpoints" / "latest").write_text("step-2\n")
    return run_dir


@pytest.fixture(scope="module")
def two_ranks(data, single, tmp_path_factory):
    """In one 2-rank launch: FSDP2 from the start, and FSDP2 resuming the one-process run's step-2 checkpoint."""
    root = tmp_path_factory.mktemp("two")
    resume = _stopped_at_step_2(single, root / "resume")
    jobs = {
        "fsdp2": _job(root / "fsdp2", data, dp_shard=2, micro_batch=2, grad_accum=2),
        "resume": _job(resume, data, dp_shard=2, micro_batch=2, grad_accum=2),
    }
    runs = launch_many(2, list(jobs.values()), timeout=300)
    return {name: runs[job] for name, job in jobs.items()}


def test_fsdp2_on_two_ranks_equals_one_process(single, two_ranks):
    _, ref = single
    out = two_ranks["fsdp2"]
    assert len(out.losses) == len(ref.losses) == STEPS, out.output[-4000:]
    assert ref.losses[-1] < ref.losses[0], ref.losses
    for a, b in zip(out.metrics, ref.metrics):
        assert abs(a.loss - b.loss) < 1e-5, (a.step, a.loss, b.loss)
        assert abs(a.grad_norm - b.grad_norm) < 1e-4 * max(1.0, b.grad_norm), (a.step, a.grad_norm, b.grad_norm)


def test_checkpoints_hold_the_adapters_only_and_resume_on_the_curve(single, two_ranks):
    import torch.distributed.checkpoint as dcp

    from nightloom.train.checkpoint import latest, read_meta

    job, ref = single
    path, _ = latest(job.parent / "checkpoints")
    keys = [k for k in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata if k.startswith("model.")]
    assert keys and all(".lora_" in k for k in keys), keys  # no base tensor, quantized or not
    meta = read_meta(path)
    assert meta["adapters_only"] is True and len(meta["base"]) == 32
    assert json.loads((job.parent / "result.json").read_text())["checkpoint_bytes"] > 0
    out = two_ranks["resume"]  # the one-process checkpoint of step 2, resumed by 2 FSDP2 ranks
    assert "resumed from" in out.output and [m.step for m in out.metrics] == [3], out.output[-3000:]
    assert abs(out.metrics[0].loss - ref.metrics[2].loss) < 1e-5, (out.metrics[0].loss, ref.metrics[2].loss)


def test_a_changed_base_is_refused_on_resume(data, single, tmp_path):
    from safetensors.torch import load_file, save_file

    _, _, weights = data
    run_dir = _stopped_at_step_2(single, tmp_path / "run")
    other = tmp_path / "other-base"
    shutil.copytree(weights, other)
    tensors = load_file(str(other / "model.safetensors"))
    name = next(k for k in tensors if k.endswith("mlp.down_proj.weight"))
    tensors[name] = tensors[name] * 1.01  # same names and shapes, other values
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    out = launch(1, _job(run_dir, data, weights=other, micro_batch=2, grad_accum=4), timeout=240, check=False)
    assert out.rc != 0 and "its adapters were trained on base" in out.output, out.output[-3000:]


def test_exported_adapter_on_the_4bit_base_scores_as_nightloom_eval(data, single):
    import torch
    import torch.nn.functional as F
    import transformers
    from peft import PeftModel

    from nightloom.train.evaluate import evaluate_run

    root, _, weights = data
    job, _ = single
    adapter = job.parent / "export" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(weights.resolve())
    bnb = transformers.BitsAndBytesConfig.from_dict(json.loads((adapter / "quantization_config.json").read_text()))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(weights), quantization_config=bnb, dtype=torch.float32)
    # train mode (dropout is 0): in eval mode bitsandbytes repacks CPU weights for its bf16 inference kernel
    model = PeftModel.from_pretrained(base, str(adapter)).train()
    tok = transformers.AutoTokenizer.from_pretrained(str(root / "tok"))
    total, count = 0.0, 0
    for line in (root / "heldout.jsonl").read_text().splitlines():
        ids, labels = prefix_rule_labels(tok, json.loads(line)["messages"])
        mask = torch.tensor(labels[1:], dtype=torch.bool)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        total += float(F.cross_entropy(logits[mask], torch.tensor(ids[1:])[mask], reduction="sum"))
        count += int(mask.sum())
    ours = evaluate_run(job.parent, root / "heldout.jsonl", SEQ)
    assert ours.tokens == count and abs(ours.loss - total / count) < 1e-3, (ours, total / count, count)
