"""Reading a run spec: YAML (or a mapping, or a RunSpec) in, a validated RunSpec out, or a SpecError listing every
problem at once as `FILE:LINE: field.path: reason` (schema errors and the checks of `nightloom.spec.checks`).
Relative paths in a spec file resolve against the file's folder; in a spec built in Python, the working folder.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from nightloom.spec import PROVIDER_KINDS, RunSpec, SpecError
from nightloom.spec.checks import semantic_errors

__all__ = ["SpecError", "coerce_spec", "format_errors", "load_spec", "parse_spec"]


def _yaml_line(path: Path, text: str, loc: tuple) -> int | None:
    """Best-effort line number of a field path in a YAML document (for error messages)."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == key:
                    line, node = k.start_mark.line + 1, v
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _older_provider_spelling(text: str) -> bool:
    """The YAML spells the provider as `provider: <kind>` with a sibling `<kind>:` section."""
    try:
        return isinstance(((yaml.safe_load(text) or {}).get("cluster") or {}).get("provider"), str)
    except yaml.YAMLError:
        return False


def format_errors(err: ValidationError, source: str, text: str | None = None) -> list[str]:
    """One `SOURCE[:LINE]: field.path: reason` per pydantic error."""
    out = []
    older = text is not None and _older_provider_spelling(text)
    for e in err.errors():
        loc = tuple(x for x in e["loc"] if not (isinstance(x, str) and x.startswith(("function-after", "literal["))))
        loc = tuple("validate" if x == "validate_" else x for x in loc)
        # the `parallel` union reports both branches; keep the ParallelSpec one (it names the field)
        if loc[:1] == ("parallel",) and len(loc) > 1 and loc[1] == "ParallelSpec":
            loc = ("parallel",) + loc[2:]
        # a provider's field: pydantic puts the union's tag in the path; name the field as the file spells it
        if loc[:2] == ("cluster", "provider") and len(loc) > 2 and loc[2] in PROVIDER_KINDS:
            loc = ("cluster", loc[2] if older else "provider", *loc[3:])
        path = ".".join(str(x) for x in loc) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (typo?)"
        elif e["type"] == "missing":
            msg = "required field is missing"
        where = source
        if text is not None:
            line = _yaml_line(Path(source), text, loc)
            if line:
                where = f"{source}:{line}"
        out.append(f"{where}: {path}: {msg}")
    # dedupe while keeping order (union branches can repeat a message)
    seen: set[str] = set()
    return [x for x in out if not (x in seen or seen.add(x))]


MOVED = {("dataset", "tokenizer"): "model.tokenizer"}


def parse_spec(data: object, source: str = "<spec>", text: str | None = None, base_dir: Path | None = None) -> RunSpec:
    """Validate a mapping into a RunSpec; raise SpecError listing every problem (schema and semantic) at once."""
    if not isinstance(data, dict):
        raise SpecError([f"{source}: <root>: expected a mapping of sections, got {type(data).__name__}"])
    base_dir = base_dir or Path.cwd()
    errors: list[str] = []
    spec = None
    for (section, key), new in MOVED.items():  # a field that moved: say where, not "unknown key"
        if isinstance(data.get(section), dict) and key in data[section]:
            line = _yaml_line(Path(source), text, (section, key)) if text is not None else None
            errors.append(f"{source}{f':{line}' if line else ''}: {section}.{key}: moved to {new} (set it there)")
            data = {**data, section: {k: v for k, v in data[section].items() if k != key}}
    try:
        spec = RunSpec.model_validate(data)
    except ValidationError as err:
        errors += format_errors(err, source, text)
    for loc, msg in semantic_errors(data, base_dir):
        line = _yaml_line(Path(source), text, loc) if text is not None else None
        errors.append(f"{source}{f':{line}' if line else ''}: {'.'.join(loc)}: {msg}")
    if errors or spec is None:
        raise SpecError(errors)
    return spec.resolved(base_dir)


def load_spec(path: str | Path) -> RunSpec:
    """Read and validate a YAML run spec; errors name the file, line and field path."""
    p = Path(path)
    if not p.is_file():
        raise SpecError([f"{p}: file not found"])
    text = p.read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark else str(p)
        raise SpecError([f"{where}: invalid YAML: {getattr(err, 'problem', err)}"]) from None
    return parse_spec(data, source=str(p), text=text, base_dir=p.resolve().parent)


def coerce_spec(spec: RunSpec | str | Path | dict) -> RunSpec:
    """Accept what users pass (a spec, a path, a dict from the UI) and return a validated RunSpec."""
    if isinstance(spec, RunSpec):
        return parse_spec(spec.model_dump(by_alias=True), source="<RunSpec>")
    if isinstance(spec, dict):
        return parse_spec(spec, source="<parameters>")
    return load_spec(spec)
