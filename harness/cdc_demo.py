"""``make demo-cdc``: change data capture from a PostgreSQL database into a PostgreSQL replica,
MongoDB collections and change-row files at once, exactly once, through a SIGKILL.

Debezium's PostgreSQL connector, on the stack's Kafka Connect worker, captures the tables of a
source database -- ``customers``, ``orders`` and ``order_lines`` (keyed on ``(order_id, line)``)
-- one topic each. One twophase pipeline (a coordinator, two participants, one consumer group)
reads every table's topic through one ``topic_pattern`` and writes each change, in one
transaction per cycle, into

* ``replica``: a PostgreSQL table per source table (``table: ${topic}``), upserted on each
  table's own primary key;
* ``mongo`` and ``mongo_lines``: a MongoDB collection per table (``collection: ${topic}``),
  upserted with ``_id`` = the table's key. A MongoDB sink has one ``key`` for all its
  collections, so the tables keyed on ``id`` share one sink and ``order_lines`` has its own
  (``sinks[].topics`` says which sink takes which topic);
* ``files``: Parquet change rows, a directory per topic (``op_column``, ``source_columns``).

Meanwhile a driver runs random inserts, updates, deletes, primary-key changes and
delete-then-reinserts on the source, each in its own transaction, for a few minutes; a
fourth table (``refunds``) is created on the source a third of the way in and its topic joins
the running pipeline; halfway through, a participant is killed (SIGKILL) right after it
prepared a part, and restarted.

At the end every table is compared with its source, independently of the product
(``harness/cdc_check.py``): the replica table row for row, the collection document for
document (values converted back by the documented type rules: decimals, dates, timestamps
exactly), the change rows replayed in ``(partition, offset)`` order row for row. Exit status
0 only when every sink of every table equals its source, the killed participant was
restarted, nothing is left prepared in PostgreSQL or staged in MongoDB or the files, and
nothing was dead-lettered.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
import yaml
from confluent_kafka import Consumer, TopicPartition
from pymongo import MongoClient

from harness import Cluster, Scenario, cdc_check, control_summary, wait_until
from harness.cdc_check import Row, Table
from harness.debezium import ConnectDown, DebeziumSource, connect_url
from twophase.config import load_config
from twophase.kafka import create_topics

#: Source tables (and their replicas, created alike): name -> columns.
TABLES = {
    "customers": "id int PRIMARY KEY, name text NOT NULL, city text, since date",
    "orders": "id int PRIMARY KEY, customer int NOT NULL, total numeric(12, 2), "
    "placed timestamptz, note text",
    "order_lines": "order_id int, line int, sku text NOT NULL, qty int NOT NULL, "
    "price numeric(10, 2), PRIMARY KEY (order_id, line)",
}
#: Created on the source while the pipeline runs.
LATE_TABLE = ("refunds", "id int PRIMARY KEY, order_id int NOT NULL, amount numeric(12, 2)")
#: The one table not keyed on ``id``: its MongoDB collection has a sink of its own.
COMPOSITE = "order_lines"
SINKS = ("pg", "mongo", "files")
#: How long the sinks may take to catch up with the source once the driver stops. The kill
#: usually lands while the participant applies an earlier part to MongoDB, whose open
#: transaction then blocks that store for its lifetime (60 s, stack/README.md), and the
#: backlog built meanwhile drains at only ~20 records/s on a busy 2-core machine (parts of
#: ~20 records after the stall): 300-500 s were seen after 9,000 changes at 60/s.
CATCH_UP_S = 600.0
#: The killed participant is prepared every 500 ms cycle, so it dies within a second or two of
#: being armed; the margin is for a rebalance in between.
KILL_TIMEOUT_S = 60.0


class Changes:
    """Random changes on the source tables, each in its own transaction."""

    def __init__(self, dsn: str, seed: int) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.rnd = random.Random(seed)
        self.next_id = {"customers": 1, "orders": 1, "refunds": 1}
        self.kinds: dict[str, int] = {}

    def _ids(self, table: str) -> list[int]:
        return [r[0] for r in self.conn.execute(f"SELECT id FROM {table} ORDER BY id")]

    def _new(self, table: str) -> int:
        i = self.next_id[table]
        self.next_id[table] = i + 1
        return i

    def insert(self, table: str, key: tuple[int, ...] = ()) -> None:
        """A new row of ``table``; ``key``: with that key (a re-insert), else a new one."""
        r, c = self.rnd, self.conn
        if table == "customers":
            (i,) = key or (self._new(table),)
            city = r.choice(["Oslo", "Lyon", "Porto", None])
            since = f"2026-01-0{r.randint(1, 9)}"
            c.execute(
                "INSERT INTO customers VALUES (%s, %s, %s, %s)", (i, f"customer {i}", city, since)
            )
        elif table == "orders":
            (i,) = key or (self._new(table),)
            c.execute(
                "INSERT INTO orders VALUES (%s, %s, %s, now(), %s)",
                (i, r.randint(1, 50), f"{r.randint(1, 99999)}.{r.randint(0, 99):02d}", None),
            )
        elif table == "order_lines":
            order, line = key or (r.randint(1, 40), r.randint(1, 5))
            c.execute(
                "INSERT INTO order_lines VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                (order, line, f"sku-{r.randint(1, 500)}", r.randint(1, 9), "9.99"),
            )
        else:
            (i,) = key or (self._new(table),)
            c.execute(
                "INSERT INTO refunds VALUES (%s, %s, %s)",
                (i, r.randint(1, 40), f"{r.randint(1, 500)}.50"),
            )

    def step(self, tables: list[str]) -> None:
        r, c = self.rnd, self.conn
        table = r.choice(tables)
        kind = r.choices(
            ["insert", "update", "delete", "key change", "delete+reinsert"], [4, 4, 1, 1, 1]
        )[0]
        if table == "order_lines":
            rows = c.execute(
                "SELECT order_id, line FROM order_lines ORDER BY order_id, line"
            ).fetchall()
            if kind == "insert" or not rows:
                self.insert(table)
                kind = "insert"
            else:
                o, line = r.choice(rows)
                if kind == "update":
                    c.execute(
                        "UPDATE order_lines SET qty = qty + 1, price = %s WHERE order_id = %s"
                        " AND line = %s",
                        (f"{r.randint(1, 99)}.{r.randint(0, 99):02d}", o, line),
                    )
                elif kind in ("delete", "delete+reinsert"):
                    c.execute(
                        "DELETE FROM order_lines WHERE order_id = %s AND line = %s", (o, line)
                    )
                    if kind == "delete+reinsert":
                        self.insert(table, (o, line))
                else:  # a composite key's part changes: Debezium sends a delete and a create
                    c.execute(
                        "UPDATE order_lines SET line = line + 10 WHERE order_id = %s AND line = %s"
                        " AND NOT EXISTS (SELECT 1 FROM order_lines WHERE order_id = %s"
                        " AND line = %s)",
                        (o, line, o, line + 10),
                    )
        else:
            ids = self._ids(table)
            if kind == "insert" or not ids:
                self.insert(table)
                kind = "insert"
            else:
                i = r.choice(ids)
                if kind == "update":
                    column = {"customers": "city", "orders": "note", "refunds": "amount"}[table]
                    value = (
                        f"{r.randint(1, 999)}.25" if table == "refunds" else f"v{r.random():.6f}"
                    )
                    c.execute(f"UPDATE {table} SET {column} = %s WHERE id = %s", (value, i))
                elif kind in ("delete", "delete+reinsert"):
                    c.execute(f"DELETE FROM {table} WHERE id = %s", (i,))
                    if kind == "delete+reinsert":
                        self.insert(table, (i,))
                else:
                    c.execute(f"UPDATE {table} SET id = %s WHERE id = %s", (self._new(table), i))
        self.kinds[kind] = self.kinds.get(kind, 0) + 1


def dead_letters(s: Scenario) -> list[bytes | None]:
    """Every message on the pipeline's dead-letter topic (read to its end)."""
    consumer = Consumer(
        {
            "bootstrap.servers": s.bootstrap,
            "group.id": f"cdc-demo-{uuid.uuid4().hex[:6]}",
            "auto.offset.reset": "earliest",
            "enable.partition.eof": True,
        }
    )
    consumer.assign([TopicPartition(f"{s.name}.dlq", 0, 0)])
    out: list[bytes | None] = []
    while (m := consumer.poll(5)) is not None and m.error() is None:
        out.append(m.value())
    consumer.close()
    return out


class Replicas:
    """Where each source table's copies are, and what each holds, read from the stores."""

    def __init__(self, s: Scenario, name: str, files: Path) -> None:
        self.s, self.name, self.files = s, name, files
        self.tables: dict[str, Table] = {}

    def relation(self, table: str) -> str:
        return f"{self.name}_{table}"

    def read(self, table: str) -> dict[str, list[Row]]:
        """Each sink's copy of ``table`` as rows of the source table's shape, in key order."""
        t, s = self.tables[table], self.s
        return {
            "pg": cdc_check.pg_rows(s.pg_dsn, t, self.relation(table)),
            "mongo": cdc_check.mongo_rows(s.mongo_uri, self.name, table, t),
            "files": cdc_check.replayed_rows(self.files / f"{self.name}.public.{table}", t),
        }

    def equal(self, expected: dict[str, list[Row]]) -> bool:
        return all(
            cdc_check.same(rows, expected[t]) for t in expected for rows in self.read(t).values()
        )


def pipeline_config(s: Scenario, name: str, files: Path) -> dict[str, object]:
    raw = s.config()
    prefix = re.escape(f"{name}.public.")
    to_table = [f"^{prefix}", ""]  # RegexRouter: cdc_x.public.orders -> orders
    raw["sources"] = [
        {"topic_pattern": prefix + r"[a-z_]+", "format": "debezium", "key_format": "json"}
    ]
    raw["commit"]["interval_ms"] = 500
    mongo = {
        "type": "mongodb",
        "uri": s.mongo_uri,
        "database": name,
        "collection": "${topic}",
        "topic_replace": to_table,
        "mode": "upsert",
    }
    raw["sinks"] = [
        {
            "name": "replica",
            "type": "postgres",
            "dsn": s.pg_dsn,
            "table": "${topic}",
            "topic_replace": [f"^{prefix}", f"{name}_"],
            "mode": "upsert",  # keyed on each table's primary key
        },
        # One MongoDB sink has one key for all its collections: every table keyed on id (the
        # late one included), and the table keyed on two columns with a sink of its own.
        {"name": "mongo", **mongo, "key": ["id"], "topics": [f"{prefix}(?!{COMPOSITE}$)[a-z_]+"]},
        {
            "name": "mongo_lines",
            **mongo,
            "key": ["order_id", "line"],
            "topics": [prefix + COMPOSITE],
        },
        {
            "name": "files",
            "type": "files",
            "path": str(files),
            "format": "parquet",
            "partition_by": "topic",
            "op_column": "_op",
            "source_columns": True,  # _partition, _offset: the order to replay the rows in
        },
    ]
    return raw


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.cdc_demo", description=__doc__)
    # 2.5 minutes of changes; the pipeline keeps up with 60/s until the kill, not after it.
    ap.add_argument("--changes", type=int, default=3_000)
    ap.add_argument(
        "--rate", type=float, default=20.0, help="changes per second on the source (at most)"
    )
    ap.add_argument("--workdir", default="")
    ap.add_argument(
        "--keep", action="store_true", help="keep the source database, its topics and replicas"
    )
    args = ap.parse_args(argv)
    try:
        url = connect_url()
    except ConnectDown as exc:
        print(f"FAILED: {exc}")
        return 1
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="twophase-cdc-demo-"))
    s = Scenario.on_stack(f"cdc-{uuid.uuid4().hex[:6]}", workdir, mongo=False, files=False)
    name = s.name.replace("-", "_")
    source = DebeziumSource(url, s.pg_dsn, s.bootstrap, name)
    source.create_database()
    replicas = Replicas(s, name, workdir / "changes")
    crash_file = workdir / "crash-worker-0"
    cluster = Cluster(s)
    tables = list(TABLES)
    expected: dict[str, list[Row]] = {}
    killed: bool | None = None  # once worker-0 died: whether at its crash point
    started = time.monotonic()
    try:
        with psycopg.connect(source.dsn, autocommit=True) as conn:
            for table, columns in TABLES.items():
                conn.execute(f"CREATE TABLE {table} ({columns})")
        with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
            for table, columns in [*TABLES.items(), LATE_TABLE]:
                conn.execute(f'DROP TABLE IF EXISTS "{replicas.relation(table)}"')
                conn.execute(f'CREATE TABLE "{replicas.relation(table)}" ({columns})')
        changes = Changes(source.dsn, seed=29)
        for table in TABLES:
            for _ in range(15):
                changes.insert(table)  # the snapshot's rows (op r)

        s.config_path.parent.mkdir(parents=True, exist_ok=True)
        s.config_path.write_text(
            yaml.safe_dump(pipeline_config(s, name, replicas.files), sort_keys=False)
        )
        create_topics(load_config(s.config_path))
        print(f"pipeline {s.name}: config {s.config_path}, logs {workdir / 'logs'}")
        topics = source.start(
            [f"public.{t}" for t in TABLES],
            **{
                "table.include.list": "public\\..*",  # tables created later too
                "publication.autocreate.mode": "all_tables",
                "topic.creation.default.partitions": "2",
            },
        )
        print(f"Debezium captures {len(topics)} tables: {', '.join(topics)}")

        cluster.start("coordinator", "coordinator-0")
        # worker-0 dies by SIGKILL at its first prepare after the file is written (halfway).
        cluster.start("participant", "worker-0", {"TWOPHASE_CRASH_FILE": str(crash_file)})
        cluster.start("participant", "worker-1")
        drive_started = time.monotonic()
        for n in range(args.changes):
            changes.step(tables)
            # A steady stream: many commit cycles pass during the run.
            ahead = drive_started + (n + 1) / args.rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
            if n == args.changes // 3:
                late, columns = LATE_TABLE
                with psycopg.connect(source.dsn, autocommit=True) as conn:
                    conn.execute(f"CREATE TABLE {late} ({columns})")
                source.topics.append(f"{name}.public.{late}")
                tables.append(late)
                print(f"created table {late} on the source while the pipeline runs")
            if n == args.changes // 2:
                crash_file.write_text("after_prepare:1:mid-run")
                print(f"change {n}: worker-0 to be killed (SIGKILL) right after its next prepare")
            if n >= args.changes // 2 and killed is None and not cluster.alive("worker-0"):
                killed = restart(cluster)
        drive_ended = time.monotonic()
        print(f"{args.changes} changes in {drive_ended - drive_started:.0f}s")
        if killed is None:
            wait_until(lambda: not cluster.alive("worker-0"), KILL_TIMEOUT_S, "worker-0 to die")
            killed = restart(cluster)
        replicas.tables = {t: cdc_check.source_table(source.dsn, t) for t in tables}
        expected = {t: cdc_check.pg_rows(source.dsn, replicas.tables[t]) for t in tables}
        # Equal is not yet done: an aborted part of the killed participant stays prepared (no
        # reader sees it) until its restart has worked through its recovery, which waits out the
        # dead process's MongoDB transaction first. Done is equal with nothing left behind.
        wait_until(
            lambda: replicas.equal(expected) and not any(left_behind(s, replicas)),
            CATCH_UP_S,
            "every sink to equal the source with nothing left prepared or staged",
        )
        print(f"every sink equal to the source {time.monotonic() - drive_ended:.0f}s later")
    except TimeoutError as exc:
        print(f"FAILED: {exc}")
        for proc in cluster.procs:
            print(f"--- {proc}\n{cluster.log_tail(proc, 30)}")
    finally:
        cluster.stop_all()
    elapsed = time.monotonic() - started
    ok = report(s, replicas, expected, changes.kinds, bool(killed), elapsed) if expected else False
    if not args.keep:
        source.stop()
        source.drop()
        if ok:
            drop_replicas(s, replicas, tables)
        elif gids := cdc_check.pg_rollback_prepared(s.pg_dsn, s.name):
            # The replicas stay for a look; prepared transactions would hold back every later
            # logical replication slot on this server (the next Debezium connector's included).
            print(f"rolled back {len(gids)} transactions left prepared: {', '.join(gids)}")
    print("\nVERIFIED: every sink of every table equals its source table" if ok else "\nFAILED")
    return 0 if ok else 1


def restart(cluster: Cluster) -> bool:
    """Restart worker-0 after its death (with no crash file: a supervisor's restart); whether
    it died at its crash point, right after a prepare."""
    log = cluster.logs / "worker-0.log"
    prepared = "crash point after_prepare reached" in log.read_text(errors="replace")
    print(
        "worker-0 killed with a prepared, undecided part; restarting it"
        if prepared
        else "worker-0 died, but not at its crash point; restarting it"
    )
    cluster.start("participant", "worker-0")
    return prepared


def report(
    s: Scenario,
    replicas: Replicas,
    expected: dict[str, list[Row]],
    kinds: dict[str, int],
    restarted: bool,
    elapsed: float,
) -> bool:
    """Print each table's comparison and what is left behind; whether everything is right."""
    print(f"\n{'table':12} {'source':>7} {'pg':>7} {'mongo':>7} {'files':>7}  equal")
    ok = True
    wrong: list[str] = []
    for t, want in expected.items():
        got = replicas.read(t)
        differ = [sink for sink in SINKS if not cdc_check.same(got[sink], want)]
        ok = ok and not differ
        counts = " ".join(f"{len(got[sink]):7d}" for sink in SINKS)
        print(f"{t:12} {len(want):7d} {counts}  {'NO: ' + ', '.join(differ) if differ else 'yes'}")
        for sink in differ:
            diff = cdc_check.differences(replicas.tables[t], got[sink], want)
            wrong.append(f"{t} in {sink} (- source, + {sink}):\n    " + "\n    ".join(diff))
    for lines in wrong:
        print(f"\n{lines}")
    summary = control_summary(s)
    prepared, staged, files = left_behind(s, replicas)
    dead = dead_letters(s)
    print(f"\nchanges on the source: {kinds}")
    print(
        f"transactions committed {summary['committed']}, aborted {summary['aborted']} "
        f"{summary['abort_reasons'] or ''}"
    )
    print(
        f"left behind: prepared in PostgreSQL {prepared}, staged in MongoDB {staged}, "
        f"staged files {files}; dead letters: {len(dead)}; {elapsed:.0f}s"
    )
    if not restarted:
        print("worker-0 was not killed at its crash point and restarted")
    return ok and restarted and prepared == staged == files == len(dead) == 0


def left_behind(s: Scenario, replicas: Replicas) -> tuple[int, int, int]:
    """:func:`cdc_check.left_behind` of the demo's pipeline and replicas."""
    return cdc_check.left_behind(s.pg_dsn, s.mongo_uri, replicas.name, replicas.files, s.name)


def drop_replicas(s: Scenario, replicas: Replicas, tables: list[str]) -> None:
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        for t in tables:
            conn.execute(f'DROP TABLE IF EXISTS "{replicas.relation(t)}"')
    client: MongoClient[dict[str, object]] = MongoClient(s.mongo_uri)
    with client:
        client.drop_database(replicas.name)


if __name__ == "__main__":
    sys.exit(main())
