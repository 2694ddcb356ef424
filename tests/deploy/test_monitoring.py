"""The Grafana dashboard, the Prometheus scrape config and alert rules against the real metrics module."""

from __future__ import annotations

import json
from collections.abc import Iterator

import promql_parser
import pytest
import yaml

from raypaged.core.block_manager import KVCacheManager
from raypaged.core.scheduler import Scheduler, SchedulerConfig
from raypaged.serving.metrics import PREFIX, ServerMetrics
from tests.deploy.common import MONITORING_DIR

DASHBOARD = MONITORING_DIR / "grafana-dashboard.json"
# Grafana's interval variables, replaced by a duration before parsing
_GRAFANA_RANGES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
_RATE_FUNCTIONS = {"rate", "irate", "increase"}


def _families() -> dict[str, str]:
    """Name -> type of every ``raypaged:`` family a real server registry exports (not the process metrics)."""
    stats = Scheduler(SchedulerConfig(), KVCacheManager(8, 16, True)).stats()
    metrics = ServerMetrics({"m": lambda: stats}, device="cpu")
    families = {family.name: family.type for family in metrics.registry.collect() if family.name.startswith(PREFIX)}
    assert len(families) > 20
    return families


def _exported_series() -> set[str]:
    """The series names Prometheus stores for those families."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {name + suffix for name, kind in _families().items() for suffix in suffixes[kind]}


def _selectors(expr, functions: tuple[str, ...] = ()) -> Iterator[tuple[promql_parser.VectorSelector, tuple[str, ...]]]:
    """Every vector selector of a parsed expression with the functions around it, outermost first."""
    if isinstance(expr, promql_parser.VectorSelector):
        yield expr, functions
    elif isinstance(expr, promql_parser.MatrixSelector):
        yield expr.vector_selector, functions
    elif isinstance(expr, promql_parser.Call):
        for arg in expr.args:
            yield from _selectors(arg, functions + (expr.func.name,))
    elif isinstance(expr, promql_parser.BinaryExpr):
        yield from _selectors(expr.lhs, functions)
        yield from _selectors(expr.rhs, functions)
    elif isinstance(
        expr,
        (promql_parser.AggregateExpr, promql_parser.ParenExpr, promql_parser.UnaryExpr, promql_parser.SubqueryExpr),
    ):
        yield from _selectors(expr.expr, functions)


def _parse(expr: str):
    for variable, duration in _GRAFANA_RANGES.items():
        expr = expr.replace(variable, duration)
    return promql_parser.parse(expr)


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panel_queries() -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in _dashboard()["panels"] for target in panel["targets"]]


def test_dashboard_is_a_grafana_dashboard():
    dashboard = _dashboard()
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    cells = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        area = {
            (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & area, f"{panel['title']} overlaps another panel"
        cells |= area
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert ref_ids and len(set(ref_ids)) == len(ref_ids), panel["title"]


def test_dashboard_is_templated_on_model_name():
    variables = {v["name"]: v for v in _dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    model = variables["model_name"]
    expr = model["query"]["query"]
    assert expr.startswith("label_values(") and expr.endswith(", model_name)")
    assert expr[len("label_values(") : -len(", model_name)")] in _exported_series()
    for title, query in _panel_queries():
        for selector, _ in _selectors(_parse(query)):
            matchers = {m.name: m.value for m in selector.matchers.matchers}
            assert matchers.get("model_name") == "$model_name", f"{title}: {query}"


@pytest.mark.parametrize("title_query", _panel_queries(), ids=lambda tq: tq[0])
def test_every_panel_query_parses_and_uses_exported_metrics(title_query):
    title, query = title_query
    exported = _exported_series()
    kinds = _families()
    selectors = list(_selectors(_parse(query)))
    assert selectors, f"{title}: no metric"
    for selector, functions in selectors:
        name = selector.name
        assert name in exported, f"{title}: {name} is not exported by raypaged/serving/metrics.py"
        family = next(f for f in kinds if name in (f, f + "_total", f + "_bucket", f + "_sum", f + "_count"))
        if kinds[family] == "gauge":
            assert not _RATE_FUNCTIONS & set(functions), f"{title}: rate() of the gauge {name}"
        else:
            assert functions and functions[-1] in _RATE_FUNCTIONS, f"{title}: {name} is a counter; take its rate()"
        if name.endswith("_bucket"):
            assert functions[0] == "histogram_quantile", f"{title}: {name} buckets need histogram_quantile"


def test_every_exported_metric_has_a_panel():
    used = {selector.name for _, query in _panel_queries() for selector, _ in _selectors(_parse(query))}
    for family, kind in _families().items():
        wanted = {"counter": family + "_total", "histogram": family + "_bucket", "gauge": family}[kind]
        assert wanted in used, f"{family} ({kind}) has no panel in {DASHBOARD.name}"


def test_a_new_metric_without_a_panel_is_caught(monkeypatch):
    from raypaged.serving import metrics

    monkeypatch.setattr(
        metrics, "_GAUGES", metrics._GAUGES + (("num_new_thing", "A new gauge.", "num_gpu_blocks_free"),)
    )
    with pytest.raises(AssertionError, match="raypaged:num_new_thing"):
        test_every_exported_metric_has_a_panel()


def test_prometheus_config_scrapes_metrics():
    config = yaml.safe_load((MONITORING_DIR / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert {"raypaged", "raypaged-kubernetes"} <= jobs.keys()
    for job in jobs.values():
        assert job["metrics_path"] == "/metrics"
    assert jobs["raypaged"]["static_configs"][0]["targets"] == ["localhost:8000"]
    kept = {
        tuple(r["source_labels"]): r["regex"]
        for r in jobs["raypaged-kubernetes"]["relabel_configs"]
        if r.get("action") == "keep"
    }
    assert kept[("__meta_kubernetes_pod_label_app_kubernetes_io_component",)] == "server"
    assert kept[("__meta_kubernetes_pod_container_port_name",)] == "http"
    for rule_file in config["rule_files"]:
        assert (MONITORING_DIR / rule_file).exists(), rule_file


def test_alert_rules_parse_and_use_exported_metrics():
    rules = yaml.safe_load((MONITORING_DIR / "raypaged-alerts.yml").read_text())
    exported = _exported_series() | {"up"}
    alerts = [rule for group in rules["groups"] for rule in group["rules"]]
    assert alerts
    for rule in alerts:
        assert {"alert", "expr", "labels", "annotations"} <= rule.keys()
        for selector, _ in _selectors(_parse(rule["expr"])):
            assert selector.name in exported, f"{rule['alert']}: {selector.name}"
