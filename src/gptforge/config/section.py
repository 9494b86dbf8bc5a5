"""The base of every config section: unknown keys are refused, assignments validated."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def with_changes(self, changes: dict[str, Any]):
        """A copy with `changes` over this section's values, validated: a nested section merges
        key by key (`{"lora": {"r": 16}}` keeps lora's other keys), any other value replaces."""
        return type(self).model_validate(self._merged(changes))

    def _merged(self, changes: dict[str, Any]) -> dict[str, Any]:
        values = self.model_dump()
        for key, value in changes.items():
            nested = getattr(self, key, None) if isinstance(value, dict) else None
            values[key] = nested._merged(value) if isinstance(nested, Section) else value
        return values
