"""``make demo``: a pipeline on generated order events into PostgreSQL, MongoDB, Parquet files and
an Iceberg table, with one participant killed mid-transaction, then an independent verification
of every sink -- the Iceberg table also counted by Spark SQL.

Exit status 0 only when every sink holds every record exactly once, nothing is left prepared or
staged, and the consumer group's committed offsets equal the end offsets.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from harness import (
    Cluster,
    Scenario,
    control_summary,
    end_offsets,
    group_offsets,
    load_stack_env,
    produce,
    verify,
    wait_until,
)
from twophase.config import load_config
from twophase.kafka import create_topics


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.demo", description=__doc__)
    ap.add_argument("--records", type=int, default=50_000)
    ap.add_argument("--participants", type=int, default=2)
    ap.add_argument("--workdir", default="")
    args = ap.parse_args(argv)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="twophase-demo-"))
    s = Scenario.on_stack(f"demo-{uuid.uuid4().hex[:6]}", workdir, iceberg=True)
    s.write()
    s.prepare_stores()
    print(f"pipeline {s.name}: config {s.config_path}, logs {workdir / 'logs'}")
    print(f"topics: {create_topics(load_config(s.config_path))}")
    started = time.monotonic()
    produce(s.bootstrap, s.topic, 0, args.records)
    print(f"produced {args.records} order events to {s.topic} ({s.partitions} partitions)")

    cluster = Cluster(s)
    cluster.start("coordinator", "coordinator-0")
    cluster.start("coordinator", "coordinator-1")
    # worker-0 is killed (SIGKILL) right after its 3rd vote, with its part prepared and undecided.
    cluster.start("participant", "worker-0", {"TWOPHASE_CRASH_AT": "after_vote:3"})
    for i in range(1, args.participants):
        cluster.start("participant", f"worker-{i}")
    expected = set(range(args.records))
    try:
        wait_until(lambda: not cluster.alive("worker-0"), 120, "worker-0 to crash")
        print("worker-0 killed with a prepared, undecided part; restarting it")
        cluster.start("participant", "worker-0")
        wait_until(
            lambda: (
                group_offsets(s.bootstrap, f"twophase.{s.name}", s.topic, s.partitions)
                == end_offsets(s.bootstrap, s.topic, s.partitions)
            ),
            900,
            "the committed offsets to reach the end of the source topic",
        )
        wait_until(lambda: all(r.ok for r in verify(s, expected).values()), 180, "sinks to apply")
    except TimeoutError as exc:
        print(f"FAILED: {exc}")
        for name in cluster.procs:
            print(f"--- {name}\n{cluster.log_tail(name, 30)}")
        return 1
    finally:
        cluster.stop_all()
    elapsed = time.monotonic() - started
    reports = verify(s, expected)
    summary = control_summary(s)
    print()
    print(
        f"{'sink':8} {'records':>9} {'distinct':>9} {'duplicates':>10} {'missing':>8} {'prepared':>8} {'staged':>7}"
    )
    for name, r in reports.items():
        print(
            f"{name:8} {r.rows:9d} {r.distinct:9d} {r.duplicated:10d} {r.missing:8d} "
            f"{r.orphaned_prepared:8d} {r.staging_leftovers:7d}"
        )
    lat = summary["commit_latency_ms"]
    print(
        f"\ntransactions committed {summary['committed']}, aborted {summary['aborted']} "
        f"{summary['abort_reasons'] or ''}"
    )
    print(f"commit latency (PREPARE -> DECISION) p50 {lat['p50']} ms, p99 {lat['p99']} ms")
    print(
        f"{args.records} records in {elapsed:.1f}s end to end ({args.records / elapsed:.0f}/s; "
        "MongoDB here is SecantusDB, a slow test server)"
    )
    ok = all(r.ok for r in reports.values())
    spark_count = _spark_count(s)
    print(
        "\nrows as each reader counts them: "
        + ", ".join(f"{name} {r.rows:,}" for name, r in reports.items())
        + f", Iceberg through Spark SQL {spark_count:,}"
    )
    if spark_count != args.records:
        print(f"Spark SQL counted {spark_count} rows in {s.iceberg_table}, not {args.records}")
        ok = False
    print("\nVERIFIED: every record exactly once in every sink" if ok else "\nVERIFICATION FAILED")
    return 0 if ok else 1


def _spark_count(s: Scenario) -> int:
    """The Iceberg table's rows as Spark SQL counts them (``jobs/read_iceberg.py`` on local[2],
    through Iceberg's JdbcCatalog on the catalog the sink wrote): -1 when the job failed."""
    env = {**os.environ}
    env.setdefault("TWOPHASE_SPARK_JARS", load_stack_env().get("TWOPHASE_SPARK_JARS", ""))
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "twophase.jobs.read_iceberg",
            "--uri",
            s.pg_dsn,
            "--catalog",
            s.table,
            "--warehouse",
            f"file://{s.warehouse}",
            "--table",
            s.iceberg_table,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if run.returncode != 0:
        print(f"the Spark read of {s.iceberg_table} failed:\n{run.stderr[-3000:]}")
        return -1
    return int(json.loads(run.stdout.strip().splitlines()[-1])["count"])


if __name__ == "__main__":
    sys.exit(main())
