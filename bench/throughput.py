"""Pipeline throughput on the local stack: real ``twophase`` processes, timed from the outside.

One source topic holds the records for every run (produced once); each run is a new pipeline
(new consumer group, new table, new directory) that reads it from the start. A run's rate is
taken from the source group's committed offsets -- the offsets the coordinator commits with
each decision (exactly-once) or the participant after each batch (at-least-once) -- so a run
is done when every record is visible in every sink:

    records_per_s = records / (t(all committed and visible) - t(first participant ready))

Visible, without counting rows on the clock: at least once commits a batch in every sink before
its offsets; exactly once commits the offsets with the decision, and its parts are applied when
none of the pipeline's parts is left prepared in PostgreSQL, staged in the files sink or staged
or prepared in MongoDB (whose positions, stored with a part's last chunk, must also reach the
end; parts may be applied there out of order). The offsets are polled every 0.02 s (0.1 s with
MongoDB: SecantusDB answers slowly); the row counts come after the clock and must match. (The
Iceberg section and the peers keep checks of their own: :mod:`bench.iceberg`,
:mod:`bench.kc_peers`.)

"Ready" is a participant's ``/readyz`` answering 200: caught up with the control log and holding
its assignment, i.e. about to consume. Process start-up -- the Python imports and the first
group join, not a throughput property -- is left out; everything after is in, including the
coordinator's first cycles and the rebalance when the second participant joins. Every run is
then checked in the stores: exactly-once runs must hold exactly the records, at-least-once runs
at least all of them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import shutil
import socket
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import orjson
import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from psycopg import sql

from harness import Cluster, Scenario, cdc_check, control_summary, load_stack_env, produce
from twophase.config import load_config
from twophase.kafka import create_topics
from twophase.retry import KAFKA

log = logging.getLogger(__name__)

#: Participants per pipeline run: one per core of the reference machine.
PARTICIPANTS = 2
PARTITIONS = 4
#: Of the peers' and the Iceberg pipeline's runs (:func:`timed`'s default), and of the
#: pipeline's with MongoDB (each poll a query of its server).
POLL_S = 0.1
#: Of the pipeline's runs: the offsets and the parts left behind are cheap to read, and a poll's
#: wait is measured as the pipeline's (at 0.1 s, ~50 ms of a ~2 s run, plus a count of the rows).
FAST_POLL_S = 0.02


@dataclass
class Source:
    bootstrap: str
    topic: str
    records: int
    partitions: int = PARTITIONS
    #: Options of the pipeline's ``sources[]`` entry (``value_format``, ...).
    options: dict[str, Any] = field(default_factory=dict)
    #: The pipeline's ``schema_registry.url``, for a source in a registry format.
    registry_url: str = ""

    @classmethod
    def create(cls, bootstrap: str, records: int, tag: str, partitions: int = PARTITIONS) -> Source:
        topic = f"bench-{tag}-{uuid.uuid4().hex[:6]}.orders"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])[
            topic
        ].result()
        if records:
            produce(bootstrap, topic, 0, records)
        return cls(bootstrap, topic, records, partitions)

    def delete(self) -> None:
        delete_topics(self.bootstrap, [self.topic])

    @classmethod
    @contextlib.contextmanager
    def temporary(cls, bootstrap: str, records: int, tag: str) -> Iterator[Source]:
        """:meth:`create`, and the topic deleted afterwards."""
        src = cls.create(bootstrap, records, tag)
        try:
            yield src
        finally:
            src.delete()


def delete_topics(bootstrap: str, topics: list[str]) -> None:
    """Delete ``topics`` and wait for the broker's answer: a request left in an AdminClient
    that is dropped at once may never be sent (topics were left behind that way)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for topic, future in admin.delete_topics(topics, operation_timeout=30).items():
        try:
            future.result()
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                log.warning("topic %s not deleted: %s", topic, exc)


@dataclass
class RunResult:
    mode: str
    sinks: list[str]
    records: int
    records_per_s: float
    seconds: float
    wall_s: float
    verified: dict[str, int] = field(default_factory=dict)
    control: dict[str, Any] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)
    #: Peak resident memory of each process of the run, MB.
    rss_peak_mb: dict[str, float] = field(default_factory=dict)

    def asdict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "sinks": self.sinks,
            "records": self.records,
            "records_per_s": round(self.records_per_s),
            "seconds_ready_to_done": round(self.seconds, 2),
            "wall_s": round(self.wall_s, 2),
            "verified_rows": self.verified,
            "cpu_s": self.cpu_s,
            **({"rss_peak_mb": self.rss_peak_mb} if self.rss_peak_mb else {}),
            **({"control": self.control} if self.control else {}),
        }


class CommittedProbe:
    """Sum of a group's committed offsets over the source partitions."""

    def __init__(self, source: Source, group: str) -> None:
        self.tps = [TopicPartition(source.topic, p) for p in range(source.partitions)]
        self.c = Consumer({"bootstrap.servers": source.bootstrap, "group.id": group})

    def total(self) -> int:
        got = KAFKA.call(lambda: self.c.committed(self.tps, timeout=10), "committed offsets")
        return sum(max(tp.offset, 0) for tp in got)

    def close(self) -> None:
        self.c.close()


class MongoApplied:
    """Sum of the MongoDB sink's positions over the source partitions, each stored in the
    transaction of a part's last chunk: it reaches every record once each partition's last part
    is applied (parts may be applied out of order, so no part left staged or prepared
    decides, :func:`_left_behind`).
    One small document per partition, read by ``_id``: counting the target collection instead
    scans it on SecantusDB, and polled every POLL_S while the decided parts are applied (seconds
    behind the offsets) it took most of the server from the commits it waited for."""

    def __init__(self, s: Scenario, source: Source) -> None:
        from pymongo import MongoClient

        self.client: MongoClient[dict[str, Any]] = MongoClient(s.mongo_uri)
        self.markers = self.client[s.table]["twophase_parts"]
        self.ids = [f"mongo:{s.name}:{source.topic}:{p}" for p in range(source.partitions)]

    def total(self) -> int:
        docs = self.markers.find({"_id": {"$in": self.ids}}, {"offset": 1})
        return sum(int(d["offset"]) for d in docs)

    def close(self) -> None:
        self.client.close()


def scenario(name: str, workdir: Path, source: Source, *, sinks: set[str], mode: str) -> Scenario:
    s = Scenario.on_stack(
        name,
        workdir,
        partitions=source.partitions,
        mongo="mongo" in sinks,
        files="files" in sinks,
        extra={
            "sources": [
                {
                    "topic": source.topic,
                    "partitions": source.partitions,
                    "replication_factor": 1,
                    **source.options,
                }
            ],
            "participant": {"mode": mode},
            **({"schema_registry": {"url": source.registry_url}} if source.registry_url else {}),
        },
    )
    if "pg" not in sinks:
        cfg = s.config()
        cfg["sinks"] = [x for x in cfg["sinks"] if x["name"] != "pg"]
        s.extra["sinks"] = cfg["sinks"]
    return s


def _free_ports(n: int) -> list[int]:
    """``n`` ports free now, below the ephemeral range (where the clients' own outgoing
    connections could take one between this check and the process binding it)."""
    rng = random.Random()
    held: list[socket.socket] = []
    try:
        while len(held) < n:
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", rng.randrange(20_000, 32_000)))
            except OSError:
                sock.close()
                continue
            held.append(sock)
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for sock in held:
            sock.close()


@contextlib.contextmanager
def running(s: Scenario, mode: str, participants: int) -> Iterator[tuple[Cluster, list[int]]]:
    """The pipeline's processes, each with its own metrics port (returned, for /readyz)."""
    cluster = Cluster(s)
    free = _free_ports(participants + 1)
    ports: list[int] = []

    def start(role: str, name: str) -> None:
        ports.append(free.pop())
        cluster.start(role, name, env={"TWOPHASE__METRICS__PORT": str(ports[-1])})

    try:
        if mode == "exactly_once":
            start("coordinator", "coord-0")
        for i in range(participants):
            start("participant", f"worker-{i}")
        yield cluster, ports
    finally:
        cluster.stop_all()


def any_ready(ports: list[int]) -> bool:
    for port in ports:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                if r.status == 200:
                    return True
        except OSError:  # refused while starting, or 503 (HTTPError is an OSError)
            continue
    return False


def timed(
    s: Scenario,
    mode: str,
    participants: int,
    done: Callable[[], bool],
    timeout_s: float,
    poll_s: float = POLL_S,
) -> tuple[float, dict[str, float], dict[str, float]]:
    """Run the pipeline's processes until ``done()``, asked every ``poll_s``: the seconds from
    the first participant ready to done, each process's CPU seconds by then, and its peak
    resident memory (MB)."""
    t_ready = 0.0
    started = time.monotonic()
    with running(s, mode, participants) as (cluster, ports):
        while time.monotonic() < started + timeout_s:
            if not t_ready and any_ready(ports[1:] if mode == "exactly_once" else ports):
                t_ready = time.monotonic()
            if t_ready and done():
                cpu = {name: _cpu_s(proc.pid) for name, proc in cluster.procs.items()}
                rss = {name: _rss_peak_mb(proc.pid) for name, proc in cluster.procs.items()}
                return time.monotonic() - t_ready, cpu, rss
            for proc_name in cluster.procs:
                if not cluster.alive(proc_name):
                    raise RuntimeError(f"{proc_name} exited:\n{cluster.log_tail(proc_name)}")
            time.sleep(poll_s if t_ready else 0.02)
    raise TimeoutError(f"{s.name}: not done in {timeout_s}s")


def pipeline_run(
    source: Source,
    workdir: Path,
    *,
    mode: str,
    sinks: set[str],
    participants: int = PARTICIPANTS,
    timeout_s: float = 900.0,
) -> RunResult:
    name = f"bench-{mode.split('_')[0]}-{uuid.uuid4().hex[:6]}"
    s = scenario(name, workdir / name, source, sinks=sinks, mode=mode)
    create_topics(load_config(s.write()))
    if "pg" in sinks:
        s.prepare_stores()
    if "mongo" in sinks:
        _drop_mongo(s)
    probe = CommittedProbe(source, f"twophase.{name}")
    applied = MongoApplied(s, source) if "mongo" in sinks and mode == "exactly_once" else None
    n = source.records
    started = time.monotonic()
    try:
        # Done = every offset committed and every record visible in every sink (an
        # exactly-once decision commits the offsets; its parts are applied just after).
        seconds, cpu, rss = timed(
            s,
            mode,
            participants,
            lambda: (
                probe.total() >= n
                and (applied is None or applied.total() >= n)
                and (mode != "exactly_once" or not _left_behind(s, sinks))
            ),
            timeout_s,
            POLL_S if "mongo" in sinks else FAST_POLL_S,
        )
    finally:
        probe.close()
        if applied is not None:
            applied.close()
    wall = time.monotonic() - started
    verified = _verify(s, sinks, source.topic)
    exact = mode == "exactly_once"
    for sink, rows in verified.items():
        if rows < n or (exact and rows != n):
            raise RuntimeError(f"{name}: sink {sink} holds {rows} rows of {n}")
    control = control_summary(s) if exact else {}
    _cleanup(s, sinks)
    return RunResult(
        mode,
        sorted(sinks),
        n,
        n / seconds,
        seconds,
        wall,
        verified,
        control,
        cpu,
        rss,
    )


def _rss_peak_mb(pid: int) -> float:
    """A process's peak resident set so far, in MB (Linux /proc: ``VmHWM``)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    kb = next(
        (int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0
    )
    return round(kb / 1024, 1)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)


def _left_behind(s: Scenario, sinks: set[str]) -> bool:
    """Whether a part of ``s``'s pipeline is still prepared in PostgreSQL, staged in the files
    sink, or staged or prepared in MongoDB: once the offsets are at the end, none is when every
    decided part is applied (a part is prepared before its decision, which commits the
    offsets)."""
    return (
        ("pg" in sinks and cdc_check.pg_prepared(s.pg_dsn, s.name) != 0)
        or ("files" in sinks and cdc_check.staged_files(s.files_path, s.name) != 0)
        or ("mongo" in sinks and cdc_check.mongo_staged(s.mongo_uri, s.table, s.name) != 0)
    )


def _verify(s: Scenario, sinks: set[str], topic: str) -> dict[str, int]:
    out: dict[str, int] = {}
    if "pg" in sinks:
        with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
            row = conn.execute(f"SELECT count(*) FROM {s.table}").fetchone()
            out["pg"] = int(row[0]) if row else 0
    if "files" in sinks:
        import pyarrow.parquet as pq

        out["files"] = sum(
            pq.ParquetFile(f).metadata.num_rows for f in (s.files_path / topic).rglob("*.parquet")
        )
    if "mongo" in sinks:
        from pymongo import MongoClient

        client: MongoClient[dict[str, Any]] = MongoClient(s.mongo_uri)
        out["mongo"] = client[s.table]["orders"].estimated_document_count()
        client.close()
    return out


def _drop_mongo(s: Scenario) -> None:
    from pymongo import MongoClient

    client: MongoClient[dict[str, Any]] = MongoClient(s.mongo_uri)
    client.drop_database(s.table)
    client.close()


def _cleanup(s: Scenario, sinks: set[str]) -> None:
    if "pg" in sinks:
        with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
            # Processes stopped mid-cycle leave their last parts prepared (they belong to a
            # decision nobody will write now); they hold locks the DROP would wait on.
            for (gid,) in conn.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s", (f"%{s.name}~%",)
            ).fetchall():
                conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
            conn.execute("SET lock_timeout = '30s'")
            conn.execute(f"DROP TABLE IF EXISTS {s.table}")
    if "mongo" in sinks:
        _drop_mongo(s)
    cfg = load_config(s.config_path)
    delete_topics(s.bootstrap, [cfg.control_topic, cfg.dead_letter_topic])
    shutil.rmtree(s.workdir, ignore_errors=True)


# -- the ceilings: the same rows written straight into the store, no Kafka, no twophase -------

COLUMNS = ("id", "customer", "amount", "currency", "ts", "note")


def first_int(row: tuple[Any, ...] | None) -> int:
    """The first column of a fetched row as an int; 0 for no row."""
    return int(row[0]) if row else 0


def pg_rows_once_last_in(pg_dsn: str, table: str, last: list[int]) -> int:
    """``count(*)`` of ``table`` once every id of ``last`` (:func:`last_ids`) is in it, by its
    key; 0 before."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        ends = conn.execute(f"SELECT count(*) FROM {table} WHERE id = ANY(%s)", (last,))
        if first_int(ends.fetchone()) < len(last):
            return 0
        return first_int(conn.execute(f"SELECT count(*) FROM {table}").fetchone())


def last_ids(source: Source) -> list[int]:
    """The ``id`` of the last record of each partition of ``source`` (in a ``{schema,
    payload}`` envelope or not), read once, outside any clock. A sink that writes each
    partition in order holds them all only at the end of a run: a cheap test, by key, before
    the count that proves it (a count polled all through a run scans the target again and
    again on the server under test)."""
    c = Consumer(
        {
            "bootstrap.servers": source.bootstrap,
            "group.id": f"bench-last-{uuid.uuid4().hex[:6]}",
            "enable.auto.commit": False,
        }
    )
    try:
        tps = []
        for p in range(source.partitions):
            _, high = c.get_watermark_offsets(TopicPartition(source.topic, p), timeout=10)
            if high > 0:
                tps.append(TopicPartition(source.topic, p, high - 1))
        c.assign(tps)
        got: dict[int, int] = {}
        deadline = time.monotonic() + 60
        while len(got) < len(tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{source.topic}: last records not read")
            for m in c.consume(len(tps), 1.0):
                raw, partition = m.value(), m.partition()
                if m.error() is None and raw is not None and partition is not None:
                    value = orjson.loads(raw)
                    got[partition] = int(value.get("payload", value)["id"])
        return sorted(got.values())
    finally:
        c.close()


def source_rows(source: Source) -> list[dict[str, Any]]:
    """The source topic's values, decoded once (not timed)."""
    c = Consumer(
        {
            "bootstrap.servers": source.bootstrap,
            "group.id": f"bench-reader-{uuid.uuid4().hex[:6]}",
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
        }
    )
    c.assign([TopicPartition(source.topic, p, 0) for p in range(source.partitions)])
    rows: list[dict[str, Any]] = []
    eof = 0
    while eof < source.partitions:
        for m in c.consume(10_000, 1.0):
            if m.error() is not None:
                eof += 1
            else:
                rows.append(orjson.loads(m.value() or b"{}"))
    c.close()
    if len(rows) != source.records:
        raise RuntimeError(f"read {len(rows)} of {source.records} source records")
    return rows


def pg_copy_run(dsn: str, rows: list[dict[str, Any]], batch: int = 50_000) -> float:
    """psycopg ``COPY ... FROM STDIN`` of the rows, one committed transaction per batch, into
    a table like the pipeline's: records per second."""
    table = f"bench_copy_{uuid.uuid4().hex[:6]}"
    tuples = [tuple(r[c] for c in COLUMNS) for r in rows]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE {table} (id bigint NOT NULL, customer text, "
            "amount numeric(12,2), currency text, ts timestamptz, note text)"
        )
    started = time.monotonic()
    with psycopg.connect(dsn) as conn:
        for i in range(0, len(tuples), batch):
            with (
                conn.cursor() as cur,
                cur.copy(f"COPY {table} ({', '.join(COLUMNS)}) FROM STDIN") as copy,
            ):
                for t in tuples[i : i + batch]:
                    copy.write_row(t)
            conn.commit()
    took = time.monotonic() - started
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
        conn.execute(f"DROP TABLE {table}")
    if not row or row[0] != len(rows):
        raise RuntimeError(f"COPY wrote {row} rows of {len(rows)}")
    return len(rows) / took


def mongo_direct_run(uri: str, rows: list[dict[str, Any]], batch: int = 1000) -> float:
    """pymongo ``insert_many`` of the same documents, unordered, in batches: documents/s."""
    from pymongo import MongoClient

    client: MongoClient[dict[str, Any]] = MongoClient(uri)
    db = client[f"bench_direct_{uuid.uuid4().hex[:6]}"]
    docs = [dict(r) for r in rows]
    started = time.monotonic()
    for i in range(0, len(docs), batch):
        db["orders"].insert_many(docs[i : i + batch], ordered=False)
    took = time.monotonic() - started
    got = db["orders"].count_documents({})
    client.drop_database(db.name)
    client.close()
    if got != len(rows):
        raise RuntimeError(f"insert_many wrote {got} documents of {len(rows)}")
    return len(rows) / took


def section_main(
    argv: list[str] | None,
    prog: str,
    doc: str | None,
    section: Callable[[argparse.Namespace, dict[str, str], Path], dict[str, Any]],
    add_arguments: Callable[[argparse.ArgumentParser], None],
) -> int:
    """``python -m bench.<module>``: one ``make bench`` section alone on the local stack, its
    result printed (and written to ``--json``). ``add_arguments`` adds the section's own
    options; ``--runs`` and ``--json`` are common."""
    ap = argparse.ArgumentParser(prog=prog, description=doc)
    add_arguments(ap)
    ap.add_argument("--runs", type=int, default=3, help="runs of each side (median)")
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    with tempfile.TemporaryDirectory(prefix=f"twophase-{prog.rsplit('.', 1)[-1]}-") as tmp:
        got = section(args, load_stack_env(), Path(tmp))
    text = json.dumps(got, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


def jdbc(pg_dsn: str) -> tuple[str, str, str]:
    """A libpq DSN as a JVM peer needs it: the JDBC URL, the user and the password."""
    dsn = urlsplit(pg_dsn)
    url = f"jdbc:postgresql://{dsn.hostname}:{dsn.port or 5432}{dsn.path}"
    return url, unquote(dsn.username or ""), unquote(dsn.password or "")
