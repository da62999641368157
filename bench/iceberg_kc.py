"""Iceberg's own Kafka Connect sink as a peer of the iceberg pipeline (``make bench``, ``iceberg``).

Apache Iceberg's sink connector (``org.apache.iceberg.connect.IcebergSinkConnector``, 1.10.1,
on the stack's Kafka Connect worker: ``stack/connect.sh``) writes the source topic into a table
made exactly as :func:`bench.iceberg.pipeline_run` makes its own -- the twophase iceberg sink's
``setup()``: same columns and types, ``bucket(4, id)``, same table properties, same PostgreSQL
catalog tables, local warehouse. The connector opens that catalog as Iceberg's ``JdbcCatalog``
(the same ``iceberg_tables`` rows pyiceberg's SQL catalog keeps) and commits every
``COMMIT_INTERVAL_MS``, as the pipeline does.

A run is timed from the connector and all its tasks ``RUNNING`` to the table's current snapshot
holding every record (its summary's ``total-records``, read through pyiceberg's SQL catalog every
0.1 s). Task creation is left out, as the pipeline's process start-up is; the tasks' consumer-group
join is in, where the pipeline's clock starts only once a participant holds its assignment: the
run's ``control`` says how long the join took (``assigned_s``: to a stable group, one member per
task, every partition held) and the rate from then on (``records_per_s_from_assigned``), the
figure to set beside the pipeline's. Then a pyiceberg scan counts the rows and the distinct ``id``
values: the connector delivered exactly the records when both are the source's count
(``control["exact"]``). The worker's CPU seconds are those it spent from the connector's creation
to done (it is one JVM for every task and the coordinator).

:func:`kc_run` starts nothing global: Kafka Connect is the stack's (``bash stack/connect.sh up``,
which it runs itself only when no worker answers). Each run has its own connector, consumer group
(``connect-<connector>``), control topic and table; the connector and its control topic are
deleted afterwards.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
import urllib.error
import uuid
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
from confluent_kafka import ConsumerGroupState, KafkaException
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import NoSuchTableError

from bench import iceberg
from bench import throughput as tp
from harness import Scenario, load_stack_env
from harness.debezium import rest
from twophase.participants.sdk import SinkContext
from twophase.participants.sinks.iceberg import IcebergSink

__all__ = ["COMMIT_INTERVAL_MS", "CONNECTOR_CLASS", "connector_config", "kc_run"]

CONNECTOR_CLASS = "org.apache.iceberg.connect.IcebergSinkConnector"
#: The pipeline's ``commit.interval_ms`` in :mod:`bench.iceberg` (the scenario's default).
COMMIT_INTERVAL_MS = 1000
#: The catalog schema the twophase iceberg sink keeps its catalog tables in (its default).
CATALOG_SCHEMA = "iceberg_catalog"
#: A new connector's tasks are made and reported RUNNING within a second or two; the margin is
#: for a 2-core machine that also runs the broker, PostgreSQL and the worker's JVM.
RUNNING_TIMEOUT_S = 120.0
#: A deleted connector's tasks close their writers and Kafka clients, and its coordinator ends
#: the commit in flight (a catalog commit and a Kafka transaction): about a second seen here.
DELETE_TIMEOUT_S = 60.0
#: How often the task states are checked while the clock runs: a FAILED task ends the run
#: early, and the REST call is cheap next to the table polls between checks.
STATUS_EVERY_S = 2.0
#: Snapshot summary key the connector's coordinator writes on every commit.
COMMIT_ID_KEY = "kafka.connect.commit-id"
REPO = Path(__file__).resolve().parents[1]

log = logging.getLogger(__name__)


def connect_url() -> str:
    """The stack's Kafka Connect worker, with Iceberg's sink among its plugins; started with
    ``stack/connect.sh up`` when none answers."""
    env = load_stack_env()
    url = _answering(env)
    if url is None:
        log.info("no Kafka Connect worker answers: running stack/connect.sh up")
        # connect.sh takes the stack's directories and Kafka port from the environment: give it
        # the ones of the stack this process uses, whatever this shell exported.
        bootstrap_port = env["TWOPHASE_KAFKA_BOOTSTRAP"].rsplit(":", 1)[1]
        subprocess.run(
            ["bash", str(REPO / "stack" / "connect.sh"), "up"],
            check=True,
            env={
                **os.environ,
                "TWOPHASE_STACK_DIR": env["TWOPHASE_STACK_DIR"],
                "TWOPHASE_CACHE_DIR": env["TWOPHASE_CACHE_DIR"],
                "TWOPHASE_KAFKA_PORT": bootstrap_port,
            },
        )
        url = _answering(env)
        if url is None:
            raise RuntimeError("stack/connect.sh up succeeded but no worker answers")
    classes = {p["class"] for p in rest("GET", f"{url}/connector-plugins")}
    if CONNECTOR_CLASS not in classes:
        raise RuntimeError(f"the worker at {url} has no Iceberg sink: {sorted(classes)}")
    return url


def _answering(env: dict[str, str]) -> str | None:
    path = Path(env["TWOPHASE_STACK_DIR"]) / "connect.env"
    if not path.is_file():
        return None
    url = load_stack_env(path).get("TWOPHASE_CONNECT_URL")
    if not url:
        return None
    try:
        rest("GET", url)
    except OSError:  # refused, or a worker still starting (URLError is an OSError)
        return None
    return url


def jdbc_catalog(s: Scenario) -> dict[str, str]:
    """``iceberg.catalog.*`` settings: Iceberg's ``JdbcCatalog`` on the scenario's catalog."""
    url, user, password = tp.jdbc(s.pg_dsn)
    # JdbcCatalog names iceberg_tables unqualified: the connection's current schema must be the
    # twophase sink's catalog schema, not public.
    uri = f"{url}?currentSchema={CATALOG_SCHEMA}"
    return {
        "iceberg.catalog": s.table,
        "iceberg.catalog.catalog-impl": "org.apache.iceberg.jdbc.JdbcCatalog",
        "iceberg.catalog.uri": uri,
        "iceberg.catalog.jdbc.user": user,
        "iceberg.catalog.jdbc.password": password,
        "iceberg.catalog.warehouse": f"file://{s.warehouse}",
        # The catalog tables are the twophase sink's (made by its setup): never made here.
        "iceberg.catalog.jdbc.init-catalog-tables": "false",
    }


def connector_config(s: Scenario, source: tp.Source, control_topic: str) -> dict[str, str]:
    """The connector's settings for writing ``source`` into the scenario's iceberg table."""
    return {
        "connector.class": CONNECTOR_CLASS,
        "topics": source.topic,
        # One task per source partition, as the pipeline's consumers share the partitions.
        "tasks.max": str(source.partitions),
        # The values are plain JSON objects; the sink converts each field to the table's type
        # (decimal, timestamptz) itself. Keys are never read: no parsing for them.
        "key.converter": "org.apache.kafka.connect.converters.ByteArrayConverter",
        "value.converter": "org.apache.kafka.connect.json.JsonConverter",
        "value.converter.schemas.enable": "false",
        "iceberg.tables": s.iceberg_table,
        # The table exists, made by the twophase sink's setup: auto-create would infer double for
        # amount and string for ts from schemaless JSON, another table than the pipeline's.
        "iceberg.tables.auto-create-enabled": "false",
        "iceberg.tables.evolve-schema-enabled": "false",
        "iceberg.control.topic": control_topic,
        "iceberg.control.commit.interval-ms": str(COMMIT_INTERVAL_MS),
        **jdbc_catalog(s),
    }


def kc_run(source: tp.Source, workdir: Path, *, timeout_s: float = 900.0) -> tp.RunResult:
    """One run of Iceberg's Kafka Connect sink over ``source`` into a fresh table."""
    url = connect_url()
    name = f"bench-ice-kc-{uuid.uuid4().hex[:6]}"
    s = iceberg._scenario(name, workdir, source)
    _create_table(s)
    control_topic = f"{name}.control"
    admin = AdminClient({"bootstrap.servers": source.bootstrap})
    # The stack's broker does not create topics on first use; one partition, as Iceberg's docs
    # make it (the coordinator and the workers all read every message).
    admin.create_topics([NewTopic(control_topic, num_partitions=1, replication_factor=1)])[
        control_topic
    ].result()
    catalog = iceberg._catalog(s)
    n = source.records
    worker = _worker_pid()
    started = time.monotonic()
    cpu0 = tp._cpu_s(worker)
    try:
        try:
            rest(
                "PUT", f"{url}/connectors/{name}/config", connector_config(s, source, control_topic)
            )
            _wait_running(url, name)
            t_running = time.monotonic()
            next_status = t_running + STATUS_EVERY_S
            assigned_s: float | None = None
            while _total_records(catalog, s) < n:
                if assigned_s is None and _assigned(admin, f"connect-{name}", source.partitions):
                    assigned_s = time.monotonic() - t_running
                now = time.monotonic()
                if now > t_running + timeout_s:
                    got = _total_records(catalog, s)
                    raise TimeoutError(f"{name}: {got} of {n} records in {timeout_s}s")
                if now >= next_status:
                    _check_tasks(url, name)
                    next_status = now + STATUS_EVERY_S
                time.sleep(tp.POLL_S)
            seconds = time.monotonic() - t_running
            cpu = {"connect_worker": round(tp._cpu_s(worker) - cpu0, 2)}
        finally:
            _delete(url, admin, name)
            admin.delete_topics([control_topic])
        wall = time.monotonic() - started
        table = catalog.load_table(s.iceberg_table)
        ids = table.scan(selected_fields=("id",)).to_arrow()["id"]
        rows, distinct = len(ids), int(pc.count_distinct(ids).as_py())
        commits = len(
            [snap for snap in table.snapshots() if snap.summary and COMMIT_ID_KEY in snap.summary]
        )
    finally:
        catalog.engine.dispose()
    control: dict[str, Any] = {
        "connector": CONNECTOR_CLASS,
        "tasks": source.partitions,
        "commit_interval_ms": COMMIT_INTERVAL_MS,
        "commits": commits,
        # RUNNING to every source partition held by a task: the consumer-group join that
        # the pipeline's clock (from a participant ready) leaves out.
        "assigned_s": None if assigned_s is None else round(assigned_s, 2),
        "records_per_s_from_assigned": (
            None if assigned_s is None else round(n / (seconds - assigned_s))
        ),
        "distinct_ids": distinct,
        "exact": rows == n and distinct == n,
    }
    return tp.RunResult(
        "kafka_connect", ["iceberg"], n, n / seconds, seconds, wall, {"iceberg": rows}, control, cpu
    )


def _create_table(s: Scenario) -> None:
    """The pipeline's table, made by the twophase iceberg sink's own setup (as
    :func:`bench.iceberg.direct_run` makes its own): schema, spec, properties all alike."""
    sink = IcebergSink.from_mapping(
        s.extra["sinks"][0], SinkContext(s.name, "bench", "lake", logging.getLogger("bench"))
    )
    sink.setup()
    sink.close()


def _total_records(catalog: SqlCatalog, s: Scenario) -> int:
    """Rows in the table's current snapshot, from its summary: no manifest is read."""
    try:
        snapshot = catalog.load_table(s.iceberg_table).current_snapshot()
    except NoSuchTableError:
        return -1
    if snapshot is None or snapshot.summary is None:
        return 0
    return int(snapshot.summary.get("total-records", "0"))


def _assigned(admin: AdminClient, group: str, partitions: int) -> bool:
    """The connector's consumer group stable with one member per task (one task per partition)
    and every source partition assigned: the first task to join takes all of them for a moment,
    which is not yet the group the run goes on with."""
    try:
        group_info = admin.describe_consumer_groups([group], request_timeout=5)[group].result()
    except KafkaException:  # not known to the coordinator yet
        return False
    if group_info.state != ConsumerGroupState.STABLE:  # a rebalance may yet move partitions
        return False
    held = sum(len(m.assignment.topic_partitions) for m in group_info.members)
    return len(group_info.members) == partitions and held == partitions


def _status(url: str, name: str) -> dict[str, Any] | None:
    try:
        status: dict[str, Any] = rest("GET", f"{url}/connectors/{name}/status")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:  # the worker has not read the new config back yet
            return None
        raise
    return status


def _states(status: dict[str, Any]) -> list[str]:
    return [status["connector"]["state"]] + [t["state"] for t in status.get("tasks", [])]


def _check_tasks(url: str, name: str) -> None:
    status = _status(url, name)
    if status is not None and "FAILED" in _states(status):
        raise RuntimeError(f"connector {name} failed: {json.dumps(status)[:4000]}")


def _wait_running(url: str, name: str) -> None:
    deadline = time.monotonic() + RUNNING_TIMEOUT_S
    status: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        status = _status(url, name)
        if status is not None:
            states = _states(status)
            if "FAILED" in states:
                raise RuntimeError(f"connector {name} failed: {json.dumps(status)[:4000]}")
            if status.get("tasks") and all(state == "RUNNING" for state in states):
                return
        time.sleep(0.05)
    raise TimeoutError(f"connector {name} not RUNNING after {RUNNING_TIMEOUT_S}s: {status}")


def _delete(url: str, admin: AdminClient, name: str) -> None:
    """Delete the connector and wait until its tasks and its commit coordinator have left
    their consumer groups. The worker forgets the connector at once but stops its tasks later;
    a coordinator still committing when its control topic is deleted hangs in its Kafka
    transaction for minutes (a thread left behind in the worker, beside the next run)."""
    try:
        rest("DELETE", f"{url}/connectors/{name}")
    except urllib.error.HTTPError as exc:
        if exc.code != 404:
            raise
    groups = [f"connect-{name}", f"connect-{name}-coord"]
    deadline = time.monotonic() + DELETE_TIMEOUT_S
    while time.monotonic() < deadline:
        if name not in rest("GET", f"{url}/connectors") and not any(
            _members(admin, g) for g in groups
        ):
            return
        time.sleep(0.2)
    log.warning("connector %s: tasks still in %s after %ss", name, groups, DELETE_TIMEOUT_S)


def _members(admin: AdminClient, group: str) -> int:
    try:
        return len(
            admin.describe_consumer_groups([group], request_timeout=5)[group].result().members
        )
    except KafkaException:  # a group the broker does not know has no members
        return 0


def _worker_pid() -> int:
    """The Connect worker's process id, from the pid file ``stack/connect.sh`` writes."""
    stack_dir = Path(load_stack_env()["TWOPHASE_STACK_DIR"])
    return int((stack_dir / "run" / "connect.pid").read_text().split()[0])
