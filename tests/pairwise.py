"""``--soak`` (and its ``soak`` fixture) and the pairwise cover that CI runs of a test marked ``pairwise`` (hooks that
``tests/conftest.py`` takes; no torch here, so a pytest run of a few files loads them fast)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak",
        action="store_true",
        default=False,
        help="tests/reliability at soak sizes (minutes), not the CI sizes; every case of a pairwise matrix",
    )


@pytest.fixture(scope="session")
def soak(request: pytest.FixtureRequest) -> bool:
    """Whether this run is ``--soak``."""
    return bool(request.config.getoption("--soak"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Of each test marked ``pairwise``, only the cases that cover every pair of its parameters' values,
    unless ``--soak``: the rest are reported as deselected."""
    if config.getoption("--soak"):
        return
    matrices: dict[str, list[pytest.Function]] = {}
    for item in items:
        if isinstance(item, pytest.Function) and item.get_closest_marker("pairwise") and hasattr(item, "callspec"):
            matrices.setdefault(item.nodeid.split("[")[0], []).append(item)
    dropped: set[str] = set()
    for cases in matrices.values():
        kept = pairwise_cover([case.callspec.params for case in cases])
        dropped |= {case.nodeid for index, case in enumerate(cases) if index not in kept}
    if dropped:
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in dropped])
        items[:] = [item for item in items if item.nodeid not in dropped]


def pairwise_cover(cases: Sequence[dict[str, object]]) -> set[int]:
    """The indices of a few cases that hold every pair of values (of two parameters) that any case holds:
    greedily the case with the most pairs not yet held, the first of equals."""
    pairs = [{(a, repr(params[a]), b, repr(params[b])) for a in params for b in params if a < b} for params in cases]
    left = set().union(*pairs)
    kept: set[int] = set()
    while left:
        best = max(range(len(cases)), key=lambda index: len(pairs[index] & left))
        kept.add(best)
        left -= pairs[best]
    return kept
