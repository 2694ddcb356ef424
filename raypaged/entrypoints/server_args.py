"""The HTTP gateway's flags (``raypaged serve`` and ``raypaged gateway``, vLLM's names) and the gRPC engine's
shared ones (API keys, draining), read into ``GatewayOptions``."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from raypaged import envs
from raypaged.config import json_flag_value
from raypaged.entrypoints.logging_setup import logging_setup
from raypaged.entrypoints.switch import Switch
from raypaged.entrypoints.vllm_compat import add_vllm_args, check_vllm_args
from raypaged.serving.gateway.efforts import AUTO, DISABLED_THINKING_EFFORTS
from raypaged.serving.gateway.fingerprint import FINGERPRINT_MODES
from raypaged.serving.gateway.replicas import ROUTING

if TYPE_CHECKING:
    from raypaged.serving.launch import GatewayOptions

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_drain_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--drain-timeout",
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT: how long in-flight requests may run before they are aborted (0: at once)",
    )


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    parser.add_argument("--uds", default=None, metavar="PATH", help="serve HTTP on this Unix socket, not --host/--port")
    add_api_key_arg(
        parser, "require one of these keys as 'Authorization: Bearer KEY' (repeatable; default: $RAYPAGED_API_KEY)"
    )
    parser.add_argument(
        "--auth-exempt-paths",
        default="/health,/metrics",
        metavar="PATHS",
        help="comma-separated paths open without a key when keys are set ('' protects every path)",
    )
    parser.add_argument("--tenants", default=None, help="YAML file of tenants: API keys, limits, priorities")
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=16 * 1024 * 1024,
        metavar="BYTES",
        help="larger request bodies are refused with 413",
    )
    parser.add_argument(
        "--enable-log-requests",
        action=Switch,
        default=False,
        help="a log line per request (off by default, as vLLM; --disable-log-requests is vLLM's older flag)",
    )
    parser.add_argument(
        "--enable-log-outputs",
        action=Switch,
        default=False,
        help="with --enable-log-requests: a log line with what each request generated",
    )
    parser.add_argument(
        "--enable-log-deltas",
        action=Switch,
        default=True,
        help="with --enable-log-outputs: a streamed request logs each delta too (default: on)",
    )
    parser.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        metavar="N",
        help="logged outputs: texts and token id lists cut to N characters and ids (default: whole)",
    )
    parser.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=UVICORN_LOG_LEVELS,
        help="log level of the HTTP server, uvicorn (default: --log-level)",
    )
    parser.add_argument(
        "--disable-uvicorn-access-log",
        action=Switch,
        default=False,
        help="no uvicorn access-log line per HTTP request",
    )
    parser.add_argument(
        "--disable-access-log-for-endpoints",
        default=None,
        metavar="PATHS",
        help="comma-separated paths (e.g. /health,/metrics) whose requests get no access-log line",
    )
    parser.add_argument(
        "--log-config-file",
        default=None,
        metavar="FILE.json",
        help="logging configuration (logging.config.dictConfig's JSON) for raypaged's and uvicorn's loggers",
    )
    parser.add_argument(
        "--log-error-stack",
        action=Switch,
        default=False,
        help="log each error response (4xx and 5xx) with the stack of the exception behind it",
    )
    parser.add_argument(
        "--enable-server-load-tracking",
        action=Switch,
        default=False,
        help="accepted for vLLM command lines: GET /load always reports the generation requests in flight",
    )
    parser.add_argument(
        "--disable-fastapi-docs",
        action=Switch,
        default=False,
        help="no OpenAPI document (/openapi.json); the Swagger and ReDoc pages are never served",
    )
    parser.add_argument("--ssl-keyfile", default=None, help="private key (PEM) for HTTPS, with --ssl-certfile")
    parser.add_argument("--ssl-certfile", default=None, help="certificate chain (PEM): serve HTTPS instead of HTTP")
    parser.add_argument(
        "--ssl-ca-certs", default=None, help="CA certificates (PEM) that client certificates must chain to"
    )
    parser.add_argument("--ssl-ciphers", default=None, help="TLS cipher suites (OpenSSL's syntax; TLS 1.2 and below)")
    parser.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        help="client certificates: 0 not asked, 1 optional, 2 required (Python's ssl.CERT_*)",
    )
    parser.add_argument(
        "--root-path",
        default="",
        help="the path prefix of a path-routing proxy in front (FastAPI's root_path): routes answer "
        "under it as well as without it",
    )
    parser.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=1024,
        metavar="N",
        help="completions requests with more prompts are refused with 400",
    )
    parser.add_argument(
        "--allowed-hosts",
        default=None,
        metavar="HOSTS",
        help="comma-separated Host names served besides localhost, 127.x.y.z and ::1 ('*': any); "
        "a loopback --host serves only loopback names without it (against DNS rebinding)",
    )
    parser.add_argument(
        "--allowed-origins",
        default=None,
        metavar="ORIGINS",
        help="CORS origins, a JSON list ('[\"https://a.example\"]') or comma-separated (default: no CORS)",
    )
    parser.add_argument(
        "--allowed-methods",
        default=None,
        metavar="METHODS",
        help="CORS methods with --allowed-origins, as that flag (default: '[\"*\"]')",
    )
    parser.add_argument(
        "--allowed-headers",
        default=None,
        metavar="HEADERS",
        help="CORS request headers with --allowed-origins, as that flag (default: '[\"*\"]')",
    )
    parser.add_argument("--allow-credentials", action=Switch, default=False, help="CORS: allow credentials")
    parser.add_argument(
        "--enable-auto-tool-choice",
        action=Switch,
        default=False,
        help='tool_choice "auto": the model decides, its calls are found by --tool-call-parser',
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="how tool calls look in the model's output: hermes, llama3_json, mistral, pythonic, llama4_pythonic, "
        "deepseek_v3, deepseek_v31, glm45, qwen3_coder, kimi_k2, granite, phi4_mini_json, openai (gpt-oss's harmony "
        "messages; implies "
        "--reasoning-parser openai_gptoss)",
    )
    parser.add_argument("--response-role", default="assistant", metavar="ROLE", help="the role of chat answers")
    parser.add_argument(
        "--return-tokens-as-token-ids",
        action=Switch,
        default=False,
        help="logprobs name every token 'token_id:{id}' (a request's return_tokens_as_token_ids does it for one)",
    )
    parser.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action=Switch,
        default=False,
        help="a chat request with tool_choice none renders its chat template without the tools",
    )
    parser.add_argument(
        "--enable-tokenizer-info-endpoint",
        action=Switch,
        default=False,
        help="serve GET /tokenizer_info: a model's tokenizer settings and the server's chat template, as vLLM "
        "(?model= picks one where several serve)",
    )
    parser.add_argument(
        "--enable-scale-out",
        action=Switch,
        default=False,
        help="serve vLLM's scale-out endpoints (without it they answer 403): POST /v1/completions/render, "
        "/v1/chat/completions/render, /v1/messages/render and /v1/responses/render (the engine-ready request of "
        "a body), /inference/v1/generate (tokens in, tokens out) and /inference/v1/abort_requests, and "
        "/v1/completions/derender and /v1/chat/completions/derender (the OpenAI answer of generated tokens)",
    )
    parser.add_argument(
        "--fingerprint-mode",
        choices=FINGERPRINT_MODES,
        default="full",
        help="answers' system_fingerprint: full (raypaged-VERSION[-tpN]-HASH of the engine's settings), hash "
        "(raypaged-VERSION-HASH), custom (--fingerprint-value) or none (null)",
    )
    parser.add_argument(
        "--fingerprint-value", default=None, metavar="TEXT", help="the system_fingerprint of --fingerprint-mode custom"
    )
    parser.add_argument(
        "--sse-keep-alive-interval",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="a stream with no event for this long sends a keep-alive comment, and again after each such wait "
        "(0: never)",
    )
    parser.add_argument(
        "--h11-max-incomplete-event-size",
        type=int,
        default=None,
        metavar="BYTES",
        help="most bytes of an HTTP request's head (request line and headers; default: h11's, 16 KiB); past it a 400",
    )
    parser.add_argument(
        "--h11-max-header-count",
        type=int,
        default=256,
        metavar="N",
        help="most headers of an HTTP request; past it a 400",
    )
    parser.add_argument(
        "--data-parallel-routing",
        choices=ROUTING,
        default="least_loaded",
        help="how a model served by several engines (-dp, or a name given to --engine more than once) picks one for "
        "a request: the one with the fewest requests in flight (vLLM's), or cache_aware: the one its conversation "
        "(or prompt prefix) hashes to, where its cached prefix is, unless that one is 4 requests busier",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action=Switch,
        default=False,
        help="usage.prompt_tokens_details.cached_tokens: prompt tokens read from the prefix cache",
    )
    parser.add_argument(
        "--enable-force-include-usage",
        action=Switch,
        default=False,
        help="every stream ends with a usage chunk, asked for or not",
    )
    parser.add_argument(
        "--enable-request-id-headers",
        action=Switch,
        default=False,
        help="answers carry X-Request-Id (the client's, or the response id)",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="deepseek_r1, deepseek_v3, ernie45, glm45, granite, minimax_m2, mistral, qwen3 or seed_oss: chat "
        "answers' reasoning section (<think>...</think>, [THINK]...[/THINK], ...) becomes reasoning_content "
        "(deepseek_v3's only when a request's chat_template_kwargs turn thinking or enable_thinking on); "
        "minimax_m2_append_think: the reasoning stays in the content, after <think>; openai_gptoss: gpt-oss's "
        "harmony analysis messages are the reasoning, its final messages the content",
    )
    parser.add_argument(
        "--reasoning-effort-map",
        default=None,
        metavar="JSON",
        help="JSON object rewriting requests' reasoning efforts (chat, responses, messages) to the chat template's "
        'names for them, e.g. \'{"medium": "low", "xhigh": "max"}\' (the others pass as they are)',
    )
    parser.add_argument(
        "--anthropic-disabled-thinking-effort",
        default=AUTO,
        choices=DISABLED_THINKING_EFFORTS,
        help="the reasoning_effort of Messages requests with thinking disabled: none (no thinking), an effort for "
        "models that always think, or auto (per model: low where the chat template refuses none or renders it as "
        "a thinking effort, else none)",
    )
    add_drain_arg(parser)
    add_vllm_args(parser, server=True)


def add_api_key_arg(parser: argparse.ArgumentParser, help_text: str) -> None:
    parser.add_argument("--api-key", action="extend", nargs="+", default=None, metavar="KEY", help=help_text)


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The ``--api-key`` keys (any one is accepted), else ``$RAYPAGED_API_KEY``; none: no key needed."""
    if args.api_key is None:
        key = envs.api_key()
        return (key,) if key else ()
    if not all(args.api_key):
        raise ValueError("--api-key takes non-empty keys")
    return tuple(args.api_key)


def gateway_options(args: argparse.Namespace) -> GatewayOptions:
    from raypaged.serving.gateway.guard import check_exempt_paths
    from raypaged.serving.gateway.output_log import OutputLogging
    from raypaged.serving.launch import GatewayOptions

    def names(flag_name: str, value: str) -> tuple[str, ...]:
        """A JSON list of strings (as vLLM takes it) or a comma-separated list."""
        if not value.strip().startswith("["):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
            raise ValueError(f"{flag_name} takes a JSON list of strings or a comma-separated list, got {value!r}")
        return tuple(parsed)

    check_vllm_args(args, server=True)
    log_setup = logging_setup(args)
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be at least 0, got {args.max_log_len}")
    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be at least 1, got {args.max_request_body_bytes}")
    if args.max_prompts_per_request < 1:
        raise ValueError(f"--max-prompts-per-request must be at least 1, got {args.max_prompts_per_request}")
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be at least 0 seconds, got {args.drain_timeout:g}")
    exempt = tuple(p.strip() for p in args.auth_exempt_paths.split(",") if p.strip())
    check_exempt_paths(exempt)
    origins = names("--allowed-origins", args.allowed_origins) if args.allowed_origins is not None else ()
    cors_flags = {
        "--allowed-methods": args.allowed_methods,
        "--allowed-headers": args.allowed_headers,
        "--allow-credentials": args.allow_credentials or None,
    }
    for cors_flag, value in cors_flags.items():
        if value is not None and not origins:
            raise ValueError(f"{cors_flag} needs --allowed-origins (without it the server sends no CORS headers)")
    return GatewayOptions(
        host=args.host,
        port=args.port,
        uds=args.uds,
        api_key=api_keys(args),
        tenants_file=args.tenants,
        log_requests=args.enable_log_requests,
        output_logging=OutputLogging(args.enable_log_deltas, args.max_log_len) if args.enable_log_outputs else None,
        log_level=log_setup.level,
        uvicorn_log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        access_log_skip_paths=names("--disable-access-log-for-endpoints", args.disable_access_log_for_endpoints or ""),
        log_config=log_setup.dict_config,
        log_error_stack=args.log_error_stack,
        h11_max_header_count=args.h11_max_header_count,
        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
        openapi_docs=not args.disable_fastapi_docs,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        root_path=args.root_path,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        ssl_ciphers=args.ssl_ciphers,
        max_body_bytes=args.max_request_body_bytes,
        drain_timeout_s=args.drain_timeout,
        auth_exempt_paths=exempt,
        max_prompts_per_request=args.max_prompts_per_request,
        allowed_hosts=names("--allowed-hosts", args.allowed_hosts) if args.allowed_hosts is not None else None,
        allowed_origins=origins,
        allowed_methods=names("--allowed-methods", args.allowed_methods or '["*"]'),
        allowed_headers=names("--allowed-headers", args.allowed_headers or '["*"]'),
        allow_credentials=args.allow_credentials,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        response_role=args.response_role,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        enable_scale_out=args.enable_scale_out,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        fingerprint_mode=args.fingerprint_mode,
        fingerprint_value=args.fingerprint_value,
        sse_keep_alive_s=args.sse_keep_alive_interval,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        data_parallel_routing=args.data_parallel_routing,
        enable_force_include_usage=args.enable_force_include_usage,
        enable_request_id_headers=args.enable_request_id_headers,
        reasoning_parser=args.reasoning_parser,
        reasoning_effort_map=(
            json_flag_value("--reasoning-effort-map", args.reasoning_effort_map) if args.reasoning_effort_map else None
        ),
        anthropic_disabled_thinking_effort=args.anthropic_disabled_thinking_effort,
        default_chat_template_kwargs=_template_kwargs(getattr(args, "default_chat_template_kwargs", None)),
    )


def _template_kwargs(value: Any) -> dict[str, Any] | None:
    """The engines' ``--default-chat-template-kwargs`` (``serve``'s flag; a gateway alone has none), parsed."""
    if value is None or isinstance(value, dict):
        return value
    return json_flag_value("--default-chat-template-kwargs", value)


def options_check(options: GatewayOptions) -> None:
    """Reads the tenants file now, so a bad one fails before any model loads (``serve``'s gRPC server reads it too)."""
    from raypaged.serving.gateway.guard import tenants_for

    tenants_for(options.api_keys, options.tenants_file)
