"""The code passes ruff (lint and format) and mypy with the settings in pyproject.toml ([tool.ruff],
[tool.mypy])."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed (the test extra)")
def test_ruff_check_passes():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "raypaged", "tests", "benchmarks", "deploy"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, f"ruff check failed:\n{result.stdout}{result.stderr}"


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed (the test extra)")
def test_ruff_format_leaves_the_code_as_it_is():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "raypaged", "tests", "benchmarks", "deploy"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, (
        f"ruff format --check failed (run .venv/bin/ruff format):\n{result.stdout}{result.stderr}"
    )


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed (the test extra)")
def test_mypy_passes():
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, f"mypy failed:\n{result.stdout}{result.stderr}"
