"""The Run form (Prefect's UI over the flows' parameter schemas) shows every field as something a user can read and
set: every property described, no null-only branch (rendered as `Property is type "None"`), no `const` (rendered as
"X is a const and cannot be changed"), and a null default that selects a null choice (not a section filled with its
defaults). The schema still accepts what the flows are sent: the deployments' parameters and a dumped spec with
its nulls (a split run's continuation)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]


def _flows():
    from flows.pipeline import training_pipeline
    from flows.shard import shard_dataset_flow

    return {"training-pipeline": training_pipeline, "shard-dataset": shard_dataset_flow}


@pytest.fixture(scope="module")
def schemas() -> dict[str, dict]:
    """Each flow's parameter schema as `prefect deploy` registers it (cli/deploy/_core.py: parameter_schema(flow))."""
    from prefect.utilities.callables import parameter_schema

    return {name: parameter_schema(f).model_dump_for_openapi() for name, f in _flows().items()}


def _resolve(schema: dict, node: dict) -> dict:
    return schema["definitions"][node["$ref"].rsplit("/", 1)[-1]] if "$ref" in node else node


def _accepts_null(branch: dict) -> bool:
    return branch.get("type") == "null" or None in branch.get("enum", [])


def _property_problems(path: str, prop: dict) -> list[tuple[str, str]]:
    """What the form would show wrongly for one property: (kind, path) pairs."""
    found = []
    if not str(prop.get("description", "")).strip():
        found.append(("undescribed", path))
    if not prop.get("title"):
        found.append(("untitled", path))  # the UI's label reads "Field"
    nodes = [prop, *prop.get("anyOf", []), *prop.get("oneOf", [])]
    items = prop.get("items")
    if isinstance(items, dict):
        nodes += [items, *items.get("anyOf", [])]
    for node in nodes:
        types = node.get("type") if isinstance(node.get("type"), list) else [node.get("type")]
        if "null" in types:
            found.append(("None", path))
        if "const" in node:
            found.append(("const", path))
    branches = prop.get("anyOf", [])
    matched = any(b.get("type") == "null" for b in branches)  # the UI selects a null value's `type: null` branch
    if "default" in prop and prop["default"] is None and branches and not matched and not _accepts_null(branches[0]):
        found.append(("null default on a later branch", path))  # else it selects the first one, filled in
    return found


def form_problems(schema: dict) -> list[tuple[str, str]]:
    """Walk every property of a parameter schema, through every definition it reaches: (kind, path) per problem.

    kinds: `undescribed` (no description of its own), `untitled` (labelled "Field"), `None` (a null type: the UI's `Property is type "None"`),
    `const` (the classic UI's "cannot be changed", though the union has other values), `null default on a later
    branch` (the UI would select the first branch and fill it in: a section such as train.lora turned on)."""
    found, seen = [], set()
    todo = [("", schema)]
    while todo:
        where, node = todo.pop()
        for name, prop in node.get("properties", {}).items():
            path = f"{where}.{name}" if where else name
            found += _property_problems(path, prop)
            for sub in [prop, *prop.get("anyOf", []), prop.get("items") or {}]:
                if "$ref" in sub and (path, sub["$ref"]) not in seen:
                    seen.add((path, sub["$ref"]))
                    todo.append((path, _resolve(schema, sub)))
    return sorted(set(found))


def test_walker_finds_each_kind_of_problem():
    schema = {
        "properties": {
            "a": {"type": "integer", "title": "A"},
            "b": {"anyOf": [{"$ref": "#/definitions/S"}, {"type": "null"}], "default": None, "description": "b"},
            "t": {"$ref": "#/definitions/T", "description": "t"},
            "c": {"anyOf": [{"type": "integer"}, {"const": "tokenizer", "type": "string"}], "description": "c"},
            "d": {"anyOf": [{"$ref": "#/definitions/S"}, {"enum": [None]}], "default": None, "description": "d"},
            "e": {"anyOf": [{"enum": [None]}, {"$ref": "#/definitions/S"}], "default": None, "description": "e"},
        },
        "definitions": {
            "S": {"properties": {"kind": {"const": "local", "description": "k", "title": "Kind"}}},
            "T": {},
        },
    }
    assert form_problems(schema) == [
        ("None", "b"),
        ("const", "b.kind"),
        ("const", "c"),
        ("const", "d.kind"),
        ("const", "e.kind"),
        ("null default on a later branch", "d"),
        ("undescribed", "a"),
        ("untitled", "b"),
        ("untitled", "c"),
        ("untitled", "d"),
        ("untitled", "e"),
        ("untitled", "t"),
    ]


@pytest.mark.parametrize("flow", ["training-pipeline", "shard-dataset"])
def test_every_form_field_is_described_and_settable(schemas, flow):
    problems = form_problems(schemas[flow])
    counts = {k: sum(1 for kind, _ in problems if kind == k) for k in {kind for kind, _ in problems}}
    assert not problems, f"{counts}:\n" + "\n".join(f"{kind}: {path}" for kind, path in problems)


def test_form_offers_the_unions_choices(schemas):
    """vocab: the model's own (null, the default), a number or `tokenizer`; provider kinds: one per choice."""
    schema = schemas["training-pipeline"]
    run_spec = _resolve(schema, schema["properties"]["spec"]["anyOf"][0])
    vocab = _resolve(schema, run_spec["properties"]["model"])["properties"]["vocab"]
    assert [b.get("enum", b.get("type")) for b in vocab["anyOf"]] == [[None], "integer", ["tokenizer"]]
    provider = _resolve(schema, run_spec["properties"]["cluster"])["properties"]["provider"]
    kinds = [_resolve(schema, b)["properties"]["kind"]["enum"] for b in provider["anyOf"]]
    assert kinds == [["local"], ["ssh"], ["slurm"], ["kubernetes"]]


def test_server_accepts_a_dumped_spec_with_its_nulls(schemas):
    """A split run continues with `spec.model_dump(mode="json")` (nulls included) as the deployment's parameters;
    Prefect's server validates them against this schema (prefect.utilities.schema_tools.validation.validate)."""
    from prefect.utilities.schema_tools.validation import validate

    from nightloom.spec.load import load_spec

    for path in sorted((ROOT / "deployments").glob("*.yaml")):
        spec = load_spec(path)
        params = {"spec": spec.model_dump(mode="json", by_alias=True), "resume_run_id": None}
        assert validate(params, schemas["training-pipeline"]) == [], path.name
    on_demand = next(
        d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"] if d["name"] == "on-demand"
    )
    assert validate(on_demand["parameters"], schemas["training-pipeline"]) == []
    bad = {"spec": {**on_demand["parameters"]["spec"], "model": {"vocab": "tokenizers"}}}
    assert validate(bad, schemas["training-pipeline"])  # still checked: `tokenizer` or a number
