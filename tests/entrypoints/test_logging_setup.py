"""``--log-level``, vLLM's ``--logging-config`` and ``--log-config-file``: the level, JSON lines, a dictConfig file."""

import json
import logging
import logging.config
import re

import pytest

from raypaged.entrypoints.cli import build_parser
from raypaged.entrypoints.logging_setup import LoggingSetup, logging_setup
from raypaged.entrypoints.server_args import gateway_options


def setup(*argv: str) -> LoggingSetup:
    return logging_setup(build_parser().parse_args(["serve", *argv]))


def test_log_level_takes_vllm_034s_names_and_wins_over_the_logging_configs(monkeypatch):
    monkeypatch.delenv("RAYPAGED_LOG_LEVEL", raising=False)
    assert setup().level == "info"
    assert setup("--log-level", "DEBUG").level == "debug"
    assert setup("--logging-config", '{"log_level": "WARNING"}').level == "warning"
    assert setup("--logging-config", '{"log_level": "WARNING"}', "--log-level", "error").level == "error"
    options = gateway_options(build_parser().parse_args(["serve", "--logging-config", '{"log_level": "CRITICAL"}']))
    assert (options.log_level, options.log_config) == ("critical", None)


def test_the_json_formatter_writes_one_json_object_a_line_for_raypaged_and_uvicorn(capsys):
    config = setup("--logging-config", '{"formatter": "json", "log_level": "DEBUG"}').dict_config
    assert config is not None
    names = ("raypaged", "uvicorn", "uvicorn.access")
    before = {name: (logging.getLogger(name).level, logging.getLogger(name).propagate) for name in names}
    logging.config.dictConfig(config)
    logging.getLogger("uvicorn.access").setLevel(logging.INFO)  # as uvicorn sets its loggers' levels
    try:
        logging.getLogger("raypaged").debug("request %s done", "r1")
        logging.getLogger("uvicorn.access").info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET", "/health", "1.1", 200)
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    finally:
        for name, (level, propagate) in before.items():
            logger = logging.getLogger(name)
            logger.handlers.clear()
            logger.setLevel(level)
            logger.propagate = propagate
    assert [(line["level"], line["logger"], line["message"]) for line in lines] == [
        ("DEBUG", "raypaged", "request r1 done"),
        ("INFO", "uvicorn.access", '127.0.0.1:5 - "GET /health HTTP/1.1" 200'),
    ]
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}", line["time"]) for line in lines)


def test_a_dictconfig_file_wins_over_the_formatter_and_log_config_file_over_the_logging_configs(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"version": 1, "root": {"level": "INFO"}}))
    second.write_text(json.dumps({"version": 1, "root": {"level": "ERROR"}}))
    given = json.dumps({"formatter": "json", "pylogging_config_file": str(first)})
    assert setup("--logging-config", given).dict_config == {"version": 1, "root": {"level": "INFO"}}
    chosen = setup("--logging-config", given, "--log-config-file", str(second)).dict_config
    assert chosen == {"version": 1, "root": {"level": "ERROR"}}


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--logging-config", '{"configure_logging": false}'],
            "--logging-config configure_logging false is not supported: raypaged always configures its loggers (a "
            "pylogging_config_file replaces how)",
        ),
        (["--logging-config", '{"formatter": "xml"}'], "--logging-config formatter must be text or json, got 'xml'"),
        (
            ["--logging-config", '{"log_level": "LOUD"}'],
            "--logging-config log_level must be one of critical, error, warning, info, debug (in any case), got 'loud'",
        ),
        (
            ["--logging-config", '{"colour": true}'],
            "--logging-config: unknown field 'colour'; allowed: log_level, formatter, configure_logging, "
            "pylogging_config_file",
        ),
        (
            ["--logging-config", '{"pylogging_config_file": "/no/such.json"}'],
            "--logging-config pylogging_config_file /no/such.json: No such file or directory",
        ),
    ],
)
def test_what_the_logging_config_cannot_honour_is_refused_by_name(argv, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        setup(*argv)
