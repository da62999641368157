"""Metrics and health endpoints of real processes on the real stack."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from harness import Cluster, Scenario, produce, wait_until
from tests.e2e.e2e_support import http_get, metric, scenario, scrape, settle, start
from twophase.config import load_config
from twophase.coordinator.runtime import CoordinatorRuntime
from twophase.kafka import create_topics
from twophase.participants.runtime import ParticipantRuntime


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_move_and_readiness_follows_assignment(tmp_path: Path) -> None:
    s = Scenario.on_stack(f"obs-{uuid.uuid4().hex[:6]}", tmp_path, mongo=False, interval_ms=300)
    s.write()
    s.prepare_stores()
    cfg = load_config(s.config_path)
    create_topics(cfg)
    participant = ParticipantRuntime(cfg, participant_id="p-0")
    threading.Thread(target=participant.run, daemon=True).start()
    wait_until(lambda: participant.health.port != 0, 30, "the participant's health server")
    port = participant.health.port
    # Not ready before it has its assignment (nothing else can be true this early).
    status, _ = _get(port, "/readyz")
    assert status == 503
    assert _get(port, "/healthz")[0] == 200
    coordinator = CoordinatorRuntime(cfg, instance="c-0")
    threading.Thread(target=coordinator.run, daemon=True).start()
    try:
        wait_until(lambda: _get(port, "/readyz")[0] == 200, 60, "readiness after assignment")
        before = _get(port, "/metrics")[1]
        assert _metric(before, "twophase_sink_records_total", sink="pg") == 0
        produce(s.bootstrap, s.topic, 0, 1000)
        wait_until(
            lambda: (
                _metric(_get(port, "/metrics")[1], "twophase_sink_records_total", sink="pg") == 1000
            ),
            60,
            "records metric to count 1000",
        )
        wait_until(lambda: coordinator.machine.committed >= 2, 60, "commits")
        after = _get(port, "/metrics")[1]
        assert _metric(after, "twophase_sink_bytes_total", sink="files") > 100_000
        assert _metric(after, "twophase_cycle_phase_seconds_count", phase="prepare") >= 1
        cmetrics = coordinator.metrics.render().decode()
        assert _metric(cmetrics, "twophase_leader") == 1
        assert _metric(cmetrics, "twophase_commit_cycles_total", outcome="commit") >= 2
        status_code, body = _get(port, "/status")
        assert status_code == 200 and '"ready": true' in body
    finally:
        participant.stop()
        coordinator.stop()
        time.sleep(1)


#: A line about a transaction: its id in the text (``txn=42``) or a part token in it
#: (``pipeline~000000000042~p-0``, as the sinks log them).
_ABOUT_A_TXN = re.compile(r"\btxn=\d+|~\d{12}~")


def _txn_fields_missing(record: dict[str, Any]) -> str:
    """Why a JSON log record about a transaction lacks its structured fields ("" if it has
    them): ``txn`` and either ``topic`` + ``partition`` or a non-empty ``partitions``."""
    if "txn" not in record:
        return "no txn field"
    if "topic" in record or "partition" in record:
        ok = isinstance(record.get("topic"), str) and isinstance(record.get("partition"), int)
        return "" if ok and "partitions" not in record else "topic/partition malformed"
    tps = record.get("partitions")
    if not tps or not all(re.fullmatch(r".+\[\d+\]", tp) for tp in tps):
        return "no topic/partition(s)"
    return ""


def test_json_log_lines_about_a_transaction_carry_its_id_and_partitions(tmp_path: Path) -> None:
    """Issue #5: a pipeline with json logs (DEBUG, so the sinks' part lines are in): every line
    is JSON -- librdkafka's own lines too -- and every line about a transaction has ``txn`` and
    the source partitions it covers (one: ``topic``/``partition``; several: ``partitions``)."""
    s = scenario(tmp_path, "logs", interval_ms=300, mongo=False, partitions=2)
    n = 400
    produce(s.bootstrap, s.topic, 0, n)
    c = Cluster(s)
    env = {"TWOPHASE_LOG_FORMAT": "json", "TWOPHASE_LOG_LEVEL": "DEBUG"}
    start(c, "coordinator", "coord-0", env)
    ports = {"p-0": start(c, "participant", "p-0", env)}
    try:
        settle(s, c, set(range(n)), 60)
        # A second participant: a rebalance (p-0 abandons its open part), then one partition each.
        ports["p-1"] = start(c, "participant", "p-1", env)
        wait_until(lambda: http_get(ports["p-1"], "/readyz")[0] == 200, 60, "p-1 to be assigned")
        produce(s.bootstrap, s.topic, n, n)
        report = settle(s, c, set(range(2 * n)), 60)
        for name, port in ports.items():
            assert metric(scrape(port), "twophase_sink_records_total", sink="pg") > 0, name
    finally:
        c.stop_all()
    for sink, r in report.items():
        assert r.ok, f"{sink}: {r}"
    about: dict[str, list[dict[str, Any]]] = {}
    for name in ("coord-0", "p-0", "p-1"):
        for line in (c.logs / f"{name}.log").read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                raise AssertionError(f"{name}: not a JSON line: {line}") from None
            if "txn" in record or _ABOUT_A_TXN.search(record["msg"]):
                problem = _txn_fields_missing(record)
                assert not problem, f"{name}: {problem}: {line}"
                about.setdefault(name, []).append(record)
    # Not vacuous: each process logged about transactions, the coordinator's cycles cover
    # both partitions, and a participant that owns one partition names it alone.
    assert set(about) == {"coord-0", "p-0", "p-1"}, {k: len(v) for k, v in about.items()}
    both = [f"{s.topic}[0]", f"{s.topic}[1]"]
    assert any(r.get("partitions") == both for r in about["coord-0"])
    assert any(r.get("topic") == s.topic for r in about["p-0"] + about["p-1"])
    assert any(r["logger"].startswith("twophase.sink") for r in about["p-0"] + about["p-1"])
