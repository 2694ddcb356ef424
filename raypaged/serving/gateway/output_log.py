"""vLLM's ``--enable-log-outputs``: a log line with what a request generated, as its responses pass the gateway.

A streamed request logs each delta (``--enable-log-deltas``, on by default) and then the whole of each choice
(``(streaming complete)``); one that is not streamed logs each choice once. Texts and token id lists are cut to
``--max-log-len`` (characters and ids)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from raypaged.serving.gateway.responses import FINISH_REASONS
from raypaged.serving.messages import AnyResponse

logger = logging.getLogger("raypaged")


@dataclass(frozen=True)
class OutputLogging:
    """The gateway's output-logging flags."""

    deltas: bool = True  # a streamed request logs each delta too
    max_len: int | None = None  # texts and token id lists logged are cut to this length


@dataclass
class OutputLog:
    """One request's generated outputs, logged as they pass (``feed``) and when they end (``finish``)."""

    settings: OutputLogging
    request_id: str
    n: int  # choices per prompt
    streaming: bool
    texts: dict[int, str] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    reasons: dict[int, str | None] = field(default_factory=dict)

    def feed(self, prompt_index: int, response: AnyResponse) -> None:
        for delta in response.outputs:
            choice = prompt_index * self.n + delta.index
            reason = FINISH_REASONS[delta.finish_reason]
            self.texts[choice] = self.texts.get(choice, "") + delta.text
            self.token_ids.setdefault(choice, []).extend(delta.token_ids)
            self.reasons[choice] = None if reason is None else reason.value
            if self.streaming and self.settings.deltas:
                self._log(" (streaming delta)", choice, delta.text, list(delta.token_ids), self.reasons[choice])

    def finish(self) -> None:
        where = " (streaming complete)" if self.streaming else ""
        for choice in sorted(self.texts):
            self._log(where, choice, self.texts[choice], self.token_ids[choice], self.reasons[choice])

    def _log(self, where: str, choice: int, text: str, token_ids: list[int], reason: str | None) -> None:
        cut = self.settings.max_len
        shown = self.request_id if self.n == 1 and not choice else f"{self.request_id} choice {choice}"
        logger.info(
            "Generated response %s%s: output: %r, output_token_ids: %s, finish_reason: %s",
            shown,
            where,
            text if cut is None else text[:cut],
            token_ids if cut is None else token_ids[:cut],
            reason,
        )
