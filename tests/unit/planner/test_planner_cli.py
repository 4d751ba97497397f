"""`nightloom plan` subcommand: JSON keys, exit codes, pinned layouts, specs, bad input."""

from __future__ import annotations

import argparse
import json

from flows.commands import plan as plan_cmd

KEYS = {
    "tp",
    "pp",
    "dp_replicate",
    "dp_shard",
    "sp",
    "micro_batch",
    "recompute",
    "memory_gib_per_gpu",
    "fits",
    "tflops_per_gpu_model",
    "tflops_per_gpu_hardware",
    "mfu",
    "hfu",
    "tokens_per_s",
}


def _run(capsys, *argv):
    parser = argparse.ArgumentParser(prog="nightloom")
    plan_cmd.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


BASE = [
    "--model",
    "llama2-70b",
    "--gpu",
    "a800-80gb",
    "--nodes",
    "8",
    "--gpus-per-node",
    "4",
    "--seq-len",
    "4096",
    "--global-batch",
    "32",
]


def test_search_json(capsys):
    rc, out, _ = _run(capsys, *BASE, "--json")
    d = json.loads(out)
    assert rc == 0 and KEYS <= set(d["chosen"]) and d["chosen"]["fits"] is True
    assert all(set(x) == {"layout", "reason"} for x in d["rejected"]) and d["rejected"]
    assert d["considered"] > d["pruned"] > 0


def test_layout_json_is_evaluated(capsys):
    rc, out, _ = _run(capsys, *BASE, "--layout", "tp=4,pp=1,dp=8", "--recompute", "full", "--json")
    d = json.loads(out)
    assert rc == 0 and "evaluated" in d and "chosen" not in d
    e = d["evaluated"]
    assert (e["tp"], e["pp"], e["dp_replicate"] * e["dp_shard"], e["recompute"]) == (4, 1, 8, "full")


def test_replicated_layout_does_not_fit_exit_1(capsys):
    rc, out, err = _run(capsys, *BASE, "--layout", "tp=4,pp=2,dp=4,zero=none")
    assert rc == 1 and "no layout fits: the smallest needs" in err and "GiB per GPU" in err
    assert "TP4·PP2·DP4" in out


def test_model_too_big_exit_1_names_min_memory(capsys):
    rc, out, err = _run(
        capsys,
        "--model",
        "llama3-405b",
        "--gpu",
        "a100-40gb",
        "--nodes",
        "1",
        "--gpus-per-node",
        "8",
        "--seq-len",
        "4096",
        "--global-batch",
        "8",
        "--json",
    )
    d = json.loads(out)
    assert rc == 1 and d["fits"] is False and d["min_memory_gib"] > 40
    assert f"{d['min_memory_gib']:.1f} GiB" in err


def test_bad_inputs_exit_2(capsys, tmp_path):
    rc, _, err = _run(capsys, "--model", "llama2-70b", "--gpu", "a800-80gb")
    assert rc == 2 and "missing: --nodes --gpus-per-node --seq-len --global-batch" in err
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 1000,
                "num_hidden_layers": 2,
                "num_attention_heads": 3,
                "intermediate_size": 10,
                "vocab_size": 10,
                "max_position_embeddings": 8,
            }
        )
    )
    rc, _, err = _run(capsys, "--model", str(cfg), *BASE[2:])
    assert rc == 2 and "hidden (1000) is not divisible by heads (3)" in err and "config.json" in err
    rc, _, err = _run(capsys, *BASE, "--layout", "tp=four")
    assert rc == 2 and "tp='four' is not an integer" in err
    rc, _, err = _run(capsys, *BASE[:2], "--gpu", "tpu", *BASE[4:])
    assert rc == 2 and "unknown GPU type 'tpu'" in err


def test_spec_on_cpu_pretty(capsys, tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text(
        "name: demo\ndataset: {path: data.jsonl, sample: true}\nmodel: {name: tiny}\n"
        "cluster: {nodes: 2, gpus_per_node: 2, gpu_type: cpu}\ntrain: {seq_len: 128, global_batch: 8}\n"
    )
    rc, out, _ = _run(capsys, str(spec))
    assert rc == 0 and "TP1·PP1·DP4" in out and "not predicted" in out
    spec.write_text("name: demo\ndataset: {path: data.jsonl, sample: true}\nmodel: {name: nope}\n")
    rc, _, err = _run(capsys, str(spec))
    assert rc == 1 and "model.name: unknown model 'nope'" in err  # a spec that does not validate: 1, as `validate`


TIED = ["--model", "llama3-8b", "--gpu", "h100-80gb", "--nodes", "2", "--gpus-per-node", "8"]


def test_a_layout_as_fast_as_the_chosen_is_not_called_slower(capsys):
    """FSDP16 and ZeRO2-16 run llama3-8b equally fast: ZeRO2 lost on memory, not 'slower by 0.0%' (one sequence
    per rank: no accumulated gradients, planner/memory.py ACCUM_GRAD_BYTES)."""
    rc, out, _ = _run(capsys, *TIED, "--seq-len", "8192", "--global-batch", "16", "--json")
    d = json.loads(out)
    reasons = {r["layout"]: r["reason"] for r in d["rejected"]}
    assert rc == 0 and d["chosen"]["layout"] == "TP1·PP1·FSDP16"
    assert reasons["TP1·PP1·ZeRO2-16"].startswith("as fast, more memory: 59.8 vs 45.7 GiB per GPU")
    assert not any(r.startswith("slower by 0.0%") for r in reasons.values())
    assert any("is as fast, more memory" in line for line in d["chosen"]["explanation"])
    first = [r["reason"].split(" ")[0] for r in d["rejected"]][:2]
    assert first == ["as", "slower"]  # the ties first, then the slower, then those that do not fit


def test_the_plan_table_prints_percent_and_thousands(capsys):
    rc, out, _ = _run(capsys, *TIED, "--seq-len", "8192", "--global-batch", "16")
    chosen = next(line for line in out.splitlines() if "chosen" in line)
    assert rc == 0 and "56.6%" in chosen and "163,472" in chosen, chosen
    assert "0.566" not in chosen and "163472" not in chosen


def test_expert_storage_says_what_one_gpu_holds(capsys):
    """DeepSeek-V3: '326.95B expert params per GPU, their states sharded over 256 more ranks' read as one GPU
    holding 327B; it is the experts a rank computes (ep=4 pinned: 64 of them), of which each GPU stores 1/128."""
    rc, out, _ = _run(
        capsys, "--model", "deepseek-v3", "--gpu", "h100-80gb", "--nodes", "64", "--gpus-per-node", "8",
        "--seq-len", "4096", "--global-batch", "2048", "--layout", "ep=4", "--json",
    )  # fmt: skip
    line = next(x for x in json.loads(out)["evaluated"]["explanation"] if x.startswith("expert parallel"))
    assert "expert params per GPU" not in line and "more ranks" not in line, line
    assert "each rank computes 64 of 256 experts (163.48B expert params, sharded" in line
    assert "over the 128 ranks that compute the same experts: 1.28B stored per GPU" in line
