"""Test data for the XTuner backend: alpaca-style Parquet shards plus a ShardManifest, and run specs."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from nightloom.sharding.manifest import ShardInfo, ShardManifest
from nightloom.spec import RunSpec

WORDS = [
    "what",
    "is",
    "the",
    "sum",
    "of",
    "a",
    "small",
    "list",
    "name",
    "city",
    "color",
    "number",
    "fast",
    "slow",
    "model",
    "data",
    "answer",
    "why",
]


def alpaca_rows(n: int = 48, nooutput: bool = False) -> list[dict]:
    rows = []
    for i in range(n):
        q = " ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(4))
        a = " ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(5)) + f" {i % 10}"
        rows.append({"instruction": q, "input": "" if i % 3 else f"x{i}", "output": "<nooutput>" if nooutput else a})
    return rows


def write_shards(out: Path, rows: list[dict], num_shards: int = 2, columns: list[str] | None = None) -> Path:
    """Parquet shards and manifest.json (written last), the layout nightloom.sharding produces."""
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    for s in range(num_shards):
        part = rows[s::num_shards]
        cols = columns or list(part[0])
        table = pa.table({c: [r[c] for r in part] for c in cols})
        rel = f"shard-{s:05d}.parquet"
        pq.write_table(table, out / rel)
        data = (out / rel).read_bytes()
        tokens = sum(len(str(v).encode()) for r in part for v in r.values())
        shards.append(
            ShardInfo(
                index=s,
                path=rel,
                rows=len(part),
                tokens=tokens,
                bytes=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
            )
        )
    m = ShardManifest(
        num_shards=num_shards,
        key="<text>",
        salt="t",
        imbalance=0.0,
        imbalance_before_rebalance=0.0,
        balanced=True,
        rows=len(rows),
        tokens=sum(s.tokens for s in shards),
        bytes=sum(s.bytes for s in shards),
        shards=shards,
    )
    (out / "manifest.json").write_text(m.to_json(), encoding="utf-8")
    return out


def make_spec(
    tmp: Path,
    base_model: Path,
    shards: Path,
    *,
    method: str = "lora",
    steps: int = 4,
    ranks: int = 1,
    global_batch: int = 2,
    checkpoint_every: int = 2,
    map_fn: str = "alpaca",
    template: str = "default",
    seq_len: int = 128,
    merge_lora: bool = True,
    micro_batch: int | None = None,
) -> RunSpec:
    return RunSpec.model_validate(
        {
            "name": "xt-test",
            "dataset": {"path": str(shards)},
            "sharding": {"output": str(shards)},
            "cluster": {"provider": "local", "nodes": 1, "gpus_per_node": ranks, "gpu_type": "cpu"},
            "train": {
                "backend": "xtuner",
                "steps": steps,
                "seq_len": seq_len,
                "global_batch": global_batch,
                "lr": 1e-3,
                "warmup_steps": 1,
                "checkpoint_every": checkpoint_every,
                "collective_timeout_s": 60,
                "xtuner": {
                    "method": method,
                    "base_model": str(base_model),
                    "map_fn": map_fn,
                    "template": template,
                    "merge_lora": merge_lora,
                    "micro_batch": micro_batch,
                },
            },
            "storage": {"root": str(tmp / "runs")},
        }
    )


def run_in_env(env, code: str, timeout: float = 300) -> str:
    """Run Python `code` in the XTuner env; return stdout (assert success)."""
    r = subprocess.run([str(env.python), "-c", code], capture_output=True, text=True, timeout=timeout, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def merged_vs_peft(env, base_model: Path, adapter_dir: str, model_dir: str) -> dict:
    """Max logit differences of the merged model against base ⊕ adapter merged by PEFT in memory (fp16 as
    xtuner's merge tool does, and fp32) and against the base itself."""
    out = run_in_env(
        env,
        f"""
import torch, json
from transformers import AutoModelForCausalLM, AutoTokenizer
from peft import PeftModel
tok = AutoTokenizer.from_pretrained({str(model_dir)!r})
ids = tok("what is the sum of a list", return_tensors="pt").input_ids
def logits(dtype, adapter):
    m = AutoModelForCausalLM.from_pretrained({str(base_model)!r}, torch_dtype=dtype)
    if adapter:
        m = PeftModel.from_pretrained(m, {str(adapter_dir)!r}).merge_and_unload()
    return m.float().eval()(ids).logits
with torch.no_grad():
    lb = logits(torch.float32, False)
    lp32 = logits(torch.float32, True)
    lp16 = logits(torch.float16, True)
    lm = AutoModelForCausalLM.from_pretrained({str(model_dir)!r}, torch_dtype=torch.float32).eval()(ids).logits
d = lambda a, b: (a - b).abs().max().item()
print(json.dumps({{"vs_peft16": d(lm, lp16), "vs_peft32": d(lm, lp32), "vs_base": d(lm, lb)}}))
""",
    )
    return json.loads(out.strip().splitlines()[-1])
