"""Reasoning efforts the gateway sets or rewrites (vLLM's flags): ``--reasoning-effort-map`` rewrites a request's
effort to the chat template's name for it (``ChatCompletionRequest.template_variables``), on every API; and
``--anthropic-disabled-thinking-effort`` is the effort of a Messages request whose thinking is disabled. Imports
nothing heavy: the command line reads its names."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Literal, get_args

logger = logging.getLogger("raypaged")

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]  # a request's (vLLM's)
REASONING_EFFORTS: tuple[str, ...] = get_args(ReasoningEffort)
AUTO = "auto"
_THINKING = ("low", "medium", "high", "xhigh", "max")  # the efforts a Messages request thinks with
DISABLED_THINKING_EFFORTS = (AUTO, "none", *_THINKING)
# an effort -> the token ids of a probe conversation rendered with it; None: the chat template refuses it
Render = Callable[[str], Awaitable[list[int] | None]]


def check_effort_map(effort_map: object) -> None:
    """``ValueError`` naming ``--reasoning-effort-map`` unless it maps reasoning efforts to strings."""
    if effort_map is None:
        return
    if not isinstance(effort_map, dict) or not all(isinstance(value, str) for value in effort_map.values()):
        raise ValueError(
            "--reasoning-effort-map takes a JSON object of reasoning efforts and the chat template's names for them, "
            f"got {json.dumps(effort_map)}"
        )
    unknown = [effort for effort in effort_map if effort not in REASONING_EFFORTS]
    if unknown:
        efforts = ", ".join(REASONING_EFFORTS)
        raise ValueError(f"--reasoning-effort-map: {unknown[0]!r} is not a reasoning effort (efforts: {efforts})")


class DisabledThinking:
    """The ``reasoning_effort`` of a Messages request with thinking disabled: ``effort``; with ``auto``, per model,
    ``none``, unless its chat template refuses ``none`` or renders it as it renders a thinking effort (a model
    that cannot stop thinking): then ``low``, as vLLM's ``auto``."""

    def __init__(self, effort: str = AUTO) -> None:
        if effort not in DISABLED_THINKING_EFFORTS:
            raise ValueError(
                f"--anthropic-disabled-thinking-effort must be one of {', '.join(DISABLED_THINKING_EFFORTS)}, "
                f"got {effort!r}"
            )
        self.effort = effort
        self._chosen: dict[str, str] = {}  # auto: each model's, once probed

    async def effort_for(self, model: str, render: Render) -> str:
        """The effort for ``model``; ``render`` renders a probe conversation with an effort (``auto`` only)."""
        if self.effort != AUTO:
            return self.effort
        if model not in self._chosen:
            self._chosen[model] = chosen = await _probed(render)
            logger.info("%s: Messages requests with thinking disabled use reasoning_effort %s", model, chosen)
        return self._chosen[model]


async def _probed(render: Render) -> str:
    none = await render("none")
    if none is None:
        return "low"
    for effort in _THINKING:
        if await render(effort) == none:
            return "low"
    return "none"
