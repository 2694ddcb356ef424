"""``raypaged`` command line (vLLM flag names)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import inspect
import logging
import logging.config
import sys
from typing import Any

from raypaged import envs
from raypaged.config import CliFlag, EngineConfig, cli_flag, json_flag_value, resolve_model_path
from raypaged.entrypoints.config_file import CONFIG_FLAG, ArgumentParser
from raypaged.entrypoints.logging_setup import add_logging_args, logging_setup
from raypaged.entrypoints.run_batch import add_batch_args
from raypaged.entrypoints.server_args import (
    add_api_key_arg,
    add_drain_arg,
    add_gateway_args,
    api_keys,
    gateway_options,
    options_check,
)
from raypaged.entrypoints.switch import Switch
from raypaged.entrypoints.vllm_compat import add_vllm_args, check_vllm_args, task_as_runner
from raypaged.entrypoints.vllm_compat import flag as vllm_flag
from raypaged.inputs.limits import PROMPT_CHARS_PER_TOKEN, InputLimits, flag
from raypaged.structured.config import StructuredOutputsConfig

# EngineConfig's fields are flags generated from their CliFlag metadata (add_config_args), except:
# - model: generate takes one --model; serve and engine a repeatable --model and vLLM's positional MODEL,
#   one engine per model, so engine_kwargs takes the model as its argument
# - served_model_name: serve and engine only, one repeatable --served-model-name (several names) per
#   --model, paired with the models in engine_configs
# - limits: an InputLimits, one flag per InputLimits field (add_limit_args)
# and structured_outputs_config, whose flag is generated but whose value engine_kwargs reads together
# with --guided-decoding-backend (vLLM's older spelling of its backend) and --reasoning-parser (a gateway
# flag whose reasoning sections the constraints follow). The flags that are no field at all (--log-level,
# the vLLM flags of add_vllm_args) are written out where they are added.
_STRUCTURED = "structured_outputs_config"


def add_engine_args(parser: argparse.ArgumentParser, many_models: bool = False) -> None:
    if many_models:
        parser.add_argument(
            "--model",
            action="append",
            default=None,
            help="local model folder or Hugging Face Hub id (org/name); repeat to serve several "
            "(default: SmolLM2-135M-Instruct)",
        )
        parser.add_argument(
            "model_tag",
            nargs="?",
            default=None,
            metavar="MODEL",
            help="the model, as vLLM's positional argument (the same as a first --model)",
        )
        parser.add_argument(
            "--served-model-name",
            action="append",
            nargs="+",
            default=None,
            metavar="NAME",
            help="names clients use for the model (several: all reach it, the first is its own); "
            "one such flag per --model (default: the --model value)",
        )
    else:
        parser.add_argument(
            "--model",
            default=None,
            help="local model folder or Hugging Face Hub id (org/name) (default: SmolLM2-135M-Instruct)",
        )
    add_config_args(parser)
    # not a field: it sets structured_outputs_config's backend (see engine_kwargs)
    parser.add_argument(
        "--guided-decoding-backend",
        default=None,
        metavar="NAME",
        help="vLLM's older spelling of the structured outputs backend: xgrammar or auto",
    )
    for name, key, kind in _SPEC_SHORTCUTS:
        parser.add_argument(name, type=kind, default=None, help=f"speculative decoding's {key} (--speculative-config)")
    add_limit_args(parser)
    add_vllm_args(parser)
    add_logging_args(parser)  # not fields: the process's logging, set before any engine starts


def config_flag_fields() -> list[tuple[dataclasses.Field, CliFlag]]:
    """The ``EngineConfig`` init fields that are flags, with their metadata, in field order."""
    return [(f, meta) for f in dataclasses.fields(EngineConfig) if f.init and (meta := cli_flag(f)) is not None]


def flag_default(f: dataclasses.Field, meta: CliFlag) -> object:
    """A field's flag default: the field's, or ``None`` (not given) for ``unset`` and default-factory fields."""
    return None if meta.unset or f.default is dataclasses.MISSING else f.default


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ``EngineConfig`` field with ``CliFlag`` metadata: ``--field-name`` and its aliases,
    with the metadata's type, action, choices, metavar and help; a switch (``store_true``,
    ``BooleanOptionalAction``) is a ``Switch``, turned off as vLLM 0.34 turns it off."""
    for f, meta in config_flag_fields():
        switch = meta.action in ("store_true", argparse.BooleanOptionalAction)
        options: dict[str, Any] = {  # add_argument's keywords
            "type": meta.type,
            "nargs": meta.nargs,
            "const": meta.const,
            "action": Switch if switch else meta.action,
            "metavar": meta.metavar,
            "help": meta.help,
            "choices": None if meta.choices is None else list(meta.choices),
        }
        parser.add_argument(
            vllm_flag(f.name),
            *meta.aliases,
            default=flag_default(f, meta),
            **{key: value for key, value in options.items() if value is not None},
        )


_LIMIT_HELP = {
    "max_logprobs": "most top logprobs one token may ask for",
    "max_num_samples": "largest n and best_of of one request",
    "max_stop_strings": "most stop strings of one request",
    "max_stop_string_chars": "most characters of one stop string",
    "max_stop_token_ids": "most stop_token_ids of one request",
    "max_chat_messages": "most messages of one chat request",
    "max_prompt_chars": "most characters of prompt text before tokenization "
    f"(default {PROMPT_CHARS_PER_TOKEN} x max-model-len)",
}


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ``InputLimits`` field: larger requests are refused with 400 / INVALID_ARGUMENT."""
    defaults = InputLimits()
    for f in dataclasses.fields(InputLimits):
        parser.add_argument(flag(f.name), type=int, default=getattr(defaults, f.name), help=_LIMIT_HELP[f.name])


def input_limits(args: argparse.Namespace) -> InputLimits:
    return InputLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(InputLimits)})


def engine_kwargs(args: argparse.Namespace, accepted: set[str], model: str | None) -> dict:
    """Keyword arguments for ``LLM``/``EngineConfig`` (whose names are ``accepted``): each field flag's
    value under its field's name (a flag not given, ``None``, leaves the field's default).

    A flag whose field is not ``accepted`` is an error when set to anything but its default.
    """
    args.task, args.runner, args.convert = task_as_runner(args.task, args.runner, args.convert, as_flags=True)
    check_vllm_args(args)
    kwargs: dict = {"model": model}
    for f, meta in config_flag_fields():
        if f.name == _STRUCTURED:
            continue  # below, with the flags that also set it
        value = getattr(args, f.name)
        if f.name == "speculative_config":
            value = speculative_config_value(args)
        if value is not None and meta.parse is not None:
            value = meta.parse(vllm_flag(f.name), value)
        if value is None:
            continue
        if f.name in accepted:
            kwargs[f.name] = value
        elif value != flag_default(f, meta):
            raise ValueError(f"{vllm_flag(f.name)} is not available in this build of the engine")
    if "limits" in accepted:
        kwargs["limits"] = input_limits(args)
    kwargs[_STRUCTURED] = StructuredOutputsConfig.parse(  # constraints follow reasoning sections
        args.structured_outputs_config, args.guided_decoding_backend, getattr(args, "reasoning_parser", None)
    )
    return kwargs


# vLLM's shortcuts for keys of --speculative-config: (flag, key, type)
_SPEC_SHORTCUTS = (
    ("--spec-method", "method", str),
    ("--spec-model", "model", str),
    ("--spec-tokens", "num_speculative_tokens", int),
)


def speculative_config_value(args: argparse.Namespace) -> str | dict[str, Any] | None:
    """``--speculative-config``'s JSON text, or with ``--spec-method``, ``--spec-model`` or ``--spec-tokens``
    given, its object with those keys set; a key set both ways is an error naming both."""
    given = {
        key: value
        for name, key, _ in _SPEC_SHORTCUTS
        if (value := getattr(args, name[2:].replace("-", "_"))) is not None
    }
    if not given:
        return args.speculative_config
    config = json_flag_value("--speculative-config", args.speculative_config) if args.speculative_config else {}
    if not isinstance(config, dict):
        raise ValueError(f"--speculative-config takes a JSON object, got {args.speculative_config!r}")
    for name, key, _ in _SPEC_SHORTCUTS:
        if key in given and key in config:
            raise ValueError(f"{name} and --speculative-config's {key!r} both set {key}: give one of them")
    return {**config, **given}


def configure_logging(level: str | int) -> None:
    """Log lines to stderr; the ``raypaged`` logger at ``level`` (a name such as ``info``, or a number)."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("raypaged").setLevel(level.upper() if isinstance(level, str) else level)


def cmd_generate(args: argparse.Namespace) -> int:
    from raypaged import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args, set(inspect.signature(LLM).parameters), args.model))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.sampling_seed
    )
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        print(
            f"### prompt: {prompt}\n{completion.text}\n### {len(completion.token_ids)} tokens, "
            f"finish_reason={completion.finish_reason}\n"
        )
    return 0


def engine_configs(args: argparse.Namespace) -> list[EngineConfig]:
    """One ``EngineConfig`` per ``--model`` (none given: the default model)."""
    models = served_models(args)
    names = args.served_model_name or [None] * len(models)
    if len(names) != len(models):
        raise ValueError(
            f"give one --served-model-name per --model ({len(models)} models, {len(names)} names), or none"
        )
    names = [group if group is None or len(group) > 1 else group[0] for group in names]
    accepted = {f.name for f in dataclasses.fields(EngineConfig) if f.init}
    return [
        EngineConfig(served_model_name=name, **engine_kwargs(args, accepted, model))
        for model, name in zip(models, names)
    ]


def served_models(args: argparse.Namespace) -> list[str | None]:
    """The ``--model`` values (the positional one first); ``[None]``: the default model."""
    return ([args.model_tag] if args.model_tag else []) + (args.model or []) or [None]


def check_models(args: argparse.Namespace) -> None:
    """The engine flags read and every ``--model`` found (a Hub id downloaded if missing) as the engine will, so
    that a flag or model name that cannot work stops the command before the engine process builds anything (it
    imports no torch)."""
    accepted = {f.name for f in dataclasses.fields(EngineConfig) if f.init}
    for model in served_models(args):
        kwargs = engine_kwargs(args, accepted, model)
        resolve_model_path(model, kwargs.get("revision"), kwargs.get("download_dir"), token=kwargs.get("hf_token"))


def add_lora_modules_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=None,
        metavar="NAME=PATH",
        help='LoRA adapters served from the start, as vLLM: name=path, or JSON \'{"name": ..., '
        '"path": ..., "base_model_name": ...}\' (needs --enable-lora)',
    )


def lora_modules(args: argparse.Namespace) -> dict[str, tuple[str, str]]:
    """``--lora-modules`` as name -> (PEFT folder, base model name or "")."""
    if not args.lora_modules:
        return {}
    if not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    found: dict[str, tuple[str, str]] = {}
    for spec in args.lora_modules:
        if spec.lstrip().startswith("{"):
            entry = json_flag_value("--lora-modules", spec)
            unknown = set(entry) - {"name", "path", "base_model_name"}
            if unknown or not entry.get("name") or not entry.get("path"):
                raise ValueError(
                    f"--lora-modules takes name=path or JSON with name, path and base_model_name, got {spec!r}"
                )
            name, path, base = entry["name"], entry["path"], entry.get("base_model_name") or ""
        else:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules takes name=path or JSON, got {spec!r}")
            base = ""
        if name in found:
            raise ValueError(f"--lora-modules names {name!r} twice")
        found[name] = (path, base)
    return found


def add_metrics_prefix_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-prefix",
        default="raypaged",
        metavar="NAME",
        help="start every Prometheus metric name with NAME: (vllm: vLLM's names, for its Grafana "
        "dashboard, KEDA rules and inference gateways)",
    )


def add_share_prefix_cache_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--share-prefix-cache",
        action="store_true",
        help="with API keys: all tenants share prefix-cache blocks (default: each only its own)",
    )


def data_parallel_ranks(args: argparse.Namespace) -> int:
    """``raypaged serve``'s ``--data-parallel-size`` (and ``--data-parallel-size-local``, which can only be the same:
    every rank runs on this node), checked; ``args`` is left with one engine's values, as each rank's engine
    process reads them."""
    size, local = args.data_parallel_size, args.data_parallel_size_local
    if size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {size}")
    if local not in (None, size):
        raise ValueError(
            f"--data-parallel-size-local {local} is not supported: `raypaged serve` runs all "
            f"--data-parallel-size {size} ranks on this node"
        )
    if size > 1 and args.enable_expert_parallel:
        raise ValueError(
            f"--enable-expert-parallel with --data-parallel-size {size} is not supported: experts are split over "
            "each replica's tensor-parallel shards, never across data-parallel ranks"
        )
    if size == 1 and args.data_parallel_routing != "least_loaded":
        raise ValueError(
            f"--data-parallel-routing {args.data_parallel_routing} needs --data-parallel-size above 1 (one engine "
            "serves every request)"
        )
    args.data_parallel_size, args.data_parallel_size_local = 1, None
    return size


def cmd_serve(args: argparse.Namespace) -> int:
    from raypaged.serving.engine_process import EngineProcess, EngineProcessLost
    from raypaged.serving.listener import raise_open_files_limit

    raise_open_files_limit()  # before the engine processes start: they inherit it
    ranks = data_parallel_ranks(args)
    # the devices an engine takes: its shards, every pipeline stage's
    shards = (args.tensor_parallel_size or 1) * (getattr(args, "pipeline_parallel_size", None) or 1)
    # the engine processes import torch and the engine while this one reads its flags and imports the gateway
    engines = EngineProcess.for_ranks(ranks, shards) if envs.engine_process() else None
    for engine in engines or ():
        engine.launch()
    try:
        from raypaged.entrypoints import cli  # by its name also when run as __main__: the engine process unpickles it
        from raypaged.serving.launch import run_serve

        options = gateway_options(args)
        options_check(options)
        adapters = lora_modules(args)
        check_models(args)
        asyncio.run(
            run_serve(
                # built with the engines, in the engine process (which has no use for the command's function)
                functools.partial(cli.engine_configs, argparse.Namespace(**(vars(args) | {"func": None}))),
                args.grpc_host,
                args.grpc_port,
                options,
                args.share_prefix_cache,
                f"{args.metrics_prefix}:",
                adapters,
                engines,
                ranks,
                shards,
            )
        )
    except EngineProcessLost as exc:  # as vLLM's API server when its engine core dies: exit, to be restarted
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        for engine in engines or ():
            engine.discard()
    return 0


def cmd_engine(args: argparse.Namespace) -> int:
    from raypaged.serving.gateway.guard import tenants_for
    from raypaged.serving.launch import run_engine
    from raypaged.serving.listener import raise_open_files_limit

    raise_open_files_limit()
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be at least 0 seconds, got {args.drain_timeout:g}")
    tenants = tenants_for(api_keys(args), args.tenants)  # a bad file fails before models load
    adapters = lora_modules(args)
    asyncio.run(
        run_engine(
            engine_configs(args),
            args.grpc_host,
            args.grpc_port,
            args.drain_timeout,
            tenants,
            args.share_prefix_cache,
            f"{args.metrics_prefix}:",
            adapters,
        )
    )
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    from raypaged.serving.launch import parse_engine_targets, run_gateway
    from raypaged.serving.listener import raise_open_files_limit

    raise_open_files_limit()
    options = gateway_options(args)
    options_check(options)
    targets = parse_engine_targets(args.engine)
    if options.data_parallel_routing != "least_loaded" and all(len(a) == 1 for a in targets.values()):
        raise ValueError(
            f"--data-parallel-routing {options.data_parallel_routing} needs a model served by several engines "
            "(--engine NAME=host:port given more than once for a name)"
        )
    asyncio.run(run_gateway(targets, options))
    return 0


def cmd_run_batch(args: argparse.Namespace) -> int:
    from raypaged.entrypoints.run_batch import BatchJob, is_url, run_batch

    job = BatchJob.from_args(args)
    options = gateway_options(args)
    if options.data_parallel_routing != "least_loaded":
        raise ValueError("--data-parallel-routing is not supported by run-batch: one engine per model answers the file")
    try:
        run_batch(job, engine_configs(args), options, lora_modules(args))
    except KeyboardInterrupt:  # not main's quiet exit 0: the batch did not finish
        left = "was not uploaded" if is_url(job.output_file) else "holds only the results written so far"
        print(f"error: interrupted; {job.output_file} {left}", file=sys.stderr)
        return 130
    return 0


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        CONFIG_FLAG,
        metavar="FILE.yaml",
        help="YAML mapping of this command's flags (long names without --) to values; the command "
        "line wins over the file",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="raypaged", description="PagedAttention LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation for prompts given as flags or on stdin")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); default: one per stdin line")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    add_config_arg(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="engines, their gRPC server and the OpenAI-compatible HTTP gateway")
    add_engine_args(serve, many_models=True)
    add_gateway_args(serve)
    serve.add_argument("--grpc-host", default="127.0.0.1", help="gRPC address to listen on")
    serve.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (0 = a free one)")
    add_share_prefix_cache_arg(serve)
    add_metrics_prefix_arg(serve)
    add_lora_modules_arg(serve)
    add_config_arg(serve)
    serve.set_defaults(func=cmd_serve)

    engine = sub.add_parser("engine", help="engines behind the gRPC service only")
    add_engine_args(engine, many_models=True)
    engine.add_argument("--grpc-host", default="127.0.0.1", help="gRPC address to listen on")
    engine.add_argument("--grpc-port", type=int, default=50051, help="gRPC port")
    add_api_key_arg(
        engine,
        "require one of these keys as gRPC metadata 'authorization: Bearer KEY' (repeatable; "
        "default: $RAYPAGED_API_KEY); Health, Info and Metrics stay open",
    )
    engine.add_argument("--tenants", default=None, help="YAML file of tenants: API keys, limits, priorities")
    add_share_prefix_cache_arg(engine)
    add_metrics_prefix_arg(engine)
    add_lora_modules_arg(engine)
    add_drain_arg(engine)
    add_config_arg(engine)
    engine.set_defaults(func=cmd_engine)

    batch = sub.add_parser(
        "run-batch",
        help="answer a file of OpenAI Batch requests (JSON lines) offline, as vLLM's run-batch",
        usage="raypaged run-batch -i INPUT.jsonl -o OUTPUT.jsonl [--model MODEL] [flags]",
    )
    add_batch_args(batch)
    add_engine_args(batch, many_models=True)
    add_gateway_args(batch)
    add_lora_modules_arg(batch)
    add_config_arg(batch)
    batch.set_defaults(func=cmd_run_batch)

    gateway = sub.add_parser("gateway", help="the HTTP gateway in front of running engines")
    gateway.add_argument(
        "--engine",
        action="append",
        required=True,
        metavar="NAME=HOST:PORT",
        help="a served model name and the engine serving it (repeatable)",
    )
    add_gateway_args(gateway)
    add_logging_args(gateway)
    add_config_arg(gateway)
    gateway.set_defaults(func=cmd_gateway)
    return parser


def setup_logging(args: argparse.Namespace) -> None:
    """This process's logging from ``--log-level`` and ``--logging-config`` (``ValueError`` naming the flag)."""
    setup = logging_setup(args)
    configure_logging(setup.level)
    if setup.dict_config is not None:  # the gateway's uvicorn and the engine process apply it too
        logging.config.dictConfig(setup.dict_config)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        setup_logging(args)
        return args.func(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
