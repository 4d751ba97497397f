"""The Run form renders every field description of the pipeline's parameter schema as Markdown: a description
must read the same rendered (`<hash>` is an HTML tag to the browser, `*a* b*` emphasis, `\\_` an escape).
Text that must show such characters goes in a code span."""

from __future__ import annotations

import html
import re

from markdown_it import MarkdownIt
from prefect.utilities.callables import parameter_schema

_MD = MarkdownIt("commonmark", {"html": True})
_TAG = re.compile(r"<[^>]*>")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
#: where a browser's HTML parser starts a tag, though CommonMark calls it text (`<run_dir>`: the UI drops it)
_TAG_START = re.compile(r"<[A-Za-z/!?]")


def rendered_text(description: str) -> str:
    """What a reader sees of `description` rendered as Markdown (tags dropped, entities decoded)."""
    return html.unescape(_TAG.sub("", _MD.renderInline(description)))


def as_written(description: str) -> str:
    """The text a reader should see: the description with its code spans' backticks taken off."""
    return _CODE_SPAN.sub(lambda m: m.group(2).strip(), description)


def swallowed(schema: object, path: str = "") -> list[str]:
    """Every description in a JSON schema that Markdown does not render as written, with its path."""
    found: list[str] = []
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key == "description" and isinstance(value, str):
                shown = rendered_text(value)
                outside_code = _CODE_SPAN.sub("", value)
                if _TAG_START.search(outside_code) or " ".join(shown.split()) != " ".join(as_written(value).split()):
                    found.append(f"{path}: {value!r} renders as {shown!r}")
            else:
                found.extend(swallowed(value, f"{path}.{key}" if path else key))
    elif isinstance(schema, list):
        for i, value in enumerate(schema):
            found.extend(swallowed(value, f"{path}[{i}]"))
    return found


def test_checker_sees_what_markdown_swallows():
    assert swallowed({"description": "written as heldout.<hash>.parquet"})
    assert swallowed({"a": {"description": "write <run_dir>/export/"}})
    assert swallowed({"description": "files *.bin* and __x__"})
    assert not swallowed({"description": "written as `heldout.<hash>.parquet` (a < b, 2 * 3)"})


def test_every_form_description_renders_as_written():
    from flows.pipeline import training_pipeline

    schema = parameter_schema(training_pipeline.fn).model_dump_for_openapi()
    assert "definitions" in schema and len(schema["definitions"]) > 10  # the whole RunSpec is in it
    bad = swallowed(schema)
    assert not bad, "descriptions Markdown would not render as written:\n" + "\n".join(bad)


def test_on_demand_default_is_the_demo(monkeypatch):
    """The Run form's default (prefect.yaml's on-demand parameters, paths from the repository root, where the
    worker runs) is the spec `make demo` runs: same model, tokenizer, held-out split and gates."""
    from pathlib import Path

    import yaml

    from nightloom.spec.load import coerce_spec, load_spec

    root = Path(__file__).resolve().parents[3]
    monkeypatch.chdir(root)
    deployments = yaml.safe_load((root / "prefect.yaml").read_text())["deployments"]
    form = next(d for d in deployments if d["name"] == "on-demand")["parameters"]["spec"]
    demo = load_spec(root / "deployments" / "local-demo.yaml")
    assert coerce_spec(form).model_dump() == demo.model_dump()
