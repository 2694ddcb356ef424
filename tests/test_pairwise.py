"""The pairwise cover that CI runs of a ``pairwise`` test's matrix (``--soak`` runs every case)."""

import itertools
import os
import subprocess
import sys
from pathlib import Path

from tests.pairwise import pairwise_cover

ROOT = Path(__file__).resolve().parents[1]


def pairs_of(cases, indices):
    return {(a, x[a], b, x[b]) for x in (cases[i] for i in indices) for a in x for b in x if a < b}


def test_a_full_matrix_keeps_a_case_for_every_pair_and_far_fewer_cases():
    cases = [
        {"dtype": d, "head_size": h, "block_size": b}
        for d, h, b in itertools.product("abc", (64, 80, 96, 128), (8, 16, 32))
    ]
    kept = pairwise_cover(cases)
    assert pairs_of(cases, kept) == pairs_of(cases, range(len(cases)))
    assert len(kept) == 12  # the least possible: 4 head sizes x 3 dtypes pairs need a case each
    assert min(kept) == 0  # greedy: the first of equals


def test_values_given_together_keep_only_the_pairs_that_occur():
    cases = [{"dtype": "f32", "cores": None}, {"dtype": "f16", "cores": None}, {"dtype": "f16", "cores": False}]
    assert pairwise_cover(cases) == {0, 1, 2}
    assert pairwise_cover([{"x": 1}, {"x": 2}]) == set()  # one parameter: no pairs to hold


MATRIX = """
import pytest

@pytest.mark.pairwise
@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("a", [1, 2])
@pytest.mark.parametrize("c", [1, 2])
def test_matrix(a, b, c):
    pass
"""


def test_ci_runs_the_cover_and_soak_every_case(tmp_path):
    (tmp_path / "conftest.py").write_text(
        "from tests.pairwise import pytest_addoption, pytest_collection_modifyitems\n"
    )
    (tmp_path / "test_matrix.py").write_text(MATRIX)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # the packages' plugins: slow
    for options, summary in (([], "4 passed, 4 deselected"), (["--soak"], "8 passed")):
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-W",
            "ignore",
            *options,
            str(tmp_path),
        ]
        run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert summary in run.stdout.splitlines()[-1], run.stdout
