"""Metrics and health endpoints of real processes on the real stack."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from coordinator.runtime import CoordinatorRuntime
from participants.runtime import ParticipantRuntime
from twophase.config import load_config
from twophase.harness import Scenario, produce, wait_until
from twophase.kafka import create_topics


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
