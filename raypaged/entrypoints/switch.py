"""Boolean flags spelled as vLLM 0.34 spells them: ``--enable-x`` is turned off by ``--disable-x`` and
``--disable-x`` by ``--enable-x``; any other ``--x`` by ``--no-x``. The ``--no-`` form of an ``--enable-`` or
``--disable-`` flag (vLLM's before 0.34) is taken too."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

_OPPOSITE_PREFIXES = {"--enable-": "--disable-", "--disable-": "--enable-"}


def negative_forms(option: str) -> tuple[str, ...]:
    """The flags that turn ``option`` (a long flag) off, vLLM 0.34's spelling first."""
    for prefix, opposite in _OPPOSITE_PREFIXES.items():
        if option.startswith(prefix):
            return opposite + option.removeprefix(prefix), "--no-" + option[2:]
    return ("--no-" + option[2:],)


class Switch(argparse.Action):
    """``action=Switch``: the option strings given set ``dest`` to True, the ``negative_forms`` of the long
    ones (added to the option strings) to False; the default is the ``default`` given (None: not given)."""

    def __init__(self, option_strings: Sequence[str], dest: str, default: Any = None, help: str | None = None) -> None:
        negatives = [no for option in option_strings if option.startswith("--") for no in negative_forms(option)]
        self.negatives = frozenset(negatives)
        super().__init__([*option_strings, *negatives], dest, nargs=0, default=default, help=help)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, option_string not in self.negatives)
