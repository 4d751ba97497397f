"""The benchmark stage's pure parts: lm-eval's results dict read into Score records, base and tuned paired, each
gate bound judged (and named when it cannot be), the demos' task built from rendered ChatML, the completions
table and the base's cache key."""

from __future__ import annotations

import json

import pytest

from nightloom.benchmarks.compare import check_benchmarks, completion_rows, figures, rows, table_rows
from nightloom.benchmarks.demo_task import chatml_pairs, demo_docs, ensure_demo_task
from nightloom.benchmarks.harness import scores_from_results
from nightloom.benchmarks.launch import base_key, make_job
from nightloom.benchmarks.records import BenchResult, Completion, ModelScores, Score
from nightloom.benchmarks.stage import markdown_table
from nightloom.spec.benchmarks import BenchmarksSpec

RESULTS = {
    "results": {
        "mc": {"alias": "mc", "name": "mc", "sample_len": 9, "acc,none": 0.5, "acc_stderr,none": 0.1},
        "gsm": {"exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": "N/A", "alias": "gsm"},
    },
    "n-samples": {"mc": {"original": 20, "effective": 9}, "gsm": {"original": 4, "effective": 4}},
}


def test_results_become_scores():
    got = scores_from_results(RESULTS)
    assert got == [
        Score(task="gsm", metric="exact_match,strict-match", value=0.25, stderr=None, samples=4),
        Score(task="mc", metric="acc", value=0.5, stderr=0.1, samples=9),
    ]


def _result(tuned: float, base: float | None) -> BenchResult:
    t = ModelScores(model_dir="t", scores=[Score(task="mc", metric="acc", value=tuned, stderr=0.05)])
    b = ModelScores(model_dir="b", scores=[Score(task="mc", metric="acc", value=base)]) if base is not None else None
    return BenchResult(tuned=t, base=b)


@pytest.mark.parametrize(
    ("gate", "tuned", "base", "passed", "words"),
    [
        ({"min": 0.6}, 0.5, 0.4, False, "mc acc 0.5000 < floor 0.6"),
        ({"min": 0.5}, 0.5, 0.4, True, "mc acc 0.5000 >= floor 0.5"),
        ({"min_gain": 0.05}, 0.5, 0.4, True, "gain +0.1000 >= 0.05"),
        ({"min_gain": 0.2}, 0.5, 0.4, False, "gain +0.1000 < 0.2"),
        ({"max_drop": 0.05}, 0.3, 0.4, False, "base 0.4000 -> tuned 0.3000, drop 0.1000 > 0.05"),
        ({"max_drop": 0.05}, 0.38, 0.4, True, "drop 0.0200 <= 0.05"),
        ({"max_drop": 0.05}, 0.5, None, False, "no base score to compare"),
    ],
)
def test_each_gate_bound(gate, tuned, base, passed, words):
    settings = BenchmarksSpec(tasks=["mc"], gates=[{"task": "mc", "metric": "acc", **gate}])
    [v] = check_benchmarks(settings, rows(_result(tuned, base)))
    assert v.passed is passed and words in v.reason, v
    assert v.label == ("pass" if passed else "FAIL")


def test_a_missing_metric_fails_and_no_gate_is_a_skip():
    settings = BenchmarksSpec(tasks=["mc"], gates=[{"task": "mc", "metric": "acc_norm", "min": 0.1}])
    [v] = check_benchmarks(settings, rows(_result(0.5, 0.4)))
    assert not v.passed and "no 'acc_norm' for task 'mc'" in v.reason
    [skip] = check_benchmarks(BenchmarksSpec(tasks=["mc"]), rows(_result(0.5, 0.4)))
    assert skip.passed and skip.skipped and skip.label == "SKIP"


def test_figures_and_table_rows_pair_base_and_tuned():
    table = rows(_result(0.5, 0.4))
    [f] = figures(table)
    assert (f.name, f.value, f.base, f.stderr) == ("bench/mc/acc", 0.5, 0.4, 0.05)
    assert table_rows(table) == [
        {"task": "mc", "metric": "acc", "base": "0.4000", "tuned": "0.5000", "diff": "+0.1000", "stderr": "0.0500"}
    ]


def test_demo_task_from_chatml(tmp_path):
    texts = [
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nWhat is x?<|im_end|>\n"
        "<|im_start|>assistant\nThe value of x here.<|im_end|>\n",
        "<|im_start|>user\nAnd y?<|im_end|>\n<|im_start|>assistant\nNo<|im_end|>\n",  # one word: no shuffles
        "plain text, no turns",
    ]
    assert chatml_pairs(texts) == [("What is x?", "The value of x here."), ("And y?", "No")]
    [doc] = demo_docs(chatml_pairs(texts))
    assert doc["choices"][doc["gold"]] == "The value of x here." and len(set(doc["choices"])) == 4
    assert all(sorted(c.split()) == sorted(doc["choices"][doc["gold"]].split()) for c in doc["choices"])
    assert ensure_demo_task(tmp_path, "t", texts) == 1 and ensure_demo_task(tmp_path, "t", texts) is None
    assert json.loads((tmp_path / "t.jsonl").read_text()) == doc
    with pytest.raises(ValueError, match="no held-out ChatML conversation"):
        ensure_demo_task(tmp_path / "empty", "t", ["plain"])


def test_completions_side_by_side_and_markdown():
    r = _result(0.5, 0.4)
    r.tuned.completions = [Completion(prompt="p|q", text="tuned\nline")]
    r.base.completions = [Completion(prompt="p|q", text="base")]
    sides = completion_rows(r)
    assert sides == [{"prompt": "p|q", "base": "base", "tuned": "tuned\nline"}]
    assert markdown_table(sides).splitlines()[2] == "| p\\|q | base | tuned line |"


def test_the_base_cache_key_follows_weights_tokenizer_tasks_and_settings(tmp_path):
    base, tok, tasks = tmp_path / "base", tmp_path / "export", tmp_path / "tasks"
    for d in (base, tok, tasks):
        d.mkdir()
    (base / "model.safetensors").write_bytes(b"w1")
    (tok / "tokenizer.json").write_text("{}")
    (tok / "model.safetensors").write_bytes(b"tuned weights change every run")
    (tasks / "t.yaml").write_text("task: t")
    settings = BenchmarksSpec(tasks=["t"], include_path=str(tasks))
    key = base_key(str(base), make_job(settings, str(tok), [], tmp_path / "o.json"))
    (tok / "model.safetensors").write_bytes(b"another run's export")
    assert base_key(str(base), make_job(settings, str(tok), [], tmp_path / "x.json")) == key  # not the export's weights
    changes = [
        lambda: (base / "model.safetensors").write_bytes(b"w2"),
        lambda: (tok / "tokenizer.json").write_text('{"a": 1}'),
        lambda: (tasks / "t.jsonl").write_text("{}"),
    ]
    for change in changes:
        change()
        assert base_key(str(base), make_job(settings, str(tok), [], tmp_path / "o.json")) != key
        key = base_key(str(base), make_job(settings, str(tok), [], tmp_path / "o.json"))
    other = settings.model_copy(update={"num_fewshot": 3})
    assert base_key(str(base), make_job(other, str(tok), [], tmp_path / "o.json")) != key


def test_summary_artifact_and_notebook_show_base_and_tuned():
    from nightloom.report import RunSummary, summary_rows

    s = RunSummary(
        run_id="r", name="n", status="completed", shard_imbalance=0.0, figures=figures(rows(_result(0.5, 0.4)))
    )
    text = "base 0.4000 -> 0.5000 (+0.1000, stderr 0.0500)"
    assert s.figure_rows() == [("bench/mc/acc", text)]
    assert {"field": "bench/mc/acc", "value": text} in summary_rows(s, [], 0.0, 0.0, "USD", [])
    assert "bench/mc/acc" in s._repr_html_() and text.replace(">", "&gt;") in s._repr_html_()


def test_the_engine_spreads_a_model_too_big_for_one_gpu_or_runs_it_on_vllm():
    from nightloom.benchmarks.engine import EngineError, choose_engine

    gib, h100 = 1 << 30, 80 << 30
    cpu = choose_engine("auto", 3 * gib, [], 32, vllm_installed=True)
    assert (cpu.backend, cpu.device, cpu.dtype) == ("hf", "cpu", "float32")
    one = choose_engine("hf", 60 * gib, [h100] * 2, 32, vllm_installed=False)
    assert one.model_args("/m", None) == {"pretrained": "/m", "dtype": "auto", "device": "cuda"}
    spread = choose_engine("auto", 140 * gib, [h100] * 2, 32, vllm_installed=False)  # lm-eval's HF model parallelism
    assert spread.model_args("/m", "/tok") == {
        "pretrained": "/m",
        "dtype": "auto",
        "parallelize": True,
        "tokenizer": "/tok",
    }
    assert choose_engine("hf", 140 * gib, [h100], 32, vllm_installed=True).device == "cuda"  # nothing to spread over
    # vLLM: the fewest GPUs, a power of two dividing the heads, that hold the weights with 20% to spare
    assert choose_engine("auto", 60 * gib, [h100] * 8, 32, vllm_installed=True).tensor_parallel == 1
    big = choose_engine("vllm", 140 * gib, [h100] * 8, 64, vllm_installed=True)
    assert big.model_args("/m", None) == {
        "pretrained": "/m",
        "dtype": "auto",
        "tensor_parallel_size": 4,  # 140 GiB / 2 = 70 > 64 (80% of 80): 4 GPUs
        "gpu_memory_utilization": 0.8,
    }
    six_heads = choose_engine("vllm", 140 * gib, [h100] * 8, 6, vllm_installed=True)  # only 1 or 2 divide 6
    assert six_heads.tensor_parallel == 2 and "on 2 of 8 GPUs" in six_heads.why  # vLLM then says what is short
    assert choose_engine("vllm", 900 * gib, [h100] * 4, 32, vllm_installed=True).tensor_parallel == 4  # all it has
    with pytest.raises(EngineError, match="vllm needs a CUDA GPU"):
        choose_engine("vllm", gib, [], 32, vllm_installed=True)
    with pytest.raises(EngineError, match="vllm is not installed"):
        choose_engine("vllm", gib, [h100], 32, vllm_installed=False)


def test_the_node_engine_reads_the_folder_and_the_job_carries_the_backend(tmp_path):
    from nightloom.benchmarks.engine import attention_heads, node_engine, weights_bytes

    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_attention_heads": 12}}))
    (tmp_path / "model-1.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "model-2.safetensors").write_bytes(b"x" * 28)
    assert weights_bytes(tmp_path) == 128 and attention_heads(tmp_path) == 12
    import torch

    here = node_engine(str(tmp_path))  # a CPU machine: HF on the CPU in float32; a GPU one: the checkpoint's dtype
    assert (here.device, here.dtype) == ("cpu", "float32") if not torch.cuda.is_available() else here.dtype == "auto"
    settings = BenchmarksSpec(tasks=["mc"], backend="vllm")
    assert make_job(settings, None, [], tmp_path / "o.json").backend == "vllm"
    assert make_job(BenchmarksSpec(tasks=["mc"]), None, [], tmp_path / "o.json").backend == "auto"


def test_big_weights_are_keyed_by_size_and_mtime(tmp_path, monkeypatch):
    import os

    from nightloom.benchmarks import launch

    monkeypatch.setattr(launch, "WHOLE_BYTES", 4)
    (tmp_path / "model.safetensors").write_bytes(b"12345678")
    os.utime(tmp_path / "model.safetensors", ns=(1, 1))
    key = launch.folder_digest(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"87654321")  # same size, not read
    os.utime(tmp_path / "model.safetensors", ns=(1, 1))
    assert launch.folder_digest(tmp_path) == key
    os.utime(tmp_path / "model.safetensors", ns=(2, 2))  # rewritten: a new key
    assert launch.folder_digest(tmp_path) != key


def test_the_job_takes_every_spec_setting_by_name(tmp_path):
    """make_job copies SPEC_SETTINGS from validate.benchmarks as they are: each is a field of both records, and a
    non-default value of each reaches the job."""
    from nightloom.benchmarks.records import SPEC_SETTINGS, BenchJob

    own = {"models", "tokenizer", "prompts", "output"}  # what make_job sets itself
    assert set(SPEC_SETTINGS) == set(BenchJob.model_fields) - own
    assert set(SPEC_SETTINGS) <= set(BenchmarksSpec.model_fields)
    settings = BenchmarksSpec(
        tasks=["a", "b"],
        include_path=str(tmp_path),
        num_fewshot=2,
        limit=5,
        apply_chat_template=True,
        fewshot_as_multiturn=True,
        batch_size=3,
        backend="hf",
        max_new_tokens=7,
        completions=1,
    )
    job = make_job(settings, "tok", ["p1", "p2"], tmp_path / "o.json")
    assert {name: getattr(job, name) for name in SPEC_SETTINGS} == settings.model_dump(include=set(SPEC_SETTINGS))
    assert job.tokenizer == "tok" and job.prompts == ["p1"] and job.output == str((tmp_path / "o.json").resolve())
