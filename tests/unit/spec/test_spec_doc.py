"""docs/spec.md's field reference is the schema's: regenerated from nightloom/spec/schema.py, it must match, and every
field a user can write is in it."""

from __future__ import annotations

import typing
from pathlib import Path

from pydantic import BaseModel

from nightloom.spec import RunSpec
from nightloom.spec import doc as spec_doc

SPEC_MD = Path(__file__).resolve().parents[3] / "docs" / "spec.md"


def _models(tp) -> list[tuple[type[BaseModel], bool]]:
    """The models inside a field type, and whether each sits in a list (a walk of its own, not spec_doc's)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [(tp, False)]
    found = []
    for arg in typing.get_args(tp):
        in_list = typing.get_origin(tp) is list
        found += [(m, in_list or inner) for m, inner in _models(arg)]
    return found


def _paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, info in model.model_fields.items():
        path = prefix + (info.alias or name)
        out.append(path)
        for sub, in_list in _models(info.annotation):
            out += _paths(sub, path + ("[]." if in_list else "."))
    return out


def test_generated_block_matches_the_schema():
    block = spec_doc.generated_block(SPEC_MD.read_text())
    assert block is not None, f"docs/spec.md lost its generated-block markers; run: {spec_doc.FIX_COMMAND}"
    assert block == spec_doc.render(), (
        f"docs/spec.md is out of date with nightloom/spec/schema.py; run: {spec_doc.FIX_COMMAND}"
    )


def test_every_field_path_is_documented():
    text = SPEC_MD.read_text()
    paths = _paths(RunSpec)
    assert {"name", "validate.eval_every", "cluster.provider.partition", "cluster.provider.hosts[].port"} <= set(paths)
    missing = [p for p in paths if f"`{p}`" not in text]
    assert not missing, f"docs/spec.md does not name {missing}; run: {spec_doc.FIX_COMMAND}"
    assert set(spec_doc.field_paths()) == set(paths)


def test_write_keeps_the_prose_around_the_block(tmp_path):
    page = tmp_path / "spec.md"
    page.write_text(f"# Before\n\n{spec_doc.BEGIN}\nstale\n{spec_doc.END}\n\n## After\n")
    spec_doc.write(page)
    text = page.read_text()
    assert text.startswith("# Before\n\n") and text.endswith("\n\n## After\n")
    assert spec_doc.generated_block(text) == spec_doc.render()
    assert "stale" not in text


def test_a_new_field_shows_up_in_the_reference():
    class Extra(BaseModel):
        """A section added later."""

        depth: int = 3

    class Planted(RunSpec):
        extra: Extra = Extra()

    paths = spec_doc.field_paths(Planted)
    assert "extra.depth" in paths and "extra.depth" not in spec_doc.field_paths()
