"""What every section of the run spec shares: the pydantic base (unknown keys are errors) and SpecError. A leaf."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class SpecError(ValueError):
    """A spec that cannot be used; `errors` holds one `FILE: field.path: reason` line per problem."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("invalid run spec:\n  " + "\n  ".join(errors))


class Section(BaseModel):
    """A spec section: unknown keys are errors (a typo is never silently ignored)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
