"""vLLM options that are no option of raypaged's own (the tables are in ``vllm_options``): the flags that take
them, and their check. Engine options are shared by the command line and ``LLM(**kwargs)``."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable, Sequence

from raypaged.entrypoints.switch import Switch, negative_forms
from raypaged.entrypoints.vllm_options import ANY_VALUE, DEFAULT_ONLY, SERVER_ANY_VALUE, SERVER_DEFAULT_ONLY, Option


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_default_only(values: dict[str, object], as_flags: bool, options: Sequence[Option] = DEFAULT_ONLY) -> None:
    """Refuse, by name (a flag or a keyword), an option of ``options`` set to a value it is not taken at."""
    for name, _, _, allowed, why in options:
        value = values.get(name, allowed[0])
        if value in allowed:
            continue
        why = explain(why, as_flags)
        if isinstance(value, bool) and as_flags:  # a switch: --name, or its negative form (--disable-x, --no-x)
            shown = flag(name) if value else negative_forms(flag(name))[0]
        elif isinstance(value, list) and as_flags:
            shown = " ".join([flag(name), *map(str, value)])
        else:
            shown = f"{flag(name)} {value}" if as_flags else f"{name}={value!r}"
        raise ValueError(f"{shown} is not supported: {why}")


def add_vllm_args(parser: argparse.ArgumentParser, server: bool = False) -> None:
    """The flags of vLLM's engine options (``server``: its gateway options instead) that are no flag of
    raypaged's own: each is taken at the values it is honoured at (``check_vllm_args`` refuses the others by
    name) or, where it changes nothing here, at any value, with the reason in its help."""
    for name, shorts, kind, allowed, why in SERVER_DEFAULT_ONLY if server else DEFAULT_ONLY:
        names = (flag(name), *shorts)
        taken = explain(why, as_flags=True)
        if kind is bool:  # a switch, --name / --disable-x or --no-name
            state = "on" if True in allowed else "off"
            parser.add_argument(*names, action=Switch, default=allowed[0], help=f"taken {state} only: {taken}")
            continue
        shown = next((value for value in allowed if value is not None), None)
        taken = f"taken at {shown} only: {taken}" if shown is not None else f"not taken: {taken}"
        many = {"nargs": "+"} if kind is list else {"type": kind}
        parser.add_argument(*names, default=allowed[0], help=taken, **many)
    for name, (kind, why) in (SERVER_ANY_VALUE if server else ANY_VALUE).items():
        accepted = f"accepted for vLLM command lines: {explain(why, as_flags=True)}"
        if kind is bool:
            parser.add_argument(flag(name), action=Switch, default=None, help=accepted)
        else:
            parser.add_argument(flag(name), type=kind, default=None, help=accepted)


# vLLM's older --task: the pooling tasks as the --runner and --convert they became
_TASKS = {"embed": "embed", "classify": "classify", "score": "classify"}


def task_as_runner(task: object, runner: str, convert: str, as_flags: bool) -> tuple[object, str, str]:
    """vLLM's older ``task`` (embed, classify, score) as ``runner`` pooling and its ``convert``; (the task left to
    check, runner, convert). A task that contradicts a runner or convert given with it is refused naming both."""
    if task not in _TASKS:
        return task, runner, convert
    wanted = _TASKS[str(task)]
    if runner not in ("auto", "pooling") or convert not in ("auto", wanted):
        names = (flag("task"), flag("runner"), flag("convert")) if as_flags else ("task", "runner", "convert")
        raise ValueError(
            f"{names[0]} {task} asks for {names[1]} pooling with {names[2]} {wanted}, but {names[1]} {runner} and "
            f"{names[2]} {convert} were given"
        )
    return "auto", "pooling", wanted


def check_vllm_args(args: argparse.Namespace, server: bool = False) -> None:
    """Refuse, by name, what a vLLM command line asks for and this engine (``server``: gateway) cannot do."""
    options = SERVER_DEFAULT_ONLY if server else DEFAULT_ONLY
    check_default_only({name: getattr(args, name) for name, *_ in options}, as_flags=True, options=options)


def explain(why: str, as_flags: bool) -> str:
    """``why`` with the options it names spelled as flags or as ``LLM`` keywords."""
    return why.format_map(_Spelling(as_flags))


class _Spelling(dict):
    def __init__(self, as_flags: bool) -> None:
        super().__init__()
        self.as_flags = as_flags

    def __missing__(self, name: str) -> str:
        return flag(name) if self.as_flags else name


def unknown_keyword(name: str, known: Iterable[str], also: Iterable[str] = ()) -> TypeError:
    """The error for an ``LLM`` keyword that is neither an engine field nor a vLLM option taken here: the closest
    of ``known`` (the engine's keywords) is suggested, else the closest of ``also`` (the vLLM options)."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    close = close or difflib.get_close_matches(name, list(also), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return TypeError(f"LLM got an unexpected keyword argument {name!r}{hint}")
