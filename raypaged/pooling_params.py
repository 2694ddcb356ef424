"""``PoolingParams``: what one request to an embedding model (``--runner pooling``) asks for, as vLLM's."""

from __future__ import annotations

from dataclasses import dataclass

# "encode": the pooled hidden state as the model's pooler gives it; "classify", "score": a classifier's scores
POOLING_TASKS = ("embed", "encode", "classify", "score")


@dataclass(slots=True)
class PoolingParams:
    """``truncate_prompt_tokens``: keep the prompt's last k tokens (-1: as many as ``max_model_len`` holds).
    ``dimensions``: the embedding's first N values, normalized again (matryoshka models only).
    ``use_activation``: L2-normalize the embedding (``None``: the pooler's default, see ``PoolerSettings``);
    ``normalize`` is vLLM's older name of the same switch; on a classifier, the softmax (sigmoid for one label).
    ``task``: ``embed``, ``encode``, ``classify`` or ``score`` (``None``: what the model serves)."""

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        if self.truncate_prompt_tokens is not None and (
            isinstance(self.truncate_prompt_tokens, bool)
            or not isinstance(self.truncate_prompt_tokens, int)
            or self.truncate_prompt_tokens < -1
            or self.truncate_prompt_tokens == 0
        ):
            raise ValueError(
                f"truncate_prompt_tokens must be -1 or a positive integer, got {self.truncate_prompt_tokens!r}"
            )
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        for name in ("normalize", "use_activation"):
            if (value := getattr(self, name)) is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
        if self.normalize is not None and self.use_activation is not None and self.normalize != self.use_activation:
            raise ValueError(
                f"normalize ({self.normalize}) and use_activation ({self.use_activation}) are the same switch "
                "(normalize is its older name): give one"
            )
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")

    @property
    def wants_normalize(self) -> bool | None:
        """The request's normalization switch under either name (``None``: the pooler's default)."""
        return self.use_activation if self.use_activation is not None else self.normalize
