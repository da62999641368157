"""Helpers shared by the bad-input and security end-to-end tests (not a test module).

Everything here reads the real services: Prometheus text scraped from a process's own
``/metrics``, records read back from Kafka topics, the sinks through ``harness.verify``.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError, TopicPartition

from harness import (
    Cluster,
    Scenario,
    SinkReport,
    end_offsets,
    group_offsets,
    summary_json,
    verify,
    wait_until,
)
from tests.e2e.secure_broker import free_port
from twophase.config import load_config
from twophase.kafka import create_topics

__all__ = [
    "DeadLetter",
    "http_get",
    "metric",
    "read_topic",
    "scenario",
    "scrape",
    "settle",
    "start",
]

#: Metric name of skipped control messages as Prometheus exposes the counter.
SKIPPED = "twophase_control_messages_skipped_total"


def scenario(tmp_path: Path, prefix: str, *, create: bool = True, **kw: Any) -> Scenario:
    s = Scenario.on_stack(f"{prefix}-{uuid.uuid4().hex[:6]}", tmp_path, **kw)
    s.write()
    s.prepare_stores()
    if create:
        create_topics(load_config(s.config_path))
    return s


def start(cluster: Cluster, role: str, name: str, env: dict[str, str] | None = None) -> int:
    """Start a real ``twophase <role> run`` process serving /metrics on a port of its own."""
    port = free_port()
    cluster.start(
        role,
        name,
        {
            "TWOPHASE__METRICS__PORT": str(port),
            "TWOPHASE__METRICS__HOST": "127.0.0.1",
            **(env or {}),
        },
    )
    return port


def ends_in_one_line(cluster: Cluster, role: str, env: dict[str, str], naming: str) -> str:
    """Start ``twophase <role> run`` with ``env`` and expect it to end by itself within 90 s
    with status 2, no traceback, and exactly one log line holding ``naming``: that line."""
    name = f"{role}-0"
    proc = cluster.start(role, name, {"TWOPHASE__METRICS__HOST": "127.0.0.1", **env})
    try:
        code = proc.wait(90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{role} still running:\n{cluster.log_tail(name)}")
    log = cluster.log_tail(name, 200)
    assert code == 2, (code, log)
    assert "Traceback" not in log, log
    lines = [line for line in log.splitlines() if naming in line]
    assert len(lines) == 1, log
    return lines[0]


def http_get(port: int, path: str) -> tuple[int, str]:
    """Status and body; 0 when nothing answers. A process that exits while answering (a test
    polling one that is meant to die) leaves the status with an empty or cut body, not an error."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return int(r.status), _body(r)
    except urllib.error.HTTPError as e:
        return int(e.code), _body(e)
    except (OSError, http.client.HTTPException):
        return 0, ""  # not listening (yet, or any more)


def _body(r: Any) -> str:
    try:
        return str(r.read().decode())
    except (OSError, http.client.HTTPException):  # the server went away mid-answer
        return ""


def scrape(port: int) -> str:
    return http_get(port, "/metrics")[1]


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of exactly ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def caught_up(s: Scenario) -> bool:
    return group_offsets(s.bootstrap, f"twophase.{s.name}", s.topic, s.partitions) == end_offsets(
        s.bootstrap, s.topic, s.partitions
    )


def settle(
    s: Scenario,
    cluster: Cluster,
    expected: set[int],
    timeout_s: float,
    apply_timeout_s: float = 60,
) -> dict[str, SinkReport]:
    """Wait for the group's committed offsets to reach the end, then for every sink to hold
    ``expected`` exactly once with nothing left prepared or staged."""
    try:
        wait_until(lambda: caught_up(s), timeout_s, "committed offsets to reach the end offsets")
        wait_until(
            lambda: all(r.ok for r in verify(s, expected).values()),
            apply_timeout_s,
            "sinks to finish applying",
        )
    except TimeoutError:
        cluster.print_logs()
        print(summary_json(verify(s, expected)))
        raise
    return verify(s, expected)


@dataclass(frozen=True)
class DeadLetter:
    key: bytes
    value: bytes | None
    headers: dict[str, bytes]

    def header(self, name: str) -> str:
        return self.headers[name].decode()


def read_topic(bootstrap: str, topic: str, *, partitions: int = 1, **conf: Any) -> list[Any]:
    """Every message of ``topic`` from the beginning to its current end (read_committed)."""
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"probe-{uuid.uuid4().hex[:8]}",
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
            **conf,
        }
    )
    try:
        ends = {
            p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in range(partitions)
        }
        c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        done = {p for p, e in ends.items() if e == 0}
        out = []
        deadline = time.monotonic() + 30
        while len(done) < partitions and time.monotonic() < deadline:
            m = c.poll(1)
            if m is None:
                continue
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    done.add(m.partition())
                continue
            out.append(m)
        return out
    finally:
        c.close()


def dead_letters(s: Scenario) -> list[DeadLetter]:
    """The pipeline's DLQ, one entry per source record (the DLQ is at-least-once: de-duplicated
    by its key ``topic:partition:offset``)."""
    seen: dict[bytes, DeadLetter] = {}
    for m in read_topic(s.bootstrap, f"{s.name}.dlq"):
        raw = m.headers() or []
        headers = {k: v or b"" for k, v in raw}
        seen.setdefault(m.key(), DeadLetter(m.key(), m.value(), headers))
    return list(seen.values())


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str)
