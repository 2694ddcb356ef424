"""docs/operations.md names only flags that exist, and every file it points at."""

from __future__ import annotations

import re

from tests.deploy.common import REPO, raypaged_flags

OPERATIONS = REPO / "docs" / "operations.md"
# server flags being added alongside these docs
PENDING_FLAGS = {"--drain-timeout", "--auth-exempt-paths", "--max-request-body-bytes"}
# flags of docker, kubectl and ray in the examples
OTHER_TOOLS_FLAGS = {
    "--rm",
    "--gpus",
    "--health-cmd",
    "--for",
    "--timeout",
    "--head",
    "--num-gpus",
    "--address",
    "--block",
}


def test_operations_names_only_existing_flags():
    known = raypaged_flags() | PENDING_FLAGS | OTHER_TOOLS_FLAGS
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", OPERATIONS.read_text()))
    assert named - known == set()


def test_operations_covers_the_tuning_flags():
    text = OPERATIONS.read_text()
    for flag in (
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--block-size",
        "--gpu-memory-utilization",
        "--swap-space",
        "--enable-prefix-caching",
        "--preemption-mode",
        "--scheduling-policy",
        "--enforce-eager",
        "--drain-timeout",
    ):
        assert f"`{flag}" in text, flag


def test_operations_points_at_files_that_exist():
    for path in set(re.findall(r"`((?:deploy|docs)/[\w./-]+)`", OPERATIONS.read_text())):
        assert (REPO / path).exists(), path
