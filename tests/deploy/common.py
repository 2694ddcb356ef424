"""Loading the deployment artefacts, and turning their command lines into parsed ``raypaged`` arguments."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
from pathlib import Path

import yaml

from raypaged.config import EngineConfig
from raypaged.entrypoints.cli import build_parser, engine_kwargs

REPO = Path(__file__).resolve().parents[2]
DOCKER_DIR = REPO / "deploy" / "docker"
K8S_DIR = REPO / "deploy" / "k8s"
MONITORING_DIR = REPO / "deploy" / "monitoring"
DOCKERFILES = {"cuda": DOCKER_DIR / "Dockerfile", "cpu": DOCKER_DIR / "Dockerfile.cpu"}

# The server's --drain-timeout default: what the grace periods must outlast when no flag is given.
DEFAULT_DRAIN_TIMEOUT_S = 30.0


def k8s_documents() -> list[tuple[Path, dict]]:
    """Every Kubernetes object under deploy/k8s, with the file it comes from."""
    documents = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        documents.extend((path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc is not None)
    return documents


def k8s_object(kind: str, name: str) -> dict:
    matches = [doc for _, doc in k8s_documents() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def pod_templates() -> list[tuple[str, dict]]:
    """(description, pod template) of every workload under deploy/k8s."""
    templates = []
    for _, doc in k8s_documents():
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "Deployment":
            templates.append((name, doc["spec"]["template"]))
        elif doc["kind"] == "RayCluster":
            templates.append((f"{name} head", doc["spec"]["headGroupSpec"]["template"]))
            templates.extend(
                (f"{name} worker {group['groupName']}", group["template"]) for group in doc["spec"]["workerGroupSpecs"]
            )
    return templates


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined and comments dropped."""
    instructions, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        keyword, _, rest = full.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    return instructions


def dockerfile_exec_form(path: Path, keyword: str) -> list[str]:
    """The JSON (exec) form of the last ENTRYPOINT or CMD; [] when there is none."""
    values = [rest for key, rest in dockerfile_instructions(path) if key == keyword]
    if not values:
        return []
    parsed = json.loads(values[-1])
    assert isinstance(parsed, list), f"{path.name}: {keyword} must use the exec (JSON) form"
    return parsed


def parse_raypaged(argv: list[str]) -> argparse.Namespace:
    """``argv`` (starting with ``raypaged``) through the real CLI parser and engine-flag check.

    Fails with argparse's message on an unknown or malformed flag, and with the engine's
    message on a flag this build refuses.
    """
    assert argv and argv[0] == "raypaged", f"not a raypaged command line: {argv}"
    parser = build_parser()
    for sub in [parser, *_subcommand_parsers(parser)]:
        sub.allow_abbrev = False  # a renamed flag must not pass as a prefix of its new name
    try:
        args = parser.parse_args(argv[1:])
    except SystemExit as exc:  # argparse printed why to stderr
        raise AssertionError(f"raypaged rejects {shlex.join(argv)}") from exc
    if hasattr(args, "tensor_parallel_size"):
        accepted = {f.name for f in dataclasses.fields(EngineConfig) if f.init}
        for model in args.model or [None]:
            engine_kwargs(args, accepted, model)
    return args


def _subcommand_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [sub for action in actions for sub in action.choices.values()]


def raypaged_flags() -> set[str]:
    """Every option string of every ``raypaged`` sub-command."""
    parser = build_parser()
    return {
        option for sub in _subcommand_parsers(parser) for action in sub._actions for option in action.option_strings
    }


def drain_timeout_s(args: argparse.Namespace) -> float:
    return float(getattr(args, "drain_timeout", None) or DEFAULT_DRAIN_TIMEOUT_S)


def shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a shell script, split at ``;``, ``&&``, ``||`` and ``|``."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if token in (";", "&&", "||", "|", "&"):
            if current:
                commands.append(current)
            current = []
        else:
            current.append(token)
    if current:
        commands.append(current)
    return commands


def expand(word: str, env: dict[str, str]) -> str:
    """``$NAME`` and ``${NAME}`` replaced from ``env``; an unknown name fails."""

    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        assert name in env, f"{word!r} uses ${name}, which the container does not set"
        return env[name]

    return re.sub(r"\$(?:\{(\w+)\}|(\w+))", value, word)


def container_raypaged_argv(container: dict) -> list[str] | None:
    """The ``raypaged`` command line a container runs, or None when it runs none.

    No ``command``: the image's ENTRYPOINT followed by the container's ``args`` (which replace CMD).
    A ``bash -c`` command: the script's ``raypaged`` (or ``exec raypaged``) command, with the
    container's ``env`` expanded.
    """
    env = {item["name"]: item["value"] for item in container.get("env", []) if "value" in item}
    command = container.get("command")
    if command is None:
        return dockerfile_exec_form(DOCKERFILES["cuda"], "ENTRYPOINT") + list(container.get("args", []))
    assert command[:2] == ["/bin/bash", "-c"], f"unexpected command {command}"
    (script,) = container["args"]
    for words in shell_commands(script):
        if words[0] == "exec":
            words = words[1:]
        if words[0] == "raypaged":
            return [expand(word, env) for word in words]
    return None
