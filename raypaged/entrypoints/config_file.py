"""vLLM's ``--config FILE.yaml``: a YAML mapping of flag names (long form, no ``--``) to values.

The file's flags come first and the command line's after them, so the command line wins:
a flag given on both keeps only the command line's value (repeatable flags included), and
the model as the first argument replaces the file's ``model``. ``true`` turns a switch on,
``false`` writes its ``--no-`` form where it has one; a list gives a flag several values; a
mapping is passed as JSON. A key that is not a flag of the command is an error naming it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from raypaged.entrypoints.vllm_options import LEGACY_FLAGS

CONFIG_FLAG = "--config"


def dashed(args: Sequence[str]) -> list[str]:
    """Long flags spelled with underscores as with dashes (``--tokenizer_mode`` is ``--tokenizer-mode``), as vLLM's
    parser takes them; a value after ``=`` is left as it is, and so is everything after ``--``."""
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + list(args[i:])
        if arg.startswith("--") and "_" in (name := arg.partition("=")[0]):
            arg = name.replace("_", "-") + arg[len(name) :]
        out.append(arg)
    return out


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` that reads ``--config FILE`` where the command defines that flag."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.flags: dict[str, argparse.Action] = {}  # every option string (set before argparse adds -h)
        self.repeated: set[argparse.Action] = set()  # options given once per value (action="append")
        self.positional_dests: set[str] = set()
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        for option in action.option_strings:
            self.flags[option] = action
        if not action.option_strings:
            self.positional_dests.add(action.dest)
        if kwargs.get("action") == "append" and action.nargs is None:
            self.repeated.add(action)
        return action

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        args = dashed(sys.argv[1:] if args is None else args)
        for arg in args:
            flag = arg.partition("=")[0]
            if flag in LEGACY_FLAGS and flag not in self.flags:
                self.error(f"{flag} is no longer a vLLM flag: {LEGACY_FLAGS[flag]}")
        if CONFIG_FLAG in self.flags:
            args = self._with_config_file(args)
        return super().parse_known_args(args, namespace)

    def _with_config_file(self, args: list[str]) -> list[str]:
        """``args`` without ``--config FILE``, behind the file's flags that the command line does not give."""
        paths = [i for i, a in enumerate(args) if a == CONFIG_FLAG or a.startswith(CONFIG_FLAG + "=")]
        if not paths:
            return args
        if len(paths) > 1:
            self.error(f"{CONFIG_FLAG} is given {len(paths)} times; give one file")
        i = paths[0]
        if args[i] == CONFIG_FLAG:
            if i + 1 >= len(args):
                self.error(f"{CONFIG_FLAG} needs a YAML file")
            path, rest = args[i + 1], args[:i] + args[i + 2 :]
        else:
            path, rest = args[i].partition("=")[2], args[:i] + args[i + 1 :]
        given = {action.dest for action in map(self._action_of, rest) if action is not None}
        positional_model = self._has_positional_model(rest)
        tokens: list[str] = []
        for key, value in self._read(path).items():
            flag = "--" + str(key).removeprefix("--").replace("_", "-")
            action = self.flags.get(flag)
            if action is None or flag == CONFIG_FLAG:
                self.error(
                    f"{CONFIG_FLAG} {path}: {key!r} is not a flag of this command (keys are flag names "
                    "without the leading --, as max-model-len)"
                )
            if action.dest in given or (action.dest == "model" and positional_model):
                continue  # the command line wins
            try:
                tokens += _tokens(flag, action, value, action in self.repeated)
            except ValueError as exc:
                self.error(f"{CONFIG_FLAG} {path}: {exc}")
        return tokens + rest

    def _read(self, path: str) -> dict[Any, Any]:
        try:
            data = yaml.safe_load(Path(path).expanduser().read_text())
        except (OSError, yaml.YAMLError) as exc:
            self.error(f"{CONFIG_FLAG} {path} cannot be read: {exc}")
        if data is None:
            return {}
        if not isinstance(data, dict):
            self.error(
                f"{CONFIG_FLAG} {path} must be a YAML mapping of flag names to values, got {type(data).__name__}"
            )
        return data

    def _action_of(self, arg: str) -> argparse.Action | None:
        """The option ``arg`` names (``--flag``, ``--flag=value`` or an unambiguous prefix, as argparse reads it)."""
        if not arg.startswith("-") or arg == "--":
            return None
        name = arg.partition("=")[0]
        if name in self.flags:
            return self.flags[name]
        matches = {self.flags[f] for f in self.flags if name.startswith("--") and f.startswith(name)}
        return matches.pop() if len(matches) == 1 else None

    def _has_positional_model(self, args: list[str]) -> bool:
        """The command line gives the model as its first argument (``serve MODEL``)."""
        if "model_tag" not in self.positional_dests:
            return False
        namespace, _ = argparse.ArgumentParser.parse_known_args(self, args, argparse.Namespace())
        return getattr(namespace, "model_tag", None) is not None


def _tokens(flag: str, action: argparse.Action, value: Any, repeated: bool) -> list[str]:
    """Command-line words for one ``flag: value`` of the file (``repeated``: the flag takes one value per use)."""
    name = flag[2:]
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise ValueError(f"{name} is a switch: give true or false, got {value!r}")
        if value:
            return [flag]
        negative = "--no-" + name
        return [negative] if negative in action.option_strings else []
    if value is None:
        raise ValueError(f"{name} has no value")
    values = value if isinstance(value, list) else [value]
    words = [json.dumps(v) if isinstance(v, dict) else str(v) for v in values]
    if repeated:
        return [word for w in words for word in (flag, w)]
    if len(words) > 1 and action.nargs not in ("+", "*"):
        raise ValueError(f"{name} takes one value, got {value!r}")
    return [flag, *words]
