"""Flink 2.0's exactly-once JDBC sink as a peer of the PostgreSQL-only pipeline (issue #20).

The job (``bench/peers/flink/src``, built with its jars by ``bench/peers/fetch.sh flink`` from
``bench/peers/flink/pom.xml``) runs on a local MiniCluster inside one JVM, started here with
``java -cp``: a ``KafkaSource`` on the same topic the pipeline reads (earliest offsets,
``read_committed``, one reader per partition), a map from the JSON value to a POJO, and
``JdbcSink.builder()...buildExactlyOnce(...)`` with a ``PGXADataSource``, upserting by ``id``
(``INSERT ... ON CONFLICT (id) DO UPDATE``) into a table made beforehand like the Debezium JDBC
peer's (:data:`bench.kc_peers.COLUMNS_DDL` plus the primary key an upsert needs). Parallelism =
the topic's partitions; checkpointing every :data:`CHECKPOINT_MS`, the pipeline's commit
interval in these runs, since the XA sink commits once per checkpoint: both commit as often.

Settings, each from the connector's or the driver's documentation:

* ``JdbcExactlyOnceOptions.withTransactionPerConnection(true)``: the connector's docs ask for it
  on databases that allow a single XA transaction per connection, "e.g. PostgreSQL, MySQL".
* ``JdbcExecutionOptions.withMaxRetries(0)``: the XA sink refuses anything else (FLINK-22311).
* ``batchSize`` :data:`JDBC_BATCH`; pgjdbc's ``reWriteBatchedInserts`` (the driver's documented
  batch speed-up: a JDBC batch sent as multi-row ``INSERT``\\ s) left off, as measured: see
  :data:`JDBC_BATCH`.

What the connector does on commit, as published (4.0.0-2.0; ``bench/peers/README.md`` has the
evidence): its writer commits each subtask's XA transaction while the checkpoint is being taken,
right after preparing it, not when the checkpoint has completed. A run without failures
delivers exactly; a checkpoint that fails after some subtasks committed replays their records.

A run is timed as :mod:`bench.kc_peers` times a connector: from the job's tasks running (every
subtask's operators open: the job prints ``OPEN <subtask>``; JVM and MiniCluster start-up left
out, as the pipeline's process start-up is) to every record visible in the table (polled every
0.1 s: each partition's last record by ``id``, then ``count(*)``). The run's ``control`` also holds ``assigned_s`` -- tasks running to every
source subtask's first record (``FIRST <subtask>``: its partition assigned by the source's
enumerator and flowing; a ``KafkaSource`` has no consumer group to watch) -- and the rate from
then on (``records_per_s_from_assigned``), ``startup_s`` (JVM launch to tasks running) and
whether the table holds exactly the source's ids (``exact``: rows == distinct ids == records,
ids 0..records-1 as ``harness.produce`` writes them). ``cpu_s`` and ``rss_peak_mb`` are the
JVM's (launch to done; it runs the whole MiniCluster). Each run has its own job id, table and
consumer group (``flink-<table>``, where the source commits its offsets on checkpoints); after
the JVM is stopped, whatever XA transaction of this job is still prepared is rolled back (its
global ids embed the job id) and the table and group are deleted.

:func:`section` is the ``make bench`` section (``--only flink``): the PostgreSQL-only pipeline
and the Flink job alternately on the same records, ``--runs`` times each.
``python -m bench.flink_peer --records N --runs R`` runs it alone on the local stack.
"""

from __future__ import annotations

import argparse
import base64
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import psycopg
from confluent_kafka.admin import AdminClient
from psycopg import sql

from bench import kc_peers
from bench import throughput as tp
from harness import Scenario, load_stack_env

__all__ = [
    "CHECKPOINT_MS",
    "JDBC_BATCH",
    "JOB_CLASS",
    "classpath",
    "flink_run",
    "section",
]

REPO = Path(__file__).resolve().parents[1]
JOB_CLASS = "dev.twophase.bench.flink.FlinkJdbcPeer"
#: The pipeline's commit interval in the bench's runs (the scenario's ``commit.interval_ms``):
#: the job's checkpoint interval, i.e. how often its XA transactions commit.
CHECKPOINT_MS: int = Scenario.interval_ms
#: Records per JDBC batch (the connector's default is 5,000; a checkpoint flushes what is left):
#: the Debezium peer's (``bench.kc_peers.JDBC_BATCH``). Measured on 200,000 records, the shared
#: 2-core machine, 2026-11-26, records/s from tasks running. At load ~10, two rounds: 2,000 with
#: pgjdbc's ``reWriteBatchedInserts`` 12,940 / 11,081; 5,000 with it 13,475 / 16,036; 2,000
#: without it 17,147 / 22,542 (the rewritten multi-row upserts are re-planned for every batch).
#: Without it, at load 10-25: 2,000 14,176 / 3,479; 5,000 8,276 / 3,326; 10,000 5,242 / 3,919;
#: 500 6,558 / 3,741 -- the load decided those, not the size.
JDBC_BATCH = kc_peers.JDBC_BATCH
#: The JVM, the MiniCluster and its tasks are up in 5-15 s here; the margin is for the shared
#: 2-core machine (80 s were seen at load average 30).
RUNNING_TIMEOUT_S = 180.0
#: SIGTERM runs the JVM's shutdown hooks (the MiniCluster's temporary directories); a JVM still
#: there after this long is killed.
STOP_TIMEOUT_S = 30.0
#: The XA transaction format id of flink-connector-jdbc's ``TransactionId``; pgjdbc names a
#: prepared transaction ``<format id>_<base64 global id>_<base64 branch>``.
XA_FORMAT_ID = 202

log = logging.getLogger(__name__)


def classpath() -> str:
    """The job's jar and its dependencies, fetched and built by ``bench/peers/fetch.sh flink``
    on first use (cached; rebuilt when the pom or the job's sources change)."""
    out = subprocess.run(
        ["bash", str(REPO / "bench" / "peers" / "fetch.sh"), "flink"],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout.strip()
    if not out:
        raise RuntimeError("bench/peers/fetch.sh flink printed no classpath")
    return out


class _Marks:
    """The job's stdout clock marks (``OPEN <subtask>``, ``FIRST <subtask>``), each stamped
    with ``time.monotonic()`` on arrival, read by a thread so the poll loop never blocks."""

    def __init__(self, stream: IO[str]) -> None:
        self.seen: dict[str, dict[int, float]] = {"OPEN": {}, "FIRST": {}}
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            now = time.monotonic()
            parts = line.split()
            with self._lock:
                self.lines.append(line.rstrip())
                if len(parts) == 2 and parts[0] in self.seen and parts[1].isdigit():
                    self.seen[parts[0]].setdefault(int(parts[1]), now)

    def all_at(self, mark: str, subtasks: int) -> float | None:
        """When the last of ``subtasks`` subtasks printed ``mark``; None before."""
        with self._lock:
            got = self.seen[mark]
            return max(got.values()) if len(got) >= subtasks else None


def flink_run(
    source: tp.Source,
    workdir: Path,
    *,
    cp: str | None = None,
    batch: int = JDBC_BATCH,
    checkpoint_ms: int = CHECKPOINT_MS,
    rewrite_batched_inserts: bool = False,
    timeout_s: float = 900.0,
    keep_table: bool = False,
) -> tp.RunResult:
    """One run of the Flink job over ``source`` into a fresh table (see the module docstring);
    ``cp`` is :func:`classpath`'s answer (fetched when not given). With ``keep_table`` the table
    is left for the caller to read and drop (its name in ``control["table"]``)."""
    cp = cp or classpath()
    pg_dsn = load_stack_env()["TWOPHASE_PG_DSN"]
    name = f"bench-flink-{uuid.uuid4().hex[:6]}"
    table = f"{name.replace('-', '_')}_orders"
    job_id = uuid.uuid4()
    workdir.mkdir(parents=True, exist_ok=True)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} ({kc_peers.COLUMNS_DDL}, PRIMARY KEY (id))")
    try:
        seconds, wall, control, cpu, rss = _timed(
            name, source, pg_dsn, table, job_id, workdir, cp, batch, checkpoint_ms,
            rewrite_batched_inserts, timeout_s,
        )  # fmt: skip
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            got = conn.execute(
                f"SELECT count(*), count(DISTINCT id), min(id), max(id) FROM {table}"
            ).fetchone()
    except BaseException:
        _cleanup(pg_dsn, source.bootstrap, table, job_id, drop=True)
        raise
    left = _cleanup(pg_dsn, source.bootstrap, table, job_id, drop=not keep_table)
    count, distinct, lo, hi = got if got else (0, 0, None, None)
    n = source.records
    control |= {
        "batch_size": batch,
        "checkpoint_ms": checkpoint_ms,
        "rewrite_batched_inserts": rewrite_batched_inserts,
        "distinct_ids": int(distinct),
        # Every id of the source (0..n-1) once and nothing else.
        "exact": count == n and distinct == n and lo == 0 and hi == n - 1,
        # XA transactions of the job still prepared once its JVM was stopped (rolled back).
        "left_prepared": left,
        **({"table": table} if keep_table else {}),
    }
    return tp.RunResult(
        "flink", ["pg"], n, n / seconds, seconds, wall, {"pg": int(count)}, control, cpu, rss
    )


def _timed(
    name: str,
    source: tp.Source,
    pg_dsn: str,
    table: str,
    job_id: uuid.UUID,
    workdir: Path,
    cp: str,
    batch: int,
    checkpoint_ms: int,
    rewrite_batched_inserts: bool,
    timeout_s: float,
) -> tuple[float, float, dict[str, Any], dict[str, float], dict[str, float]]:
    """Start the job's JVM, wait for its tasks running, then until the table counts every
    record; stop the JVM. The seconds from tasks running to done, the wall seconds from launch,
    the run's ``control``, the JVM's CPU seconds and peak RSS."""
    url, user, password = tp.jdbc(pg_dsn)
    if rewrite_batched_inserts:
        url += "?reWriteBatchedInserts=true"
    tmp = workdir / f"{name}-tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"{name}.log"
    cmd = [
        "java",
        # The MiniCluster's blob store and temporary files: under the run's directory, removed
        # with it even if the JVM has to be killed.
        f"-Djava.io.tmpdir={tmp}",
        "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
        "-Dorg.slf4j.simpleLogger.showDateTime=true",
        # One "Name collision" line per checkpoint and subtask (Flink's sink metrics register
        # the committer's gauge twice): noise, not a fault.
        "-Dorg.slf4j.simpleLogger.log.org.apache.flink.metrics=error",
        "-cp",
        cp,
        JOB_CLASS,
        source.bootstrap,
        source.topic,
        url,
        user,
        table,
        str(source.partitions),
        job_id.hex,
        str(batch),
        str(checkpoint_ms),
    ]
    n = source.records
    last = tp.last_ids(source)  # before the JVM: nothing to stop if it fails
    started = time.monotonic()
    with log_path.open("w") as err:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            # The job reads the password from here, not from its command line.
            env={**os.environ, "PGPASSWORD": password},
        )
    assert proc.stdout is not None  # stdout=PIPE
    marks = _Marks(proc.stdout)

    def rows() -> int:
        return tp.pg_rows_once_last_in(pg_dsn, table, last)

    def alive() -> None:
        if proc.poll() is not None:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
            raise RuntimeError(f"{name}: the Flink JVM exited ({proc.returncode}):\n{tail}")

    try:
        while (t_running := marks.all_at("OPEN", source.partitions)) is None:
            alive()
            if time.monotonic() > started + RUNNING_TIMEOUT_S:
                raise TimeoutError(f"{name}: the job's tasks not running in {RUNNING_TIMEOUT_S}s")
            time.sleep(0.02)
        while (got := rows()) < n:
            alive()
            if time.monotonic() > t_running + timeout_s:
                raise TimeoutError(
                    f"{name}: not every record visible in {timeout_s}s ({got} counted)"
                )
            time.sleep(tp.POLL_S)
        done = time.monotonic()
        cpu = {"flink_jvm": tp._cpu_s(proc.pid)}
        rss = {"flink_jvm": tp._rss_peak_mb(proc.pid)}
    finally:
        _stop(proc)
    seconds = done - t_running
    t_assigned = marks.all_at("FIRST", source.partitions)
    assigned_s = None if t_assigned is None else t_assigned - t_running
    control: dict[str, Any] = {
        "subtasks": source.partitions,
        "startup_s": round(t_running - started, 2),
        # Tasks running to every source subtask's first record: the split assignment that the
        # pipeline's clock (from a participant ready) leaves out.
        "assigned_s": None if assigned_s is None else round(assigned_s, 2),
        "records_per_s_from_assigned": (
            None if assigned_s is None else round(n / (seconds - assigned_s))
        ),
    }
    return seconds, time.monotonic() - started, control, cpu, rss


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning(
                "Flink JVM %s still running %ss after SIGTERM: killed", proc.pid, STOP_TIMEOUT_S
            )
            proc.kill()
            proc.wait()


def xa_gid_prefix(job_id: uuid.UUID) -> str:
    """The start of the PostgreSQL global id of every XA transaction of the job: the format id,
    then the base64 of the global transaction id, which begins with the 16 bytes of the job id
    (the subtask index follows). 15 bytes make 20 base64 characters that no later byte changes."""
    return f"{XA_FORMAT_ID}_{base64.b64encode(job_id.bytes[:15]).decode()}"


def _cleanup(pg_dsn: str, bootstrap: str, table: str, job_id: uuid.UUID, *, drop: bool) -> int:
    """Roll back what the stopped job left prepared (it holds locks the DROP would wait on),
    drop the table (``drop``), delete the source's consumer group. The prepared transactions
    found."""
    prefix = xa_gid_prefix(job_id)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        gids = [
            gid
            for (gid,) in conn.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE starts_with(gid, %s)", (prefix,)
            ).fetchall()
        ]
        for gid in gids:
            conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
        if drop:
            conn.execute("SET lock_timeout = '30s'")
            conn.execute(f"DROP TABLE IF EXISTS {table}")
    group = f"flink-{table}"
    kc_peers.delete_group(AdminClient({"bootstrap.servers": bootstrap}), group)
    return len(gids)


# -- the bench section ------------------------------------------------------------------------


def section(args: argparse.Namespace, env: dict[str, str], work: Path) -> dict[str, Any]:
    """``make bench``'s Flink peer: the PostgreSQL-only pipeline vs the Flink job on
    ``args.records`` records, the two alternating ``args.runs`` times."""
    # bench.run imports this module to add the section: import it when the section runs.
    from bench.run import alternate, say

    say("flink: fetching and building the job (bench/peers/fetch.sh flink; cached)")
    cp = classpath()
    details: dict[str, list[dict[str, Any]]] = {"pg_pipeline": [], "flink_jdbc": []}

    def side(key: str, run: Callable[[], tp.RunResult]) -> Callable[[], float]:
        return kc_peers.checked_side(details, key, run, "flink")

    say(f"flink: producing {args.records:,} records")
    source = tp.Source.create(env["TWOPHASE_KAFKA_BOOTSTRAP"], args.records, "flink")
    try:
        got = alternate(
            args.runs,
            {
                "pg_pipeline": side(
                    "pg_pipeline",
                    lambda: tp.pipeline_run(source, work, mode="exactly_once", sinks={"pg"}),
                ),
                "flink_jdbc": side("flink_jdbc", lambda: flink_run(source, work, cp=cp)),
            },
        )
    finally:
        source.delete()
    med = {k: float(statistics.median(v)) for k, v in got.items()}
    return {
        **kc_peers.versus_fields("flink_jdbc", "eo_over_flink_jdbc", med, "pg_pipeline", details),
        "flink_jdbc_pg_pipeline_records_per_s": round(med["pg_pipeline"]),
        "_runs": details,
    }


def _arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--records", type=int, default=200_000)


def main(argv: list[str] | None = None) -> int:
    return tp.section_main(argv, "python -m bench.flink_peer", __doc__, section, _arguments)


if __name__ == "__main__":
    sys.exit(main())
