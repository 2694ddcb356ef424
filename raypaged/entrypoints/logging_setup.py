"""How a command logs: ``--log-level``, vLLM's ``--logging-config`` (its ``log_level``, ``formatter`` and
``pylogging_config_file``) and ``--log-config-file``, read into a ``LoggingSetup``. ``--log-level`` and
``--log-config-file`` win over the fields they match, as in vLLM; a dictConfig file wins over the formatter."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from typing import Any

from raypaged import envs
from raypaged.config import json_flag_value

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
FORMATTERS = ("text", "json")
_FIELDS = ("log_level", "formatter", "configure_logging", "pylogging_config_file")
_LOGGERS = ("raypaged", "uvicorn", "uvicorn.access")  # uvicorn.error propagates to uvicorn


@dataclass(frozen=True, slots=True)
class LoggingSetup:
    """The ``raypaged`` logger's level, and a ``logging.config.dictConfig`` mapping for raypaged's and uvicorn's
    loggers (a file's, or the JSON lines'), or ``None``: raypaged's text lines and uvicorn's own."""

    level: str
    dict_config: dict[str, Any] | None = None


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``time``, ``level``, ``logger``, ``message`` (and ``exception``)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        type=str.lower,
        default=None,
        choices=LOG_LEVELS,
        help="raypaged's log level, in any case (default: --logging-config's, else $RAYPAGED_LOG_LEVEL or info)",
    )
    parser.add_argument(
        "--logging-config",
        default=None,
        metavar="JSON",
        help='vLLM\'s: \'{"log_level": "DEBUG", "formatter": "json", "pylogging_config_file": PATH}\' (formatter '
        "text or json, one JSON object a log line; the file: logging.config.dictConfig's JSON, as --log-config-file)",
    )


def logging_setup(args: argparse.Namespace) -> LoggingSetup:
    """The command's logging; ``ValueError`` naming the flag for what it cannot honour."""
    given = json_flag_value("--logging-config", args.logging_config) if args.logging_config else {}
    if not isinstance(given, dict):
        raise ValueError(f"--logging-config takes a JSON object, got {args.logging_config!r}")
    unknown = [key for key in given if key not in _FIELDS]
    if unknown:
        raise ValueError(f"--logging-config: unknown field {unknown[0]!r}; allowed: {', '.join(_FIELDS)}")
    if given.get("configure_logging", True) is not True:
        raise ValueError(
            "--logging-config configure_logging false is not supported: raypaged always configures its loggers "
            "(a pylogging_config_file replaces how)"
        )
    level = args.log_level or str(given.get("log_level") or envs.log_level()).lower()
    if level not in LOG_LEVELS:
        where = "--logging-config log_level" if "log_level" in given else "$RAYPAGED_LOG_LEVEL"
        raise ValueError(f"{where} must be one of {', '.join(LOG_LEVELS)} (in any case), got {level!r}")
    formatter = given.get("formatter", "text")
    if formatter not in FORMATTERS:
        raise ValueError(f"--logging-config formatter must be text or json, got {formatter!r}")
    path = getattr(args, "log_config_file", None)  # the gateway's commands have it
    if path is not None:
        return LoggingSetup(level, read_log_config(path, "--log-config-file"))
    if given.get("pylogging_config_file") is not None:
        path = given["pylogging_config_file"]
        return LoggingSetup(level, read_log_config(path, "--logging-config pylogging_config_file"))
    return LoggingSetup(level, _json_lines(level) if formatter == "json" else None)


def read_log_config(path: str, flag: str) -> dict[str, Any]:
    """The ``logging.config.dictConfig`` mapping (JSON) at ``path``; ``ValueError`` naming ``flag``."""
    try:
        with open(path, encoding="utf-8") as file:
            config = json.load(file)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} {path} is not JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("version") != 1:
        raise ValueError(f'{flag} {path} must hold a logging.config.dictConfig mapping with "version": 1')
    return config


def _json_lines(level: str) -> dict[str, Any]:
    """raypaged's and uvicorn's loggers writing JSON lines to stderr (uvicorn sets its own levels)."""
    logger = {"handlers": ["json"], "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": f"{__name__}.JsonFormatter"}},
        "handlers": {"json": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}},
        "loggers": {name: {**logger, "level": level.upper()} if name == "raypaged" else logger for name in _LOGGERS},
    }
