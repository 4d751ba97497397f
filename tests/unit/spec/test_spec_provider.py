"""cluster.provider is one provider's settings, chosen by `kind`: the Run form offers a choice of providers (an
`anyOf` with a discriminator, which Prefect's UI renders as a selector), not every provider's section at once;
the older spelling (`provider: slurm` beside a `slurm:` section) still loads, and errors name the path as written."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nightloom.spec import ClusterSpec, LocalSpec, SlurmSpec, SpecError, SSHSpec
from nightloom.spec.load import coerce_spec, load_spec

ROOT = Path(__file__).resolve().parents[3]
KINDS = {"local", "ssh", "slurm", "kubernetes"}


@pytest.fixture(scope="module")
def schema() -> dict:
    """The training flow's parameter schema, as Prefect builds it for a deployment and its Run form."""
    from prefect.utilities.callables import parameter_schema

    from flows.pipeline import training_pipeline

    return parameter_schema(training_pipeline).model_dump()


def _resolve(schema: dict, node: dict) -> dict:
    return schema["definitions"][node["$ref"].rsplit("/", 1)[-1]] if "$ref" in node else node


def test_run_form_offers_one_provider_at_a_time(schema):
    run_spec = _resolve(schema, next(x for x in schema["properties"]["spec"]["anyOf"] if "$ref" in x))
    cluster = _resolve(schema, run_spec["properties"]["cluster"])
    assert not KINDS & set(cluster["properties"]), "every provider's section is on the form"
    provider = cluster["properties"]["provider"]
    assert "oneOf" not in provider  # the 3.9.1 UI renders anyOf as a selector and has no oneOf
    branches = [_resolve(schema, b) for b in provider["anyOf"]]
    assert provider["discriminator"]["propertyName"] == "kind"
    assert set(provider["discriminator"]["mapping"]) == KINDS
    by_kind = {b["properties"]["kind"]["enum"][0]: b for b in branches}  # a one-value select (flows/ui_schema.py)
    assert all(len(b["properties"]["kind"]["enum"]) == 1 for b in branches)
    assert set(by_kind) == KINDS and [b["title"] for b in branches] == ["local", "ssh", "slurm", "kubernetes"]
    assert set(by_kind["local"]["properties"]) == {"kind"}
    assert "hosts" in by_kind["ssh"]["properties"] and "partition" not in by_kind["ssh"]["properties"]
    assert "partition" in by_kind["slurm"]["properties"] and "namespace" not in by_kind["slurm"]["properties"]
    assert "namespace" in by_kind["kubernetes"]["properties"] and "hosts" not in by_kind["kubernetes"]["properties"]


def test_prefect_validates_parameters_against_the_union(schema):
    """What the server checks before a run starts: the on-demand deployment's parameters pass; settings of
    another provider under a kind, or an unknown kind, do not."""
    from prefect.utilities.schema_tools.validation import validate

    on_demand = next(
        d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"] if d["name"] == "on-demand"
    )
    params = on_demand["parameters"]
    assert validate(params, schema) == []

    def with_provider(provider: dict) -> dict:
        return {"spec": {**params["spec"], "cluster": {**params["spec"]["cluster"], "provider": provider}}}

    assert validate(with_provider({"kind": "slurm", "partition": "gpu"}), schema) == []
    assert validate(with_provider({"kind": "slurm", "hosts": []}), schema)
    assert validate(with_provider({"kind": "lsf"}), schema)


def test_a_form_value_reaches_the_flow_as_that_provider():
    spec = coerce_spec(
        {
            "name": "f",
            "dataset": {"path": "x.jsonl", "sample": True},
            "cluster": {"provider": {"kind": "slurm", "partition": "gpu", "time_limit": "02:00:00"}},
        }
    )
    assert isinstance(spec.cluster.provider, SlurmSpec)
    assert (spec.cluster.provider.partition, spec.cluster.provider.time_limit) == ("gpu", "02:00:00")
    assert coerce_spec(spec).cluster.provider == spec.cluster.provider  # a RunSpec passed on round-trips


def test_default_is_local():
    assert ClusterSpec().provider == LocalSpec()


def _spec_file(tmp_path: Path, cluster: dict) -> Path:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "hello"}\n')
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump({"name": "t", "dataset": {"path": str(corpus)}, "cluster": cluster}, sort_keys=False))
    return p


def test_older_spelling_still_loads(tmp_path):
    spec = load_spec(
        _spec_file(
            tmp_path,
            {
                "provider": "slurm",
                "slurm": {"partition": "gpu", "exclude": ["n3"]},
                "kubernetes": {"namespace": "unused"},  # a section of a provider not chosen was never read
            },
        )
    )
    assert spec.cluster.provider == SlurmSpec(partition="gpu", exclude=["n3"])
    assert ClusterSpec(provider="ssh", ssh=SSHSpec(key_env="K")).provider == SSHSpec(key_env="K")
    assert ClusterSpec(provider="ssh").provider == SSHSpec()


def _errors(path: Path) -> list[str]:
    with pytest.raises(SpecError) as ei:
        load_spec(path)
    return ei.value.errors


def test_errors_name_the_field_as_the_file_spells_it(tmp_path):
    new = _spec_file(tmp_path, {"nodes": 1, "provider": {"kind": "slurm", "partion": "gpu"}})
    (err,) = _errors(new)
    assert err == f"{new}:8: cluster.provider.partion: unknown key (typo?)", err
    old = _spec_file(tmp_path, {"provider": "slurm", "nodes": 1, "slurm": {"time_limit": 5}})
    (err,) = _errors(old)
    assert err.startswith(f"{old}:8: cluster.slurm.time_limit: "), err
    (err,) = _errors(_spec_file(tmp_path, {"provider": {"kind": "lsf"}}))
    assert ":5: cluster.provider: " in err and "'lsf'" in err and "slurm" in err, err


@pytest.mark.parametrize("spelling", ["new", "older"])
def test_ssh_host_count_checked_in_either_spelling(tmp_path, spelling):
    hosts = [{"host": "10.0.0.5"}]
    if spelling == "new":
        cluster, path = {"nodes": 2, "provider": {"kind": "ssh", "hosts": hosts}}, "cluster.provider.hosts"
    else:
        cluster, path = {"nodes": 2, "provider": "ssh", "ssh": {"hosts": hosts}}, "cluster.ssh.hosts"
    errs = _errors(_spec_file(tmp_path, cluster))
    assert any(f": {path}: 1 non-spare hosts for cluster.nodes=2" in e for e in errs), errs
