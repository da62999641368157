"""``dashboards/twophase.json``: valid Grafana JSON whose every query names metrics and labels
that ``twophase.observability.Metrics`` really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from twophase.observability import Metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "twophase.json"

_METRIC = re.compile(r"\btwophase_[a-z_]+\b")
_BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_SELECTOR = re.compile(r"\b(twophase_[a-z_]+)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")


def _exported() -> dict[str, set[str]]:
    """Every series name a scrape of the process shows -> its labels."""
    metrics = Metrics("p", "test")
    out: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        wrapper = next(
            v for v in vars(metrics).values() if getattr(v, "_name", None) == family.name
        )
        # prometheus_client keeps label names on the wrapper only; a family without samples
        # (no label values set yet) has none.
        labels = set(wrapper._labelnames)
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
        for suffix in suffixes.get(family.type, [""]):
            out[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return out


def _panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dash["panels"]:
        out.append(panel)
        out += panel.get("panels", [])
    return out


def _queries(dash: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in _panels(dash) for t in p.get("targets", [])]
    exprs += [
        v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        for v in dash["templating"]["list"]
        if v["type"] == "query"
    ]
    return exprs


def test_dashboard_is_valid_grafana_json() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "twophase" and dash["title"]
    assert isinstance(dash["schemaVersion"], int)
    panels = _panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]), p["title"]
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "pipeline"} <= variables


def test_every_queried_metric_and_label_exists() -> None:
    exported = _exported()
    dash = json.loads(DASHBOARD.read_text())
    for expr in _queries(dash):
        names = set(_METRIC.findall(expr))
        assert names, f"query without a twophase metric: {expr}"
        unknown = names - set(exported)
        assert not unknown, f"{expr}: {sorted(unknown)} not exported by Metrics"
        labels = set().union(*(exported[n] for n in names))
        for group in _BY.findall(expr):
            used = {label.strip() for label in group.split(",") if label.strip()}
            assert used <= labels, f"{expr}: labels {sorted(used - labels)} do not exist"
        for name, matchers in _SELECTOR.findall(expr):
            used = set(_MATCHER.findall(matchers))
            assert used <= exported[name], f"{expr}: {name} has no label {sorted(used)}"


def test_dashboard_covers_what_operators_need() -> None:
    exprs = "\n".join(_queries(json.loads(DASHBOARD.read_text())))
    for needed in [
        "twophase_commit_cycles_total",
        "twophase_sink_records_total",
        "twophase_sink_bytes_total",
        "twophase_dead_lettered_records_total",
        "twophase_in_doubt_parts",
        "twophase_consumer_lag",
        "twophase_leader",
        "twophase_fencing_events_total",
        "twophase_alarm",
    ]:
        assert needed in exprs, needed
    for q in ("0.5", "0.99"):
        assert re.search(
            rf"histogram_quantile\({re.escape(q)}, sum by \(le, phase\) \(rate\("
            r"twophase_cycle_phase_seconds_bucket",
            exprs,
        ), f"p{q} of the cycle phases"
    # A metric added to Metrics without a panel is invisible to operators.
    families = {n.removesuffix("_total").removesuffix("_bucket") for n in _METRIC.findall(exprs)}
    missing = {f.name for f in Metrics("p", "test").registry.collect()} - families
    assert not missing, f"metrics without a panel: {sorted(missing)}"
