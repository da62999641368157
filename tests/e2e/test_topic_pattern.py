"""Many topics in one pipeline: a ``topic_pattern`` source on the real stack.

One coordinator and two participants read every topic the pattern matches. A topic created
while they run -- as Debezium creates one per new table -- joins the pipeline without a restart:
its records reach the sink exactly once, and the topics that were there keep committing while
the group and the coordinator find it (the coverage rule waits for a topic only once a voter
reads it). A participant is killed with SIGKILL and restarted along the way.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import psycopg
import pytest
import yaml
from confluent_kafka.admin import AdminClient, NewTopic

from harness import (
    Cluster,
    control_summary,
    end_offsets,
    group_offsets,
    produce,
    verify,
    wait_until,
)
from tests.e2e.e2e_support import scenario, start

pytestmark = pytest.mark.stack

PER_TOPIC = 2_000


def _create(bootstrap: str, topic: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(30)
    wait_until(lambda: topic in admin.list_topics(timeout=10).topics, 30, f"topic {topic} to exist")


def test_a_topic_created_while_running_joins_the_pipeline_exactly_once(tmp_path: Path) -> None:
    s = scenario(tmp_path, "pattern", create=False, mongo=False, files=False, interval_ms=500)
    raw = s.config()
    prefix = f"{s.name}.cdc."
    raw["sources"] = [{"topic_pattern": re.escape(prefix) + r"[a-z]+"}]
    # A second sink takes only the topic created later (sinks[].topics), into a table of its own.
    only_c = f"{s.table}_c"
    raw["sinks"].append(
        {
            "name": "pg-c",
            "type": "postgres",
            "dsn": s.pg_dsn,
            "table": only_c,
            "mode": "insert",
            "topics": [re.escape(prefix) + "c"],
        }
    )
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {only_c}")
        conn.execute(f"CREATE TABLE {only_c} (LIKE {s.table})")
    s.config_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    from twophase.config import load_config
    from twophase.kafka import create_topics

    create_topics(load_config(s.config_path))  # control and dead-letter topics only
    topics = {f"{prefix}a": 2, f"{prefix}b": 1}
    for topic, n in topics.items():
        _create(s.bootstrap, topic, n)
    _create(s.bootstrap, f"{prefix}not-matched", 1)  # '-' is outside the pattern
    produce(s.bootstrap, f"{prefix}not-matched", 900_000, 10)
    expected: set[int] = set()
    for i, topic in enumerate(topics):
        produce(s.bootstrap, topic, i * PER_TOPIC, PER_TOPIC)
        expected |= set(range(i * PER_TOPIC, (i + 1) * PER_TOPIC))

    c = Cluster(s)
    try:
        start(c, "coordinator", "coord-0")
        start(c, "participant", "p-0")
        start(c, "participant", "p-1")
        wait_until(lambda: verify(s, expected)["pg"].ok, 120, "the first topics' records")

        # A new topic while everything runs; records on it and on the old ones meanwhile.
        new = f"{prefix}c"
        _create(s.bootstrap, new, 3)
        topics[new] = 3
        produce(s.bootstrap, new, 10_000, PER_TOPIC)
        expected |= set(range(10_000, 10_000 + PER_TOPIC))
        produce(s.bootstrap, f"{prefix}a", 20_000, PER_TOPIC)
        expected |= set(range(20_000, 20_000 + PER_TOPIC))
        time.sleep(1.0)
        c.kill("p-1")  # mid-run, whatever it holds
        produce(s.bootstrap, f"{prefix}b", 30_000, PER_TOPIC)
        expected |= set(range(30_000, 30_000 + PER_TOPIC))
        start(c, "participant", "p-1")

        def caught_up() -> bool:
            return all(
                group_offsets(s.bootstrap, f"twophase.{s.name}", t, n)
                == end_offsets(s.bootstrap, t, n)
                for t, n in topics.items()
            )

        try:
            wait_until(caught_up, 120, "every matching topic's offsets to reach its end")
            wait_until(lambda: verify(s, expected)["pg"].ok, 60, "the sink to hold every record")
        except TimeoutError:
            for name in c.procs:
                print(f"===== {name}\n{c.log_tail(name, 80)}")
            raise
        report = verify(s, expected)["pg"]
        assert report.ok, report  # every id once, none missing, nothing prepared
        assert report.rows == len(expected)  # and nothing of the unmatched topic
        with psycopg.connect(s.pg_dsn) as conn:
            ids = [r[0] for r in conn.execute(f"SELECT id FROM {only_c}")]
        assert sorted(ids) == list(range(10_000, 10_000 + PER_TOPIC))  # c's, each once
        assert group_offsets(s.bootstrap, f"twophase.{s.name}", f"{prefix}not-matched", 1) == {
            0: -1001
        }
        assert "source topics" in c.log_tail("p-0", 2000)
    finally:
        c.stop_all()
    # Read once the pipeline is stopped: a running one never lets the control topic end.
    summary = control_summary(s)
    assert summary["committed"] > 0
    # A new topic costs the cycles a rebalance cuts short, never a stream of aborts.
    assert summary["aborted"] <= 10, summary["abort_reasons"]
