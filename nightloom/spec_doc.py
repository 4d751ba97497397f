"""Deprecated alias of `nightloom.spec.doc` for one release: importing it warns."""

from __future__ import annotations

import warnings

from nightloom.spec.doc import (
    BEGIN,
    END,
    FIX_COMMAND,
    Row,
    Section,
    field_paths,
    generated_block,
    main,
    render,
    sections,
    write,
)

warnings.warn(
    "nightloom.spec_doc is deprecated and goes in the next release: import from nightloom.spec.doc",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "BEGIN",
    "END",
    "FIX_COMMAND",
    "Row",
    "Section",
    "field_paths",
    "generated_block",
    "main",
    "render",
    "sections",
    "write",
]


if __name__ == "__main__":
    raise SystemExit(main())
