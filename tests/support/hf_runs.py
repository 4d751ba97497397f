"""What the family run-level tests share: a corpus and eval documents from the sample, a BPE tokenizer folder, a
continued-pretraining spec over a Hugging Face folder, the CLI in-process, and transformers' mean NLL as reference.

The shape of each test: `nightloom run` (2 steps at a negligible learning rate), then `nightloom eval RUN --data
eval.jsonl --seq-len 256 --json` must equal transformers' NLL of the original checkpoint, and of the run's export
(run_then_eval_equals_transformers does all of it for one checkpoint).

Also what the layout parity tests over Hugging Face weights share (tests/distributed/test_*_parity.py): their model
dimensions, their job files (hf_job), the final parameters of a run, and the comparison of a layout with one process.
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from tests.support.harness import free_port, make_job

ROOT = Path(__file__).resolve().parents[2]
SEQ = 256  # scored prefix of each eval document
TOL = 1e-4
#: the dense family tests' model (Qwen3 and Gemma 3, run-level and layout parity): 4 layers of width 64, 4 query heads
#: over 2 key/value heads of head_dim 24 (!= 64 / 4), a vocabulary of 320 (>= the BPE's 300 ids); a test adds its
#: family's keys and may change a value (the parity tests: an odd vocabulary, shorter positions)
SMALL_DENSE = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "rope_theta": 1e6,
}


@dataclass(frozen=True)
class EvalData:
    """A 400-line training corpus, the eval documents (6 longer than SEQ ids, 6 ordinary, 2 short) and their file."""

    corpus: Path
    eval_data: Path
    docs: list[str]


def eval_data(folder: Path, tag: str) -> EvalData:
    lines = (ROOT / "datasets" / "sample" / "corpus.jsonl").read_text(encoding="utf-8").splitlines()
    corpus = folder / "corpus.jsonl"
    corpus.write_text("\n".join(lines[:400]) + "\n", encoding="utf-8")
    longer = [t for t in (json.loads(line)["text"] for line in lines[400:]) if len(t) > 1500]  # past SEQ ids
    docs = longer[:6] + [json.loads(line)["text"] for line in lines[400:406]] + ["x", tag]
    path = folder / "eval.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return EvalData(corpus, path, docs)


def bpe_tokenizer(folder: Path, corpus: Path) -> Path:
    """A 300-id BPE tokenizer folder trained on the corpus (tokenizer.json + tokenizer_config.json)."""
    from nightloom.spec import DatasetSpec, TokenizerSpec
    from nightloom.tokenizer import ensure_trained

    path = folder / "tokenizer"
    assert ensure_trained(TokenizerSpec(path=str(path), train_vocab=300), DatasetSpec(path=str(corpus)))
    return path


def transformers_nll(model_dir: Path, tokenizer_dir: Path, docs: list[str]) -> tuple[float, int]:
    """Mean NLL per predicted token of each document's first SEQ ids (AutoTokenizer's, no EOS), and their count."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    total, count = 0.0, 0
    for d in docs:
        ids = tok(d)["input_ids"][:SEQ]
        if len(ids) < 2:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        total += float(F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").double())
        count += len(ids) - 1
    return total / count, count


def cli(args: list[str]) -> tuple[int, str]:
    """`nightloom ARGS` in this process: (exit code, stdout)."""
    from flows.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(args)
    return rc, buf.getvalue()


def continue_pretrain_spec(
    folder: Path, weights: Path, tokenizer: Path, corpus: Path, shards: Path, tag: str = "", **overrides
) -> Path:
    """The continue-pretrain demo over `weights`: 2 shards, 2 steps of 128 tokens at lr 1e-9 (the loss is not meant
    to fall), its own runs folder and ledger; `overrides` set top-level sections (e.g. parallel, cluster keys)."""
    data = yaml.safe_load((ROOT / "deployments" / "continue-pretrain-demo.yaml").read_text())
    data["model"] = {"weights": str(weights), "tokenizer": str(tokenizer)}
    data["dataset"] = {"path": str(corpus), "text_field": "text"}
    data["sharding"] = {"num_shards": 2, "output": str(shards)}
    data["storage"]["root"] = str(folder / f"runs{tag}")
    data["ledger"]["url"] = f"sqlite:///{folder / f'ledger{tag}.db'}"
    data["train"].update({"steps": 2, "seq_len": 128, "lr": 1e-9, "warmup_steps": 0, "checkpoint_every": 0})
    data["validate"] = {"min_loss_drop": 0.0}
    # a rendezvous port of its own: runs in the other test lane may hold the default 29500
    data["cluster"] = {**data.get("cluster", {}), "master_port": free_port()}
    for key, value in overrides.items():
        data[key] = {**data[key], **value} if isinstance(data.get(key), dict) else value
    spec = folder / f"spec{tag}.yaml"
    spec.write_text(yaml.safe_dump(data))
    return spec


def run_two_steps(spec: Path) -> dict:
    """`nightloom run SPEC --json`, which must complete its 2 steps: the run summary."""
    rc, out = cli(["run", str(spec), "--json"])
    assert rc == 0, out[-3000:]
    summary = json.loads(out[out.index("{") :])
    assert summary["status"] == "completed" and summary["steps"] == 2, summary
    return summary


def nightloom_eval(run_dir: Path, data: Path) -> dict:
    """`nightloom eval RUN --data DATA --seq-len SEQ --json`."""
    rc, out = cli(["eval", str(run_dir), "--data", str(data), "--seq-len", str(SEQ), "--json"])
    assert rc == 0, out
    return json.loads(out)


@dataclass(frozen=True)
class EvalRun:
    """What a run-level test may still check once run_then_eval_equals_transformers passed: the run folder and its
    export's config.json."""

    run_dir: Path
    export_config: dict


def run_then_eval_equals_transformers(
    folder: Path, arch: str, config: dict, *, tag: str, architecture: str, label: str, **spec_overrides
) -> EvalRun:
    """The run-level test (module docstring) over a random `arch` checkpoint with `config` (seed 11, norm weights not
    all 1): eval documents ending in `tag`, a BPE tokenizer, `nightloom run` of the continue-pretrain spec
    (`spec_overrides`: e.g. parallel, cluster), then `nightloom eval` of the run equals transformers' NLL of the
    checkpoint within TOL over more than 6 full prefixes, and so does transformers' NLL of the run's export, whose
    config names `architecture`. `label` starts the printed figures."""
    from nightloom.hf.random_model import build_random_model

    data = eval_data(folder, tag)
    tokenizer = bpe_tokenizer(folder, data.corpus)
    weights = build_random_model(folder / arch, arch, seed=11, max_shard_size="200KB", norm_std=0.3, **config)
    spec = continue_pretrain_spec(folder, weights, tokenizer, data.corpus, folder / "shards", **spec_overrides)

    summary = run_two_steps(spec)
    run_dir = Path(summary["run_dir"])
    ours = nightloom_eval(run_dir, data.eval_data)
    ref, tokens = transformers_nll(weights, tokenizer, data.docs)
    print(f"{label} run: nightloom eval {ours['loss']:.8f}, transformers {ref:.8f} ({tokens} tokens)")
    assert ours["step"] == 2 and ours["tokens"] == tokens and tokens > 6 * (SEQ - 1)
    assert abs(ours["loss"] - ref) < TOL, (ours["loss"], ref)
    # the run's export: transformers reloads it (the family's own class) and scores it the same
    export = Path(summary["export_dir"])
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["architectures"] == [architecture], cfg["architectures"]
    exported, _ = transformers_nll(export, export, data.docs)
    print(f"{label} export: transformers {exported:.8f}")
    assert abs(exported - ref) < TOL, (exported, ref)
    return EvalRun(run_dir, cfg)


#: a small deepseek_v3 (over a 64-wide base): latent attention with a low-rank query, 2 expert groups of 4, a shared
#: expert beside the routed ones, a dense first layer, and a random expert-choice bias (build_random_model's
#: bias_std), so a bias not loaded or not kept shows
SMALL_DEEPSEEK_V3 = {
    "num_key_value_heads": 4,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "q_lora_rank": 32,
    "kv_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.0,
    "bias_std": 0.1,
}


#: the layout parity runs' training: SGD at lr 0.5, so a final parameter is the sum of its gradients and the
#: per-parameter check is a check of every gradient (under AdamW, g / (sqrt(v) + eps) turns last-bit differences of
#: near-zero gradients into visible steps), and the plain loss in every layout (loss_chunk_tokens 0: the chunked one,
#: the default where the head is whole, has its own parity test in tests/distributed/test_efficiency.py)
SGD_PLAIN_LOSS = {"lr": 0.5, "optimizer": "sgd", "loss_chunk_tokens": 0}


def hf_job(run_dir: Path, source: Path, corpus: Path, plan: dict, **train) -> Path:
    """`<run_dir>/job.json` of a layout parity run: the Hugging Face folder `source` (its shape, its weights) trained
    on the corpus manifest in fp32, seed 1234, one warmup step and TrainSpec's own collective timeout; `plan` holds
    ParallelPlan fields, `train` the rest of the TrainSpec (steps, seq_len, global_batch, lr, ...)."""
    from nightloom.spec import TrainSpec

    timeout = TrainSpec.model_fields["collective_timeout_s"].default
    train = {"warmup_steps": 1, "precision": "fp32", **train}
    return make_job(run_dir, corpus, hf=source, timeout_s=timeout, train_kw=train, **plan)


def hf_first_batch_loss(source: Path, corpus: Path, seq: int, batch: int) -> float:
    """transformers' mean loss on the trainer's first global batch (PackedWindows at seed 1234): step 1's loss."""
    import transformers

    from nightloom.train.data import PackedWindows

    seqs = PackedWindows(str(corpus), seq, seed=1234).windows(0, batch)
    hf = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(seqs[:, :-1]).logits
    return float(F.cross_entropy(logits.flatten(0, 1), seqs[:, 1:].flatten()))


def final_checkpoint_params(run_dir: Path, vocab: int) -> dict[str, torch.Tensor]:
    """The last checkpoint's model tensors, gathered without a process group (TP-padded vocabulary rows cut)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    dcp_to_torch_save(run_dir / "checkpoints" / latest, run_dir / "final.pt")
    state = torch.load(run_dir / "final.pt", weights_only=True)["model"]
    return {k: v[:vocab] if k in ("tok_embeddings.weight", "output.weight") else v for k, v in state.items()}


@dataclass(frozen=True)
class Tolerances:
    """How close a parallel layout must come to one process: per-step loss, relative grad norm, final parameters."""

    loss: float
    grad_norm_rel: float
    param: float


def assert_layout_matches_one_process(
    tag: str, job: Path, out, ref_job: Path, ref, *, vocab: int, param_marker: str, source: Path, corpus: Path,
    seq: int, batch: int, steps: int, tol: Tolerances,
) -> None:  # fmt: skip
    """A layout's run (`out`, of `job`) against the one-process run of the same job (`ref`): every step's loss and grad
    norm, the final parameters (among them one whose name holds `param_marker`), step 1's loss against transformers
    on the same batch, and an export transformers loads with no missing or unexpected tensor."""
    import transformers

    assert len(ref.losses) == steps, ref.output[-4000:]
    assert len(out.losses) == steps, out.output[-4000:]
    assert "[nightloom.train] loaded " in out.output
    loss_diff = max(abs(a - b) for a, b in zip(out.losses, ref.losses))
    norm_rel = max(abs(a.grad_norm - b.grad_norm) / b.grad_norm for a, b in zip(out.metrics, ref.metrics))
    print(f"{tag}: max |loss - 1 process| {loss_diff:.2e}, max rel |grad_norm - 1 process| {norm_rel:.2e}")
    assert loss_diff <= tol.loss, (out.losses, ref.losses)
    assert norm_rel <= tol.grad_norm_rel, ([m.grad_norm for m in out.metrics], [m.grad_norm for m in ref.metrics])
    a, b = final_checkpoint_params(job.parent, vocab), final_checkpoint_params(ref_job.parent, vocab)
    assert sorted(a) == sorted(b) and any(param_marker in k for k in a)
    worst, where = max((float((a[k] - b[k]).abs().max()), k) for k in b)
    print(f"{tag}: max |param - 1 process| {worst:.2e} ({where})")
    assert worst <= tol.param, worst
    hf_loss = hf_first_batch_loss(source, corpus, seq, batch)
    assert abs(out.losses[0] - hf_loss) < tol.loss, (out.losses[0], hf_loss)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(job.parent / "export", output_loading_info=True)
    assert all(not v for v in info.values()), info
