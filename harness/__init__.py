"""Run a whole pipeline as real processes and check the result against the source.

Used by ``make demo``, the end-to-end tests and the chaos run. Verification reads the sinks and
the source topic directly -- it never trusts the product's own bookkeeping: every generated
record carries a unique ``id``; each sink must hold every id exactly once.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import yaml
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from twophase.retry import KAFKA

if TYPE_CHECKING:
    from pyiceberg.catalog.sql import SqlCatalog

    from twophase.protocol.messages import Envelope

__all__ = [
    "Cluster",
    "Scenario",
    "control_decisions",
    "control_envelopes",
    "control_summary",
    "iceberg_catalog",
    "end_offsets",
    "group_offsets",
    "load_stack_env",
    "produce",
    "summary_json",
    "verify",
    "wait_until",
]


def load_stack_env(path: str | Path | None = None) -> dict[str, str]:
    """The local stack's addresses, from the file ``stack/stack.sh up`` writes."""
    default = Path(os.environ.get("TWOPHASE_STACK_DIR", Path.cwd() / ".stack")) / "stack.env"
    env_file = Path(path) if path else default
    if not env_file.exists():
        raise RuntimeError(f"{env_file} not found: run `make stack-up` first")
    out = {}
    for line in env_file.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip().strip("'\"")
    return out


@dataclass
class Scenario:
    name: str
    bootstrap: str
    pg_dsn: str
    mongo_uri: str
    workdir: Path
    partitions: int = 4
    interval_ms: int = 1000
    vote_timeout_ms: int = 10_000
    hmac_key: str = "demo-hmac-key"
    mongo: bool = True
    files: bool = True
    iceberg: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    #: Of every topic the pipeline creates: the stack's broker count (1, or 3 with
    #: TWOPHASE_KAFKA_BROKERS=3), so a broker can die under a pipeline on three.
    replication_factor: int = 1

    @property
    def topic(self) -> str:
        return f"{self.name}.orders"

    @property
    def table(self) -> str:
        return f"{self.name.replace('-', '_').replace('.', '_')}_orders"

    @property
    def files_path(self) -> Path:
        return self.workdir / "files"

    @property
    def warehouse(self) -> Path:
        return self.workdir / "warehouse"

    @property
    def iceberg_table(self) -> str:
        """The Iceberg table (``namespace.table``), in a catalog named after the scenario."""
        return f"{self.table}.orders"

    @property
    def config_path(self) -> Path:
        return self.workdir / "pipeline.yaml"

    @classmethod
    def on_stack(cls, name: str, workdir: Path, **kw: Any) -> Scenario:
        env = load_stack_env()
        return cls(
            name=name,
            bootstrap=env["TWOPHASE_KAFKA_BOOTSTRAP"],
            pg_dsn=env["TWOPHASE_PG_DSN"],
            mongo_uri=env["TWOPHASE_MONGO_URI"],
            workdir=workdir,
            **({"replication_factor": int(env.get("TWOPHASE_KAFKA_BROKERS", "1"))} | kw),
        )

    def config(self) -> dict[str, Any]:
        sinks: list[dict[str, Any]] = [
            {
                "name": "pg",
                "type": "postgres",
                "dsn": self.pg_dsn,
                "table": self.table,
                "mode": "insert",
            }
        ]
        if self.mongo:
            sinks.append(
                {
                    "name": "mongo",
                    "type": "mongodb",
                    "uri": self.mongo_uri,
                    "database": self.table,
                    "collection": "orders",
                    "mode": "insert",
                }
            )
        if self.files:
            sinks.append(
                {
                    "name": "files",
                    "type": "files",
                    "path": str(self.files_path),
                    "format": "parquet",
                }
            )
        if self.iceberg:
            sinks.append(
                {
                    "name": "lake",
                    "type": "iceberg",
                    "catalog": {
                        "uri": self.pg_dsn,
                        "name": self.table,
                        "warehouse": str(self.warehouse),
                    },
                    "table": self.iceberg_table,
                    "create_table": {
                        "id": "long",
                        "customer": "string",
                        "amount": "decimal(12, 2)",
                        "currency": "string",
                        "ts": "timestamptz",
                        "note": "string",
                    },
                    "partition_by": ["bucket(4, id)"],
                }
            )
        rf = self.replication_factor
        cfg: dict[str, Any] = {
            "pipeline": self.name,
            "kafka": {"bootstrap_servers": self.bootstrap},
            "control": {"hmac_key": self.hmac_key, "replication_factor": rf},
            "sources": [
                {"topic": self.topic, "partitions": self.partitions, "replication_factor": rf}
            ],
            "dead_letter": {"replication_factor": rf},
            "commit": {"interval_ms": self.interval_ms, "vote_timeout_ms": self.vote_timeout_ms},
            "participant": {"sweep_interval_ms": 15_000},
            "metrics": {"port": 0},
            "sinks": sinks,
        }
        cfg.update(self.extra)
        return cfg

    def write(self) -> Path:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        return self.config_path

    def prepare_stores(self) -> None:
        import psycopg

        with psycopg.connect(self.pg_dsn, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {self.table}")
            conn.execute(
                f"CREATE TABLE {self.table} (id bigint NOT NULL, customer text, "
                "amount numeric(12,2), currency text, ts timestamptz, note text)"
            )


def record(i: int, rng: random.Random) -> bytes:
    """One ~200-byte order event with a unique id."""
    return orjson.dumps(
        {
            "id": i,
            "customer": f"customer-{rng.randrange(10_000):05d}",
            "amount": round(rng.uniform(1, 5000), 2),
            "currency": rng.choice(["EUR", "USD", "GBP"]),
            "ts": "2026-11-21T12:00:00Z",
            "note": "x" * rng.randrange(60, 90),
        }
    )


def source_producer(bootstrap: str) -> Producer:
    """The producer the harness writes source records with (idempotent: a retried send never
    reorders or doubles them)."""
    return Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "enable.idempotence": True})


def produce_into(
    p: Producer,
    topic: str,
    start: int,
    count: int,
    rng: random.Random,
    on_delivery: Callable[[Any, Any], None] | None = None,
) -> None:
    """Queue records ``start``..``start + count - 1`` (:func:`record`, keyed by id) on ``p``,
    waiting for room when its queue is full; the caller flushes."""
    for i in range(start, start + count):
        while True:
            try:
                p.produce(topic, key=str(i).encode(), value=record(i, rng), on_delivery=on_delivery)
                break
            except BufferError:
                p.poll(0.1)
        if i % 10_000 == 0:
            p.poll(0)


def produce(bootstrap: str, topic: str, start: int, count: int, *, seed: int = 7) -> None:
    p = source_producer(bootstrap)
    produce_into(p, topic, start, count, random.Random(seed + start))
    if p.flush(60) > 0:
        raise RuntimeError("source records not delivered")


def wait_until(pred: Callable[[], bool], timeout_s: float, what: str, every_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(every_s)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")


#: librdkafka's per-connection log lines: with a broker down, hundreds of them.
CONNECTION_NOISE = re.compile(
    r"Connection refused|connection reset|Disconnected|identical error|failed: Connection"
    r"|Connect to ipv4|all broker(s|) (are |)down"
)


class Cluster:
    """Coordinator and participant processes of one scenario."""

    def __init__(self, scenario: Scenario) -> None:
        self.s = scenario
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs = scenario.workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def start(
        self, role: str, name: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        full_env = {**os.environ, "TWOPHASE_PARTICIPANT_ID": name, "PYTHONUNBUFFERED": "1"}
        full_env.pop("TWOPHASE_CRASH_AT", None)
        full_env.update(env or {})
        log = (self.logs / f"{name}.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "twophase.cli.main", role, "run", str(self.s.config_path)],
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs[name] = proc
        return proc

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
        proc.wait(30)

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def log_tail(self, name: str, lines: int = 40, *, quiet: bool = False) -> str:
        """The last ``lines`` lines of a process's log; ``quiet`` first drops librdkafka's
        connection chatter (refused, reset, disconnected), which a dead broker makes fill
        every tail and hide what the process did."""
        path = self.logs / f"{name}.log"
        if not path.exists():
            return ""
        text = path.read_text(errors="replace").splitlines()
        if quiet:
            text = [line for line in text if not CONNECTION_NOISE.search(line)]
        return "\n".join(text[-lines:])

    def print_logs(self, lines: int = 60) -> None:
        """Every process's quiet log tail and exit code, for a failed test's output."""
        for name, proc in self.procs.items():
            print(
                f"===== {name} (exit code {proc.poll()})\n{self.log_tail(name, lines, quiet=True)}"
            )


def read_from(path: Path, offset: int) -> str:
    """What a log holds past ``offset`` (what was appended since); "" when it cannot be read."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def end_offsets(bootstrap: str, topic: str, partitions: int) -> dict[int, int]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "twophase-harness-probe"})
    try:

        def end(p: int) -> int:
            return KAFKA.call(
                lambda: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10),
                "end offsets",
            )[1]

        return {p: end(p) for p in range(partitions)}
    finally:
        c.close()


def group_offsets(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int]:
    c = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": group, "isolation.level": "read_committed"}
    )
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        got = KAFKA.call(lambda: c.committed(tps, timeout=10), "committed offsets")
        return {tp.partition: tp.offset for tp in got}
    finally:
        c.close()


@dataclass
class SinkReport:
    rows: int
    distinct: int
    duplicated: int
    missing: int
    orphaned_prepared: int
    staging_leftovers: int

    @property
    def ok(self) -> bool:
        return not (
            self.duplicated or self.missing or self.orphaned_prepared or self.staging_leftovers
        )


def _counts_report(ids: list[int], expected: set[int], prepared: int, staging: int) -> SinkReport:
    seen: dict[int, int] = {}
    for i in ids:
        seen[i] = seen.get(i, 0) + 1
    dup = sum(c - 1 for c in seen.values() if c > 1)
    missing = len(expected - set(seen))
    return SinkReport(len(ids), len(seen), dup, missing, prepared, staging)


def verify(s: Scenario, expected: set[int]) -> dict[str, SinkReport]:
    """Read every sink directly and compare with the ids produced."""
    import psycopg

    out: dict[str, SinkReport] = {}
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        ids = [r[0] for r in conn.execute(f"SELECT id FROM {s.table}")]
        prepared = conn.execute(
            "SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE %s", (f"%{s.name}~%",)
        ).fetchone()
    out["pg"] = _counts_report(ids, expected, int(prepared[0]) if prepared else 0, 0)
    if s.mongo:
        from pymongo import MongoClient

        client: MongoClient[dict[str, Any]] = MongoClient(s.mongo_uri)
        db = client[s.table]
        ids = [d["id"] for d in db["orders"].find({}, {"id": 1, "_id": 0})]
        staging = sum(
            db[name].count_documents({}) for name in db.list_collection_names() if "staging" in name
        )
        markers = (
            db["twophase_parts"].count_documents({"state": "prepared"})
            if "twophase_parts" in db.list_collection_names()
            else 0
        )
        out["mongo"] = _counts_report(ids, expected, markers, staging)
        client.close()
    if s.files:
        import pyarrow.dataset as ds

        base = s.files_path
        data = base / s.topic
        # The commit makes a dataset's directories before it links the first file into them:
        # a directory with no file yet has no columns to read.
        found = (
            ds.dataset(str(data), format="parquet", partitioning="hive") if data.exists() else None
        )
        ids = (
            found.to_table(columns=["id"]).column("id").to_pylist()
            if found is not None and found.files
            else []
        )
        book = base / "_twophase" / s.name
        prepared_dirs = list((book / "prepared").glob("*")) if (book / "prepared").exists() else []
        open_dirs = list((book / "open").glob("*")) if (book / "open").exists() else []
        out["files"] = _counts_report(ids, expected, len(prepared_dirs), len(open_dirs))
    if s.iceberg:
        out["iceberg"] = _verify_iceberg(s, expected)
    return out


def iceberg_catalog(pg_dsn: str, name: str, warehouse: str | Path, **properties: str) -> SqlCatalog:
    """A pyiceberg SQL catalog reading what an iceberg sink wrote into the catalog ``name`` of
    ``pg_dsn``'s database (its default schema), as a reader with no sink code would: it makes
    no catalog tables of its own. ``warehouse``: a path, or a URI (``s3://...`` with the
    ``s3.*`` properties)."""
    from pyiceberg.catalog.sql import SqlCatalog

    uri = pg_dsn.replace("postgresql://", "postgresql+psycopg://", 1)
    sep = "&" if "?" in uri else "?"
    where = str(warehouse)
    return SqlCatalog(
        name,
        uri=f"{uri}{sep}options=-csearch_path%3Diceberg_catalog",
        warehouse=where if "://" in where else f"file://{where}",
        init_catalog_tables="false",
        **properties,
    )


def _verify_iceberg(s: Scenario, expected: set[int]) -> SinkReport:
    """The table as a reader sees it (a pyiceberg scan through its own catalog); parts left
    prepared (the sink's marker table); data files no snapshot references (leftovers)."""
    import psycopg
    from pyiceberg.exceptions import NoSuchTableError

    catalog = iceberg_catalog(s.pg_dsn, s.table, s.warehouse)
    try:
        table = catalog.load_table(s.iceberg_table)
    except NoSuchTableError:
        return _counts_report([], expected, 0, 0)
    finally:
        catalog.engine.dispose()
    ids = table.scan(selected_fields=("id",)).to_arrow().column("id").to_pylist()
    referenced = {p.removeprefix("file://") for p in table.inspect.files()["file_path"].to_pylist()}
    on_disk = {str(p) for p in s.warehouse.rglob("*.parquet")}
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM iceberg_catalog.twophase_iceberg_parts"
            " WHERE pipeline = %s AND state = 'prepared'",
            (s.name,),
        ).fetchone()
    return _counts_report(ids, expected, int(row[0]) if row else 0, len(on_disk - referenced))


def control_envelopes(s: Scenario, group: str) -> Iterator[Envelope]:
    """Every envelope on ``s``'s control topic that decodes, in log order, as a
    ``read_committed`` reader sees them, up to the topic's end (read it once the pipeline is
    stopped: a running one never lets it end). Its consumer closes at the end; a caller that
    stops early closes it with ``contextlib.closing``."""
    from twophase.protocol.codec import DecodeError, decode

    c = Consumer(
        {
            "bootstrap.servers": s.bootstrap,
            "group.id": group,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
        }
    )
    try:
        c.assign([TopicPartition(f"twophase.control.{s.name}", 0, 0)])
        while True:
            m = c.poll(5)
            if m is None:
                return
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    return
                continue
            raw = m.headers()
            headers = (
                [(k, v) for k, v in raw if isinstance(v, bytes)] if isinstance(raw, list) else []
            )
            try:
                yield decode(m.value(), headers, key=s.hmac_key.encode())
            except DecodeError:
                continue
    finally:
        c.close()


def control_summary(s: Scenario) -> dict[str, Any]:
    """Commits, aborts and commit latency, read from the control topic."""
    from twophase.protocol.messages import Decision, Prepare

    prepared_at: dict[int, int] = {}
    latencies: list[int] = []
    #: (decision time, records committed so far over every source partition) per commit.
    progress: list[tuple[int, int]] = []
    commits = aborts = 0
    reasons: dict[str, int] = {}
    for env in control_envelopes(s, "twophase-harness-summary"):
        p = env.payload
        if isinstance(p, Prepare):
            prepared_at[p.txn] = env.ts_ms
        elif isinstance(p, Decision):
            if p.outcome.value == "commit":
                commits += 1
                total = sum(pos.offset for pos in p.positions)
                if p.positions and (not progress or total > progress[-1][1]):
                    progress.append((env.ts_ms, total))
                if p.txn in prepared_at:
                    latencies.append(env.ts_ms - prepared_at[p.txn])
            else:
                aborts += 1
                key = p.reason.split(":")[0][:60]
                reasons[key] = reasons.get(key, 0) + 1
    latencies.sort()

    def pct(q: float) -> int | None:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else None

    # Between the first and the second-to-last commit that moved the positions: without the
    # start (group forming, first cycle) and the tail (the last records wait for a cycle).
    steady = None
    if len(progress) >= 4 and progress[-2][0] > progress[0][0]:
        (t0, n0), (t1, n1) = progress[0], progress[-2]
        steady = round((n1 - n0) * 1000 / (t1 - t0))
    return {
        "committed": commits,
        "aborted": aborts,
        "abort_reasons": reasons,
        "commit_latency_ms": {"p50": pct(0.5), "p99": pct(0.99)},
        "steady_records_per_s": steady,
    }


def control_decisions(s: Scenario) -> list[tuple[int, int, str, str]]:
    """Every decision on the control topic: (time in ms, txn, outcome, reason), in log order.
    Read once the pipeline is stopped (a running one never lets the control topic end)."""
    from twophase.protocol.messages import Decision

    out: list[tuple[int, int, str, str]] = []
    for env in control_envelopes(s, "twophase-harness-decisions"):
        p = env.payload
        if isinstance(p, Decision):
            out.append((env.ts_ms, p.txn, p.outcome.value, p.reason))
    return out


def summary_json(reports: dict[str, SinkReport]) -> str:
    return json.dumps({k: vars(v) for k, v in reports.items()}, indent=2)
