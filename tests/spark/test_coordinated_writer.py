"""The coordinated ``foreachBatch`` writer with real Spark on the real stack.

Every check reads the stores directly (:func:`twophase.jobs.verify.check_sinks`): rows per id, prepared
transactions in ``pg_prepared_xacts``, staged documents and files.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from pyspark.errors import StreamingQueryException

from tests.spark.cluster import StandaloneCluster
from tests.spark.helpers import REPO, produce_to, read_topic
from twophase.errors import ConfigError, FencedError
from twophase.jobs.orders import order_events
from twophase.jobs.orders_writer import (
    orders_table_ddl,
    start_orders_writer,
    writer_config,
    writer_process,
)
from twophase.jobs.verify import check_sinks, checks_json
from twophase.kafka import ControlReader
from twophase.participants.spark import PipelineOwnerError, coordinated_writer, load_spark_config
from twophase.protocol.codec import decode
from twophase.protocol.messages import Checkpoint, Decision, Outcome, Prepare

pytestmark = [pytest.mark.stack, pytest.mark.spark]

#: One run of the writer process: a JVM start (~15 s on this shared 2-core machine) and a few
#: batches. Generous, because a kill test that times out tells nothing.
RUN_TIMEOUT_S = 240
HMAC = "spark-test-hmac"


def _pipeline(
    tmp_path: Path,
    name: str,
    *,
    bootstrap: str,
    pg_dsn: str,
    mongo_uri: str | None,
    checkpoint_every: int = 20,
) -> Path:
    table = f"{name}_orders"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}")
        conn.execute(orders_table_ddl(table))
    cfg = writer_config(
        name.replace("_", "-"),
        bootstrap=bootstrap,
        pg_dsn=pg_dsn,
        pg_table=table,
        files_path=tmp_path / "files",
        mongo_uri=mongo_uri,
        mongo_database=name,
        hmac_key=HMAC,
    )
    cfg["commit"] = {"checkpoint_every": checkpoint_every}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _run(
    config: Path,
    raw: str,
    checkpoint: Path,
    jars: list[str],
    crash_at: str = "",
    master: str = "",
) -> subprocess.CompletedProcess[str]:
    command, env = writer_process(
        config,
        raw,
        checkpoint,
        300,
        crash_at,
        TWOPHASE_SPARK_JARS=",".join(jars),
        TWOPHASE_SPARK_MASTER=master,  # empty: local[2]
    )
    return subprocess.run(
        command,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )


def _tail(run: subprocess.CompletedProcess[str], lines: int = 40) -> str:
    interesting = [
        line
        for line in run.stderr.splitlines()
        if "twophase" in line or "Error" in line or "failed" in line
    ]
    return "\n".join(interesting[-lines:])


def _control_log(bootstrap: str, pipeline: str) -> list[Any]:
    records = read_topic(bootstrap, f"twophase.control.{pipeline}", 1)
    return [decode(value, headers, key=HMAC.encode()).payload for _k, value, headers in records]


def _pg_counts(pg_dsn: str, table: str, pipeline: str) -> tuple[int, int]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        rows = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
        prepared = conn.execute(
            "SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE %s", (f"%:{pipeline}~%",)
        ).fetchone()
    assert rows is not None and prepared is not None
    return int(rows[0]), int(prepared[0])


@pytest.fixture(params=["local", "standalone"])
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StandaloneCluster | None]:
    """None: the writer runs on local[2]. Otherwise a standalone master and two workers: the
    executors, and the Python workers that write the parts, are processes apart from the
    driver, and a killed driver takes its executors with it."""
    if request.param == "local":
        yield None
        return
    with StandaloneCluster(tmp_path_factory.mktemp("spark-cluster")) as started:
        yield started


def test_driver_killed_mid_batch_restarts_exactly_once(
    cluster: StandaloneCluster | None,
    tmp_path: Path,
    kafka_bootstrap: str,
    pg_dsn: str,
    mongo_uri: str,
    spark_jars: list[str],
    create_topic: Any,
    unique_name: str,
) -> None:
    raw = create_topic(f"{unique_name}-raw", 2)
    # A checkpoint after every decision: each restart recovers from a checkpoint, not the log start.
    config = _pipeline(
        tmp_path,
        unique_name,
        bootstrap=kafka_bootstrap,
        pg_dsn=pg_dsn,
        mongo_uri=mongo_uri,
        checkpoint_every=1,
    )
    cfg = load_spark_config(config)
    table = f"{unique_name}_orders"
    n = 1200
    events = order_events(0, n)
    produce_to(kafka_bootstrap, raw, 0, events[: n // 2])
    produce_to(kafka_bootstrap, raw, 1, events[n // 2 :])
    checkpoint = tmp_path / "checkpoint"
    started = time.monotonic()

    # Run 1: SIGKILL in batch 1, after every executor prepared its part, before the decision.
    master = cluster.url if cluster else ""
    run = _run(config, raw, checkpoint, spark_jars, "spark_after_prepare:2", master)
    assert run.returncode == -signal.SIGKILL, _tail(run)
    rows, prepared = _pg_counts(pg_dsn, table, cfg.pipeline)
    assert rows == 300, "batch 0 (300 rows) committed, batch 1 not"
    assert prepared == 2, "batch 1 left both partitions' parts prepared in PostgreSQL"

    # Run 2: batch 1 runs again and commits; SIGKILL in batch 2 after the first sink (MongoDB)
    # applied the decision and before files and PostgreSQL did.
    run = _run(config, raw, checkpoint, spark_jars, "spark_mid_apply:2", master)
    assert run.returncode == -signal.SIGKILL, _tail(run)
    mid = check_sinks(cfg, set(range(n)))
    assert mid["mongo"].rows == 900 and mid["pg"].rows == 600, checks_json(mid)
    assert mid["pg"].prepared == 2, "batch 2 decided but not yet applied in PostgreSQL"

    # Run 3: Spark replays batch 2, which is committed: the writer applies it and writes nothing.
    run = _run(config, raw, checkpoint, spark_jars, master=master)
    assert run.returncode == 0, _tail(run)
    elapsed = time.monotonic() - started

    checks = check_sinks(cfg, set(range(n)))
    print(checks_json(checks), f"three runs in {elapsed:.0f}s")
    for sink, check in checks.items():
        assert check.ok, f"{sink}: {check}"
        assert check.distinct == n
    messages = _control_log(kafka_bootstrap, cfg.pipeline)
    decisions = [m for m in messages if isinstance(m, Decision)]
    assert [d.txn for d in decisions] == [1, 2, 3, 4], "one decision per batch, none twice"
    assert all(d.outcome is Outcome.COMMIT for d in decisions)
    attempts = Counter(m.txn for m in messages if isinstance(m, Prepare))
    assert attempts[2] == 2, "batch 1 (txn 2) was attempted twice: killed, then re-run"
    assert attempts[3] == 1, "the replay of batch 2 (txn 3) wrote nothing new"
    # Parts of the killed attempt never reached a decision; the committed parts carry the tag of
    # the attempt that wrote them.
    assert all(p.participant.split(".")[1] == str(p.generation) for d in decisions for p in d.parts)
    # Recovery reads a bounded tail: readers start at the latest checkpoint, which has nothing
    # pending once the last batch is applied.
    reader = ControlReader(cfg)
    try:
        first = next(reader.replay())
    finally:
        reader.close()
    assert isinstance(first.payload, Checkpoint), first
    assert first.payload.last_txn == 4 and first.payload.pending == ()
    if cluster is not None:
        # Each run was an application of its own whose tasks ran in both workers' executors.
        executors = cluster.executor_dirs()
        assert len({d.parent.name for d in executors}) == 3, executors
        ran = [d for d in executors if "Running task" in (d / "stderr").read_text(errors="replace")]
        assert {d.parent.parent.name for d in ran} == {"worker-0", "worker-1"}, ran


def test_a_row_one_sink_rejects_aborts_the_whole_batch(
    spark: Any,
    tmp_path: Path,
    kafka_bootstrap: str,
    pg_dsn: str,
    mongo_uri: str,
    create_topic: Any,
    unique_name: str,
) -> None:
    raw = create_topic(f"{unique_name}-raw", 2)
    config = _pipeline(
        tmp_path, unique_name, bootstrap=kafka_bootstrap, pg_dsn=pg_dsn, mongo_uri=mongo_uri
    )
    cfg = load_spark_config(config)
    events = order_events(0, 200)
    events[170]["amount"] = -5.0  # breaks CHECK (amount >= 0) in PostgreSQL, the last sink
    # Two partitions of 100 and 100 offsets per trigger: batch 0 is ids 0-49 and 50-99, batch 1
    # is 100-149 (clean, prepared in every sink) and 150-199 (holds the bad row).
    produce_to(kafka_bootstrap, raw, 0, events[0:50] + events[100:150])
    produce_to(kafka_bootstrap, raw, 1, events[50:100] + events[150:200])

    query = start_orders_writer(
        spark,
        config=config,
        bootstrap=kafka_bootstrap,
        raw_topic=raw,
        checkpoint=str(tmp_path / "checkpoint"),
        max_offsets_per_trigger=100,
    )
    with pytest.raises(StreamingQueryException) as caught:
        query.awaitTermination(RUN_TIMEOUT_S)
    message = str(caught.value)
    assert "batch 1 aborted: sink pg rejected 1 row" in message, message
    assert 'violates check constraint "amount_not_negative"' in message, message
    # The failed query's driver sessions ended with it: a driver that restarts its query kept
    # one set per failure before (they count against max_connections).
    driver = f"twophase/{cfg.pipeline}/pg/spark-driver"[:63]  # PostgreSQL keeps 63 bytes
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (driver,)
        ).fetchone()
    assert row is not None and row[0] == 0, f"{row} driver sessions of {cfg.pipeline} left open"

    checks = check_sinks(cfg, set(range(100)))
    print(checks_json(checks))
    for sink, check in checks.items():
        assert check.ok, f"{sink} holds something of the aborted batch: {check}"


def _static_orders(spark: Any, ids: range) -> Any:
    rows = [(i, f"customer-{i % 7}", 10.5 + i, "EUR", 10.5 + i, None, "x") for i in ids]
    return spark.createDataFrame(
        rows,
        "id long, customer string, amount double, currency string, amount_eur double, "
        "event_time timestamp, note string",
    )


def test_a_second_driver_fences_the_first(
    spark: Any, tmp_path: Path, kafka_bootstrap: str, pg_dsn: str, unique_name: str
) -> None:
    config = _pipeline(
        tmp_path, unique_name, bootstrap=kafka_bootstrap, pg_dsn=pg_dsn, mongo_uri=None
    )
    cfg = load_spark_config(config)
    first = coordinated_writer(cfg)
    first(_static_orders(spark, range(0, 10)), 0)
    second = coordinated_writer(cfg)  # init_transactions: the first driver is fenced from here on
    with pytest.raises(FencedError):
        first(_static_orders(spark, range(10, 20)), 1)
    second(_static_orders(spark, range(20, 30)), 1)
    checks = check_sinks(cfg, set(range(0, 10)) | set(range(20, 30)))
    assert checks["pg"].ok, checks_json(checks)
    decisions = [m for m in _control_log(kafka_bootstrap, cfg.pipeline) if isinstance(m, Decision)]
    assert [d.txn for d in decisions] == [1, 2]
    first.close()
    second.close()


@pytest.mark.parametrize("defect", ["partitions", "compact"])
def test_a_control_topic_the_protocol_cannot_run_on_is_refused_at_once(
    tmp_path: Path,
    kafka_bootstrap: str,
    pg_dsn: str,
    unique_name: str,
    create_topic: Any,
    defect: str,
) -> None:
    """As the coordinator and the participants refuse it (tests/e2e/test_control_topic_checked):
    the driver reads partition 0 only, and its messages go where their key hashes."""
    config = _pipeline(
        tmp_path, unique_name, bootstrap=kafka_bootstrap, pg_dsn=pg_dsn, mongo_uri=None
    )
    cfg = load_spark_config(config)
    if defect == "partitions":
        create_topic(cfg.control_topic, 2)
        wrong = "2 partitions"
    else:
        create_topic(cfg.control_topic, 1, {"cleanup.policy": "compact"})
        wrong = "cleanup.policy=compact"
    with pytest.raises(ConfigError, match=rf"control\.topic.*{wrong}"):
        coordinated_writer(cfg)


def test_a_pipeline_belongs_to_one_query(
    spark: Any,
    tmp_path: Path,
    kafka_bootstrap: str,
    pg_dsn: str,
    create_topic: Any,
    unique_name: str,
) -> None:
    raw = create_topic(f"{unique_name}-raw", 1)
    produce_to(kafka_bootstrap, raw, 0, order_events(0, 20))
    config = _pipeline(
        tmp_path, unique_name, bootstrap=kafka_bootstrap, pg_dsn=pg_dsn, mongo_uri=None
    )
    query = start_orders_writer(
        spark,
        config=config,
        bootstrap=kafka_bootstrap,
        raw_topic=raw,
        checkpoint=str(tmp_path / "checkpoint"),
    )
    assert query.awaitTermination(RUN_TIMEOUT_S)
    # Another query (here: a fresh checkpoint would number its batches from 0 again) must not
    # take its batch 0 for the committed batch 0 of the first one and skip it.
    other = coordinated_writer(load_spark_config(config))
    with pytest.raises(PipelineOwnerError, match=f"written by spark:{query.id}"):
        other(_static_orders(spark, range(100, 110)), 0)
    other.close()
    checks = check_sinks(load_spark_config(config), set(range(20)))
    assert checks["pg"].ok, checks_json(checks)
