"""``make demo-cdc``: change data capture from a PostgreSQL database into PostgreSQL replicas.

Debezium's PostgreSQL connector, on the stack's Kafka Connect worker, captures the tables of a
source database -- ``customers``, ``orders`` and ``order_lines`` (keyed on ``(order_id, line)``)
-- one topic each. One twophase pipeline (a coordinator, two participants) reads every table's
topic through one ``topic_pattern`` and writes each into its replica table through one
PostgreSQL sink whose ``table`` is a template, keyed on each table's primary key. Meanwhile
random inserts, updates, deletes and primary-key changes run on the source, a participant is
killed (SIGKILL) right after it prepared a part, and a fourth table (``refunds``) is created on
the source: its topic joins the running pipeline.

At the end every replica table is compared with its source table, row for row, by plain SQL.
Exit status 0 only when every table matches, nothing is left prepared and nothing was
dead-lettered.
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
from typing import Any

import psycopg
import yaml
from confluent_kafka import Consumer, TopicPartition

from harness import Cluster, Scenario, control_summary, wait_until
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
KEYS = {"customers": "id", "orders": "id", "order_lines": "order_id, line", "refunds": "id"}


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

    def insert(self, table: str) -> None:
        r, c = self.rnd, self.conn
        if table == "customers":
            i = self._new(table)
            city = r.choice(["Oslo", "Lyon", "Porto", None])
            since = f"2026-01-0{r.randint(1, 9)}"
            c.execute(
                "INSERT INTO customers VALUES (%s, %s, %s, %s)", (i, f"customer {i}", city, since)
            )
        elif table == "orders":
            i = self._new(table)
            c.execute(
                "INSERT INTO orders VALUES (%s, %s, %s, now(), %s)",
                (i, r.randint(1, 50), f"{r.randint(1, 99999)}.{r.randint(0, 99):02d}", None),
            )
        elif table == "order_lines":
            order = r.randint(1, 40)
            c.execute(
                "INSERT INTO order_lines VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                (order, r.randint(1, 5), f"sku-{r.randint(1, 500)}", r.randint(1, 9), "9.99"),
            )
        else:
            i = self._new(table)
            c.execute(
                "INSERT INTO refunds VALUES (%s, %s, %s)",
                (i, r.randint(1, 40), f"{r.randint(1, 500)}.50"),
            )

    def step(self, tables: list[str]) -> None:
        r, c = self.rnd, self.conn
        table = r.choice(tables)
        kind = r.choices(["insert", "update", "delete", "key change"], [4, 4, 1, 1])[0]
        if table == "order_lines":
            rows = c.execute("SELECT order_id, line FROM order_lines").fetchall()
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
                elif kind == "delete":
                    c.execute(
                        "DELETE FROM order_lines WHERE order_id = %s AND line = %s", (o, line)
                    )
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
                elif kind == "delete":
                    c.execute(f"DELETE FROM {table} WHERE id = %s", (i,))
                else:
                    c.execute(f"UPDATE {table} SET id = %s WHERE id = %s", (self._new(table), i))
        self.kinds[kind] = self.kinds.get(kind, 0) + 1

    def rows(self, table: str) -> list[tuple[Any, ...]]:
        return self.conn.execute(f"SELECT * FROM {table} ORDER BY {KEYS[table]}").fetchall()


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


def replica_rows(dsn: str, table: str, key: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(f'SELECT * FROM "{table}" ORDER BY {key}').fetchall()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.cdc_demo", description=__doc__)
    ap.add_argument("--changes", type=int, default=3_000)
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
    replicas = {t: f"{name}_{t}" for t in [*TABLES, LATE_TABLE[0]]}
    cluster = Cluster(s)
    started = time.monotonic()
    try:
        with psycopg.connect(source.dsn, autocommit=True) as conn:
            for table, columns in TABLES.items():
                conn.execute(f"CREATE TABLE {table} ({columns})")
        with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
            for table, columns in [*TABLES.items(), LATE_TABLE]:
                conn.execute(f'DROP TABLE IF EXISTS "{replicas[table]}"')
                conn.execute(f'CREATE TABLE "{replicas[table]}" ({columns})')
        changes = Changes(source.dsn, seed=29)
        for table in TABLES:
            for _ in range(15):
                changes.insert(table)  # the snapshot's rows (op r)

        raw = s.config()
        raw["sources"] = [
            {
                "topic_pattern": re.escape(f"{name}.public.") + r"[a-z_]+",
                "format": "debezium",
                "key_format": "json",
            }
        ]
        raw["commit"]["interval_ms"] = 500
        raw["sinks"] = [
            {
                "name": "replica",
                "type": "postgres",
                "dsn": s.pg_dsn,
                "table": "${topic}",
                "topic_replace": [f"^{re.escape(name)}\\.public\\.", f"{name}_"],
                "mode": "upsert",  # keyed on each table's primary key
            }
        ]
        s.config_path.parent.mkdir(parents=True, exist_ok=True)
        s.config_path.write_text(yaml.safe_dump(raw, sort_keys=False))
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
        # worker-0 dies by SIGKILL right after it prepares its 3rd part, before the decision.
        cluster.start("participant", "worker-0", {"TWOPHASE_CRASH_AT": "after_prepare:3"})
        cluster.start("participant", "worker-1")
        tables = list(TABLES)
        restarted = False
        for n in range(args.changes):
            changes.step(tables)
            if n % 10 == 0:
                time.sleep(0.1)  # a steady stream: many commit cycles pass during the run
            if not restarted and not cluster.alive("worker-0"):
                print("worker-0 killed with a prepared, undecided part; restarting it")
                cluster.start("participant", "worker-0")
                restarted = True
            if n == args.changes // 3:
                late, columns = LATE_TABLE
                with psycopg.connect(source.dsn, autocommit=True) as conn:
                    conn.execute(f"CREATE TABLE {late} ({columns})")
                source.topics.append(f"{name}.public.{late}")
                tables.append(late)
                print(f"created table {late} on the source while the pipeline runs")
        expected = {t: changes.rows(t) for t in tables}

        def matches() -> bool:
            return all(replica_rows(s.pg_dsn, replicas[t], KEYS[t]) == expected[t] for t in tables)

        wait_until(matches, 300, "every replica table to equal its source table")
    except TimeoutError as exc:
        print(f"FAILED: {exc}")
        for proc in cluster.procs:
            print(f"--- {proc}\n{cluster.log_tail(proc, 30)}")
        for t in tables:
            got = replica_rows(s.pg_dsn, replicas[t], KEYS[t])
            wrong = sorted(set(got) ^ set(expected[t]))[:6]
            print(f"{t}: source {len(expected[t])} rows, replica {len(got)}; differ: {wrong}")
        if not args.keep:
            source.stop()
            source.drop()
        return 1
    finally:
        cluster.stop_all()
    elapsed = time.monotonic() - started
    with psycopg.connect(s.pg_dsn) as conn:
        prepared = conn.execute(
            "SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE %s", (f"%:{s.name}~%",)
        ).fetchone()
    summary = control_summary(s)
    dead = dead_letters(s)
    print(f"\n{'table':14} {'source rows':>11} {'replica rows':>12} {'equal':>6}")
    ok = True
    for t in tables:
        got = replica_rows(s.pg_dsn, replicas[t], KEYS[t])
        same = got == expected[t]
        ok = ok and same
        print(f"{t:14} {len(expected[t]):11d} {len(got):12d} {'yes' if same else 'NO':>6}")
    print(f"\nchanges on the source: {changes.kinds}")
    print(
        f"transactions committed {summary['committed']}, aborted {summary['aborted']} "
        f"{summary['abort_reasons'] or ''}"
    )
    left = int(prepared[0]) if prepared else -1
    print(f"prepared transactions left: {left}; dead letters: {len(dead)}; {elapsed:.0f}s")
    ok = ok and left == 0 and not dead and restarted
    if not args.keep:
        source.stop()
        source.drop()
    print("\nVERIFIED: every replica table equals its source table" if ok else "\nFAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
