"""vLLM's human-readable integers on the command line: ``25.6k`` is 25,600 (k, m, g, t: powers of 1,000) and
``32K`` is 32,768 (K, M, G, T: powers of 1,024, whole numbers only)."""

from __future__ import annotations

import argparse
import re

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SUFFIXED = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])")


def human_int(text: str) -> int:
    """``text`` as an int: plain digits, or a number with one of the suffixes above (argparse's ``type``)."""
    value = text.strip()
    match = _SUFFIXED.fullmatch(value)
    if match is None:
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not an integer (a number, or one with k/m/g/t for 1,000s or K/M/G/T for 1,024s)"
            ) from None
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"{text!r}: {suffix} counts 1,024s and takes whole numbers; {number}{suffix.lower()} counts 1,000s"
        )
    return int(number) * _BINARY[suffix]


def human_int_or_auto(text: str) -> int:
    """``human_int``, or ``-1`` for ``auto`` (vLLM's ``--max-model-len auto``: the longest that fits)."""
    return -1 if text.strip().lower() == "auto" else human_int(text)
