"""A model's transformers config as the Ray shards receive it.

Unpickling a config of an architecture's own class (``LlamaConfig``, ...) imports that class's module, and with it
transformers' validators, its kernel hub and its checkpoint conversions, which import ``torch.distributed.tensor``
and ``accelerate``: 1.0 s of each shard's start on this 2-core machine, for values a shard only reads. A shard
gets the same values on transformers' base ``PretrainedConfig`` instead, where that is certain to change nothing.
"""

from __future__ import annotations

import inspect
from typing import Any

from transformers import PretrainedConfig

# what a config class may define over PretrainedConfig and still travel as the base: checks of a config as it is
# built (the driver built and checked it); nothing that reads a built config calls them
_CHECKS_ONLY = frozenset({"validate", "validate_architecture"})
_MISSING = object()


class ShardModelConfig(PretrainedConfig):
    """A config's values on transformers' base class (:func:`portable_config`): ``class_values`` names those that
    were its class's (``model_type``, ``attribute_map``, ...), which ``to_dict`` leaves out as the class's did."""

    class_values: frozenset[str]

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in super().to_dict().items() if k not in self.class_values and k != "class_values"}
        out["model_type"] = self.model_type  # the base's to_dict takes its class's, which is empty
        return out


def portable_config(config: PretrainedConfig) -> PretrainedConfig:
    """``config`` on transformers' base class (a :class:`ShardModelConfig`): its own values, and its class's
    constants and properties as values of its own; or ``config`` itself where that could change what a shard
    reads: its class defines a method of its own (rope conversions, ``to_dict``), or it holds sub-configs."""
    cls = type(config)
    state = vars(config)
    if cls is PretrainedConfig or _defines_code(cls) or any(isinstance(v, PretrainedConfig) for v in state.values()):
        return config
    names = _class_names(cls)
    portable = ShardModelConfig.__new__(ShardModelConfig)
    portable.__dict__.update(state)  # shared values: the shards get them pickled
    portable.__dict__["class_values"] = frozenset(names - state.keys())
    for name in portable.class_values:
        if (value := _value(config, name)) is not _MISSING:
            portable.__dict__[name] = value
    if not all(_same(_value(portable, name), _value(config, name)) for name in names | state.keys()):
        return config
    if portable.to_dict() != config.to_dict():
        return config
    return portable


def _defines_code(cls: type) -> bool:
    """Whether ``cls`` defines a method that PretrainedConfig lacks or has otherwise."""
    for name in dir(cls):
        if name.startswith("__") or name in _CHECKS_ONLY:
            continue
        own = inspect.getattr_static(cls, name)
        if own is not inspect.getattr_static(PretrainedConfig, name, None) and (
            callable(own) or isinstance(own, (classmethod, staticmethod))
        ):
            return True
    return False


def _class_names(cls: type) -> set[str]:
    """The names of the constants and properties the classes between ``cls`` and PretrainedConfig define."""
    below = cls.__mro__[: cls.__mro__.index(PretrainedConfig)]
    return {name for klass in below for name in vars(klass) if not name.startswith("__")} - _CHECKS_ONLY


def _value(config: PretrainedConfig, name: str) -> Any:
    try:
        return getattr(config, name)
    except Exception:  # a property that cannot answer for this config
        return _MISSING


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False
