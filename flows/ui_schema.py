"""The Run form's schema: RunSpec's JSON schema reshaped so that Prefect's UI (3.9.1, both the classic and the v2
UI) renders every field as an input a user can set.

What pydantic writes and what the UI makes of it:

- `Optional[X]` is `anyOf: [X, {type: null}]` with `default: null`. The null default selects the null branch,
  which the UI renders as the text `Property is type "None"` (30 of them on the form).
  A scalar X (string, integer, number) becomes X alone with no default: an empty input is left out of the
  parameters and the field keeps its default (null); Prefect's server still accepts an explicit null, because its
  parameter validation adds a null branch to every optional property with a type and no default.
  Any other X (a section, a union, an enum, a list, a bool) keeps a null choice, spelled `{enum: [null]}` and
  listed first: the UI selects it for the null default (a later branch would be selected and filled with its
  defaults, turning a section such as `train.lora` on) and shows no "None" text under it.
- `Literal["x"]` is `const: "x"`, which the classic UI shows as "X is a const and cannot be changed": it becomes a
  one-value `enum` (a select), so `cluster.provider.kind` is the kind the provider choice above it picked and
  `model.vocab`'s `tokenizer` is a choice beside a number.
- A section's property (a `$ref`) has no title, which the UI shows as "Field": it gets its name as pydantic writes
  titles.

Prefect builds the schema from the flow's annotations (prefect.utilities.callables.parameter_schema), so the
reshaping rides on the annotation: `spec: RunSpecForm | str`. Validation is pydantic's and unchanged.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import GetJsonSchemaHandler
from pydantic_core import CoreSchema

from nightloom.spec import RunSpec

JsonDict = dict[str, Any]

#: the label of a field's null choice on the form, by field name (default "unset")
NULL_LABELS = {
    "lora": "off (every weight trains)",
    "xtuner": "off (native backend)",
    "dask": "off (this machine)",
    "vocab": "the model's own",
    "preempt_signal": "none (SIGTERM only)",
    "stages": "even split",
    "ib_disable": "NCCL's default",
    "p2p_disable": "NCCL's default",
    "resume_run_id": "a new run",
}
#: JSON schema types an empty input can stand for (left out of the parameters = the field's default)
SCALARS = ("string", "integer", "number")


def _is_null(branch: JsonDict) -> bool:
    """A branch that accepts only null, as pydantic writes it."""
    return branch.get("type") == "null" or branch.get("enum") == [None]


def _const_to_enum(node: JsonDict, branch: bool = False) -> None:
    """`const: x` (shown as "cannot be changed") as a one-value select, preset; the value stays the only valid
    one. A union's branch is named by its value (the UI's tab would read "str")."""
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "enum" in node and len(node["enum"]) == 1:
        node.setdefault("default", node["enum"][0])
        if branch:
            node.setdefault("title", str(node["enum"][0]))


def _optional(name: str, prop: JsonDict, flatten: bool = True) -> JsonDict:
    """A property whose `anyOf` holds a null branch, reshaped as the module docstring says. `flatten=False`: keep
    a null choice for a scalar too (a flow parameter, whose `default: null` Prefect adds after this)."""
    others = [b for b in prop["anyOf"] if not _is_null(b)]
    if len(others) == len(prop["anyOf"]):
        return prop
    rest = {k: v for k, v in prop.items() if k != "anyOf"}
    only = others[0] if len(others) == 1 else {}
    if flatten and only.get("type") in SCALARS and "enum" not in only and "$ref" not in only:
        rest.pop("default", None)  # an empty input: the field's default (null); the server still accepts null
        return {**only, **rest}
    null_choice = {"enum": [None], "title": NULL_LABELS.get(name, "unset")}
    return {**rest, "anyOf": [null_choice, *others]}


def reshape_properties(properties: JsonDict) -> None:
    """Reshape every property of one object schema in place (nested anyOf branches included)."""
    for name, prop in list(properties.items()):
        _const_to_enum(prop)
        for branch in prop.get("anyOf", []):
            _const_to_enum(branch, branch=True)
        if "anyOf" in prop:
            properties[name] = prop = _optional(name, prop)
        prop.setdefault("title", name.replace("_", " ").title())  # pydantic gives a section none: "Field" on the form


def _refs(node: Any) -> list[str]:
    """Every `$ref` under a schema node."""
    if isinstance(node, dict):
        return ([node["$ref"]] if "$ref" in node else []) + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def reshape_definitions(root: JsonDict, resolve) -> None:
    """Reshape `root` and every definition reachable from it; `resolve(ref)` gives a definition to change."""
    seen: set[str] = set()
    todo = [root]
    while todo:
        node = todo.pop()
        node = resolve(node["$ref"]) if "$ref" in node else node
        reshape_properties(node.get("properties", {}))
        for ref in _refs(node):
            if ref not in seen:
                seen.add(ref)
                todo.append({"$ref": ref})


class FormSchema:
    """Annotated metadata: the annotated type's JSON schema, reshaped for Prefect's Run form. `name` labels the
    null choice of an optional flow parameter (NULL_LABELS)."""

    def __init__(self, name: str = ""):
        self.name = name

    def __get_pydantic_json_schema__(self, core_schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonDict:
        """Pydantic's schema of the type, then its definitions reshaped in place."""
        schema = handler(core_schema)
        reshape_definitions(schema, lambda ref: handler.resolve_ref_schema({"$ref": ref}))
        if "anyOf" in schema:  # an optional flow parameter
            schema = _optional(self.name, schema, flatten=False)
        return schema


#: the run spec as a flow parameter: validated as RunSpec, shown on the Run form as described above
RunSpecForm = Annotated[RunSpec, FormSchema()]
#: a run id to resume, or none: on the form, "a new run" or a run id
OptionalRunId = Annotated[str | None, FormSchema("resume_run_id")]
