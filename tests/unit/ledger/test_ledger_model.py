"""The model a ledger row names is the model the run trained (nightloom/ledger/model.py): a spec whose model comes
from model.config or model.weights is recorded under that model's name and family, not the default `tiny`, and the
planner's calibration reads the same family."""

from __future__ import annotations

import json
from pathlib import Path

from nightloom.catalog import get_model
from nightloom.gates import Verdict
from nightloom.ledger import Ledger, calibration_for_spec
from nightloom.ledger.model import RunModel, ledger_fields, run_model, spec_run_model
from nightloom.parallel import ParallelPlan
from nightloom.spec import RunSpec
from nightloom.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[3]
OK = [
    Verdict(name="mfu_floor", passed=True, measured=0.4, threshold=0.3, reason="ok"),
    Verdict(name="loss_drop", passed=True, measured=0.3, threshold=0.05, reason="ok"),
]
LLAMA = {
    "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
}  # fmt: skip


def spec(tmp_path: Path, model: dict, gpu: str = "cpu") -> RunSpec:
    cluster = {"gpu_type": gpu} | ({"nodes": 1, "gpus_per_node": 8} if gpu != "cpu" else {})
    return RunSpec.model_validate(
        {
            "name": "t",
            "dataset": {"path": "d"},
            "model": model,
            "cluster": cluster,
            "ledger": {"url": f"sqlite:///{tmp_path / 'ledger.db'}"},
        }
    )


def test_a_run_from_model_config_is_recorded_as_the_model_it_trains(tmp_path: Path):
    """The shipped chat demo (model.config a Qwen2 config.json, model.weights its folder): its row says
    chat-sft-demo-qwen2 / qwen2, where it said `tiny` before."""
    demo = load_spec(ROOT / "deployments" / "chat-sft-demo.yaml")
    assert demo.model.name == "tiny" and demo.model.config  # the default name the ledger used to store
    fields = ledger_fields(demo)
    assert (fields["model"], fields["family"]) == ("chat-sft-demo-qwen2", "qwen2")
    assert fields["name"] == "chat-sft-demo" and fields["gpu_type"] == "cpu" and fields["world_size"] == 2
    with Ledger(f"sqlite:///{tmp_path / 'l.db'}") as lg:
        rec = lg.start_run(run_id="r1", plan=None, **fields)
        assert (rec.model, rec.family) == ("chat-sft-demo-qwen2", "qwen2")
        assert [r.run_id for r in lg.list_runs(model="chat-sft-demo-qwen2")] == ["r1"]


def test_a_weights_folder_names_the_model_and_its_model_type_the_family(tmp_path: Path):
    folder = tmp_path / "models" / "Llama-mini"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(LLAMA | {"_name_or_path": "/data/hub/Llama-mini-base"}))
    assert spec_run_model(spec(tmp_path, {"weights": str(folder), "config": str(folder)})) == RunModel(
        "Llama-mini", "llama"
    )
    assert spec_run_model(spec(tmp_path, {"config": str(folder / "config.json")})) == RunModel(
        "Llama-mini-base",
        "llama",  # no weights: the config's _name_or_path, without its folders
    )
    assert spec_run_model(spec(tmp_path, {"name": "llama2-70b"})) == RunModel("llama2-70b", "llama2")
    shape = get_model("tiny").with_(name="Qwen/Qwen2.5-0.5B", arch="qwen2")
    assert run_model(shape, "config.json") == RunModel("Qwen/Qwen2.5-0.5B", "qwen2")  # a Hub id stays whole
    assert run_model(shape, "c.json", "s3://b/models/Qwen2.5-0.5B/") == RunModel("Qwen2.5-0.5B", "qwen2")


def test_a_config_not_there_yet_still_gives_a_row(tmp_path: Path):
    """A run that fails before its demo weights exist (e.g. while sharding) is still recorded, by its folder."""
    missing = tmp_path / "models" / "demo-llama"
    assert spec_run_model(spec(tmp_path, {"weights": str(missing), "config": str(missing / "config.json")})) == (
        RunModel("demo-llama", "unknown")
    )
    demo = {"weights": str(missing), "config": str(missing / "config.json"), "build_demo_weights": True}
    assert spec_run_model(spec(tmp_path, demo)) == RunModel("demo-llama", "llama")  # what the demo will build


def test_the_calibration_of_a_config_spec_reads_its_family_not_tiny(tmp_path: Path):
    qwen2 = str(ROOT / "deployments" / "chat-sft-demo-model.json")
    gpu_spec = spec(tmp_path, {"config": qwen2}, gpu="h100-80gb")
    with Ledger(gpu_spec.ledger.url) as lg:
        for run_id, model, family, measured in (("q", "chat-sft-demo-model", "qwen2", 0.4), ("t", "tiny", "", 0.1)):
            lg.start_run(
                run_id=run_id, spec_hash="h", name="n", model=model, family=family, cluster="c", provider="slurm",
                gpu_type="h100-80gb", world_size=8, plan=ParallelPlan(dp_shard=8, mfu=0.5),
            )  # fmt: skip
            lg.finish_run(run_id, status="succeeded", measured_mfu=measured, tokens_per_s=1.0, verdicts=OK)
        assert lg.get("t").family == "tiny"  # no family given: its name's
    cal = calibration_for_spec(gpu_spec)
    assert cal.model_family == "qwen2" and cal.runs == 1 and cal.raw_median == 0.8


def test_ledger_list_shows_the_model_and_its_family(tmp_path: Path, capsys):
    from flows.cli import main

    url = f"sqlite:///{tmp_path / 'l.db'}"
    with Ledger(url) as lg:
        lg.start_run(run_id="chat", plan=None, **ledger_fields(load_spec(ROOT / "deployments" / "chat-sft-demo.yaml")))
        lg.start_run(run_id="local", plan=None, **ledger_fields(load_spec(ROOT / "deployments" / "local-demo.yaml")))
    assert main(["ledger", "--url", url, "list", "--json"]) == 0
    rows = {r["run_id"]: (r["model"], r["family"]) for r in json.loads(capsys.readouterr().out)}
    assert rows == {"chat": ("chat-sft-demo-qwen2", "qwen2"), "local": ("tiny", "tiny")}
    assert main(["ledger", "--url", url, "list"]) == 0
    out = capsys.readouterr().out  # 160 columns when not a terminal: one line per run
    assert "│ chat-sft-demo-qwen2 (qwen2) │" in out
    assert "│ tiny " in out and "tiny (tiny)" not in out  # a catalog name already says its family


def test_ledger_list_never_cuts_a_run_id(tmp_path: Path, capsys, monkeypatch):
    """A run id is what `eval`, `export` and `ledger best` take: the table folds it, never cuts it with '…'."""
    from flows.cli import main

    monkeypatch.setenv("COLUMNS", "100")
    url = f"sqlite:///{tmp_path / 'l.db'}"
    rid = "continue-pretrain-demo-of-a-team-s-own-naming-20261205-125231-7d44ffea"
    with Ledger(url) as lg:
        lg.start_run(run_id=rid, plan=None, **ledger_fields(load_spec(ROOT / "deployments" / "local-demo.yaml")))
        for i, name in enumerate(("chat-sft-demo", "continue-pretrain-demo", "xtuner-lora-demo")):
            spec = load_spec(ROOT / "deployments" / f"{name}.yaml")
            lg.start_run(run_id=f"{rid}-{i}", plan=None, **ledger_fields(spec))
            lg.finish_run(f"{rid}-{i}", status="succeeded", tokens_per_s=12_345.6, cost=1.5, duration_s=90.0)
    assert main(["ledger", "--url", url, "list"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    first_cells = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    assert rid in first_cells and f"{rid}-2" in first_cells  # whole, each on one line: 200 columns when piped


def test_an_xtuner_run_is_recorded_as_its_base_model(tmp_path):
    """The XTuner demo's row named `tiny` (its spec's default catalog name) while XTuner trained the Llama in
    train.xtuner.base_model: the row names that base folder and its config's model_type, built yet or not."""
    demo = load_spec(ROOT / "deployments" / "xtuner-lora-demo.yaml")
    assert spec_run_model(demo).family == "llama"
    assert spec_run_model(demo).name == Path(demo.train.xtuner.base_model).name
    base = tmp_path / "my-qwen"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    s = demo.model_copy(update={"model": demo.model.model_copy(update={"weights": str(base)})})
    s = s.model_copy(
        update={"train": s.train.model_copy(update={"xtuner": s.train.xtuner.model_copy(update={"base_model": None})})}
    )
    assert spec_run_model(s) == RunModel("my-qwen", "qwen2")
