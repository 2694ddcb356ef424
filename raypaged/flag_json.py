"""A flag whose value is a JSON object (vLLM's ``--speculative-config``, ``--structured-outputs-config``,
``--reasoning-config``), read the same way for each: JSON text or the dict an ``LLM`` keyword gives."""

from __future__ import annotations

import json
from typing import Any


def json_object(flag: str, value: str | dict[str, Any]) -> dict[str, Any]:
    """``value``'s object (a copy); ``ValueError`` naming ``flag`` when it is no JSON or no object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {value!r}")
    return dict(value)
