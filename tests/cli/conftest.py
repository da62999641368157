"""Helpers for the CLI tests: run a command in-process, write control messages, prepare parts.

Every test here runs against the local stack (``make stack-up``); a stack that is down FAILS the
test (see ``tests/conftest.py``), it never skips it.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result
from confluent_kafka import Producer

from harness import (
    Cluster,
    Scenario,
    end_offsets,
    group_offsets,
    produce,
    verify,
    wait_until,
)
from twophase.cli.main import main
from twophase.config import PipelineConfig, load_config
from twophase.kafka import create_topics
from twophase.participants.registry import build_sinks
from twophase.participants.sdk import PartId, Record, Sink
from twophase.protocol.codec import encode, new_envelope
from twophase.protocol.messages import Payload


def run_cli(*args: str) -> Result:
    """``twophase ARGS`` in this process. The CLI points the root logger at the runner's stderr
    (and quietens it); both are put back so later logging does not write to a closed stream."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        return CliRunner().invoke(main, list(args), catch_exceptions=False)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def run_json(*args: str, exit_code: int = 0) -> Any:
    result = run_cli(*args, "--json")
    assert result.exit_code == exit_code, (result.exit_code, result.stdout, result.stderr)
    return json.loads(result.stdout)


def send_control(cfg: PipelineConfig, *payloads: Payload, sender: str = "coordinator:test") -> None:
    """Write control messages as a coordinator would (plain produce: read_committed readers see
    non-transactional messages too)."""
    producer = Producer({"bootstrap.servers": cfg.kafka.bootstrap_servers, "acks": "all"})
    for payload in payloads:
        value, headers = encode(new_envelope(cfg.pipeline, sender, payload), cfg.hmac_key)
        producer.produce(cfg.control_topic, value=value, key=cfg.pipeline.encode(), headers=headers)
    assert producer.flush(30) == 0, "control messages not delivered"


def sink_named(cfg: PipelineConfig, name: str, participant: str) -> Sink:
    raw = next(s for s in cfg.sinks if s["name"] == name)
    sink = build_sinks([raw], pipeline=cfg.pipeline, participant=participant)[0]
    sink.setup()
    return sink


def prepare_pg_part(
    cfg: PipelineConfig, s: Scenario, txn: int, participant: str, ids: Sequence[int]
) -> PartId:
    """A real prepared PostgreSQL transaction holding rows ``ids``, as a participant that then
    died would leave it: prepared with the PostgresSink, connection closed."""
    sink = sink_named(cfg, "pg", participant)
    part = PartId(cfg.pipeline, txn, participant)
    try:
        sink.begin(part)
        records = [
            Record(
                topic=s.topic,
                partition=0,
                offset=10_000 * txn + i,
                timestamp_ms=0,
                key=str(i).encode(),
                value={
                    "id": i,
                    "customer": "c",
                    "amount": 1.5,
                    "currency": "EUR",
                    "ts": "2026-11-21T12:00:00Z",
                    "note": "cli test",
                },
            )
            for i in ids
        ]
        assert not sink.write(part, records)
        sink.prepare(part, {(s.topic, 0): 10_000 * txn + len(ids)})
    finally:
        sink.close()
    return part


def pg_gids(s: Scenario) -> list[str]:
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s ORDER BY gid", (f"%:{s.name}~%",)
        ).fetchall()
    return [r[0] for r in rows]


def pg_ids(s: Scenario) -> list[int]:
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        return sorted(r[0] for r in conn.execute(f"SELECT id FROM {s.table}"))


def rollback_leftovers(s: Scenario) -> None:
    """A prepared transaction left by a failed test would hold its locks forever."""
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        for gid in pg_gids(s):
            conn.execute(f"ROLLBACK PREPARED '{gid}'")


def new_scenario(workdir: Path, prefix: str, **kw: Any) -> Scenario:
    s = Scenario.on_stack(f"{prefix}-{uuid.uuid4().hex[:6]}", workdir, mongo=False, **kw)
    s.write()
    s.prepare_stores()
    create_topics(load_config(s.config_path))
    return s


class LivePipeline:
    def __init__(self, s: Scenario, cluster: Cluster, produced: int) -> None:
        self.s = s
        self.cluster = cluster
        self.produced = produced
        self.config = str(s.config_path)
        self.cfg = load_config(s.config_path)


@pytest.fixture(scope="module")
def live(
    tmp_path_factory: pytest.TempPathFactory, stack_env: dict[str, str]
) -> Iterator[LivePipeline]:
    """A running pipeline: coordinator and participant processes started with
    ``twophase coordinator run`` / ``twophase participant run`` (the harness), 800 records
    committed. Sweeps are slowed so a test's own in-doubt parts stay put while it looks."""
    s = new_scenario(
        tmp_path_factory.mktemp("live"),
        "cli-live",
        interval_ms=300,
        extra={"participant": {"sweep_interval_ms": 600_000}},
    )
    cluster = Cluster(s)
    cluster.start("coordinator", "c-0")
    cluster.start("participant", "p-0")
    try:
        produce(s.bootstrap, s.topic, 0, 800)
        wait_until(
            lambda: (
                group_offsets(s.bootstrap, f"twophase.{s.name}", s.topic, s.partitions)
                == end_offsets(s.bootstrap, s.topic, s.partitions)
            ),
            120,
            "the pipeline to commit every record",
        )
        wait_until(
            lambda: all(r.ok for r in verify(s, set(range(800))).values()),
            60,
            "every sink to apply the commits",
        )
        yield LivePipeline(s, cluster, 800)
    except BaseException:
        for name in cluster.procs:
            print(f"===== {name}\n{cluster.log_tail(name, 60)}")
        raise
    finally:
        cluster.stop_all()
        rollback_leftovers(s)
