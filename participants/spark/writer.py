"""The coordinated writer's I/O: drives :class:`~twophase.participants.spark.machine.DriverMachine`
with Kafka (the control log, through the coordinator's :class:`~twophase.kafka.ControlPublisher`),
the driver's sinks and Spark. Every decision is the machine's; this module only carries them out.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections import deque
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING

from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from twophase.config import PipelineConfig, load_yaml, parse_config
from twophase.errors import FatalError, RetriableError
from twophase.faults import crash_point
from twophase.kafka import (
    ControlPublisher,
    ControlReader,
    check_control_topic,
    client_settings,
    create_topics,
)
from twophase.participants.registry import build_sinks
from twophase.participants.sdk import Sink
from twophase.participants.spark.executor import TaskSpec, virtual_topic, write_partition
from twophase.participants.spark.machine import (
    BatchCalled,
    CaughtUp,
    CommitCheckpoint,
    CrashPoint,
    Done,
    DriverMachine,
    Event,
    Fail,
    Fenced,
    Finish,
    Fold,
    Interrupted,
    Listed,
    ListInDoubt,
    ListStale,
    Log,
    Publish,
    Published,
    Received,
    Request,
    Resolve,
    RunTasks,
    TasksFailed,
    TasksFinished,
)
from twophase.protocol.codec import new_envelope
from twophase.protocol.messages import Decision, Outcome, Payload

if TYPE_CHECKING:
    from pyspark.rdd import RDD
    from pyspark.sql import DataFrame

from twophase.retry import SINK_RETRY_S, SPARK_APPLY_S, SPARK_PUBLISH_ATTEMPTS, STORE

__all__ = ["CoordinatedWriter", "coordinated_writer", "load_spark_config"]

log = logging.getLogger("twophase.spark")

#: Rows per ``Sink.write`` call on an executor when the config does not say
#: (``participant.max_batch_records``): large enough for COPY to pay off, small enough that a
#: rejection stops the task early.
DEFAULT_CHUNK_ROWS = 5000
#: Owner (envelope ``sender``) of messages written by a writer called outside a streaming query.
DIRECT_OWNER = "spark:direct"


def load_spark_config(path: str | Path) -> PipelineConfig:
    """Load a pipeline config for the writer. ``sources`` may be left out: a Spark pipeline's
    source is the stream, recorded as the virtual topic ``spark.<pipeline>``."""
    p = Path(path)
    raw = load_yaml(p)  # a syntax error names its position, never the text (it may hold secrets)
    if isinstance(raw, dict) and "sources" not in raw and isinstance(raw.get("pipeline"), str):
        raw = {**raw, "sources": [{"topic": virtual_topic(raw["pipeline"])}]}
    return parse_config(raw, source=str(p))


def coordinated_writer(
    config: str | Path | PipelineConfig, *, chunk_rows: int | None = None
) -> CoordinatedWriter:
    """A ``foreachBatch`` function writing each micro-batch into every sink of ``config``
    atomically and exactly once. Creating it fences any earlier driver of the same pipeline."""
    cfg = config if isinstance(config, PipelineConfig) else load_spark_config(config)
    return CoordinatedWriter(cfg, chunk_rows=chunk_rows)


def _json_lines(df: DataFrame) -> RDD[bytes]:
    """The batch as JSON text, one object per row, made on the JVM (nulls kept), as UTF-8 bytes.

    Spark's JSON writer is several times faster than pickling Rows to Python, and its output is
    what the participants read from Kafka: the sinks that read JSON values themselves
    (:meth:`Sink.write_raw`) take the bytes as they come. ``DataFrame.toJSON`` would drop null
    fields, which an upsert must see, hence ``to_json`` with ``ignoreNullFields=false``.
    """
    from pyspark.rdd import RDD
    from pyspark.serializers import UTF8Deserializer
    from pyspark.sql import functions as F

    js = df.select(F.to_json(F.struct(F.col("*")), {"ignoreNullFields": "false"}).alias("v"))
    sc = df.sparkSession.sparkContext
    jvm = getattr(sc, "_jvm", None)
    jdf = getattr(js, "_jdf", None)
    if jvm is None or jdf is None:
        raise FatalError("the coordinated writer needs classic PySpark (Spark Connect has no RDDs)")
    jrdd = getattr(jdf, "as")(jvm.org.apache.spark.sql.Encoders.STRING()).javaRDD()
    return RDD(jrdd, sc, UTF8Deserializer(use_unicode=False))  # type: ignore[no-untyped-call]


def _first_line(exc: BaseException, limit: int = 400) -> str:
    text = str(exc).strip()
    for line in text.splitlines():
        # Py4J wraps the cause: prefer the line that names the exception over the wrapper's.
        if "Exception:" in line or "Error:" in line:
            return line.strip()[:limit]
    return text.splitlines()[0][:limit] if text else type(exc).__name__


class CoordinatedWriter:
    """The ``foreachBatch`` callable, one per streaming query (:mod:`twophase.participants.spark`)."""

    def __init__(self, cfg: PipelineConfig, *, chunk_rows: int | None = None) -> None:
        self.cfg = cfg
        self.pipeline = cfg.pipeline
        self.chunk_rows = chunk_rows or cfg.participant.max_batch_records or DEFAULT_CHUNK_ROWS
        self._sinks_json = json.dumps(cfg.sinks, sort_keys=True, default=str)
        self._sinks: list[Sink] | None = None
        # Validate every sink section now, on the driver, so a bad config fails before a batch.
        names = [
            s.name
            for s in build_sinks(cfg.sinks, pipeline=cfg.pipeline, participant="spark-driver")
        ]
        self.machine = DriverMachine(
            cfg.pipeline, names, cfg.commit.checkpoint_every, control_topic=cfg.control_topic
        )
        create_topics(cfg, only={cfg.control_topic})
        check_control_topic(cfg, AdminClient(client_settings(cfg, "admin")))
        # Bumps the producer epoch: any earlier driver of this pipeline is fenced from here on,
        # and a transaction it left open is aborted by the broker.
        self._publisher = ControlPublisher(cfg, "spark-driver-producer")
        # Never subscribes: commits the coordinator group's offset on the control partition to
        # the latest CHECKPOINT, where every reader of the log starts.
        self._offsets = Consumer(
            client_settings(
                cfg,
                "spark-checkpoint-consumer",
                **{"group.id": cfg.coordinator_group_id, "enable.auto.commit": False},
            )
        )
        #: Monotonic times of the call in progress, for its summary line.
        self._marks: dict[str, float] = {}
        log.info(
            "coordinated writer for pipeline %s ready (control %s)",
            self.pipeline,
            cfg.control_topic,
        )

    # -- the foreachBatch entry point -------------------------------------------------------------

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        try:
            self._batch(df, batch_id)
        except BaseException:
            # Spark ends the query on this error. The sinks' connections must not outlive it: a
            # driver that restarts its query kept one set per failure (PostgreSQL sessions count
            # against max_connections). A later call -- this writer reused -- opens them again.
            self._close_sinks()
            raise

    def _batch(self, df: DataFrame, batch_id: int) -> None:
        query_id = df.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId")
        owner = f"spark:{query_id}" if query_id else DIRECT_OWNER
        self._marks = {"started": time.monotonic()}
        actions = deque(self.machine.handle(BatchCalled(batch_id, owner)))
        while actions:
            action = actions.popleft()
            if isinstance(action, Finish):
                self._finished(action, batch_id)
                return
            if isinstance(action, Log | CrashPoint | Fail):
                self._notice(action)
                continue
            try:
                answer = self._perform(action, df)
            except BaseException:
                # The log is the truth: whatever failed, the next call starts from a fresh fold.
                self.machine.handle(Interrupted())
                raise
            actions.extend(self.machine.handle(answer))

    def close(self) -> None:
        """Release the driver's clients. Prepared parts stay for the next writer to resolve."""
        self._publisher.close()
        self._offsets.close()
        self._close_sinks()

    def _close_sinks(self) -> None:
        sinks, self._sinks = self._sinks, None
        for sink in sinks or []:
            with suppress(Exception):  # closing what failed must not hide why it failed
                sink.close()

    # -- carrying out actions ----------------------------------------------------------------------

    def _notice(self, action: Log | CrashPoint | Fail) -> None:
        """Carry out an action that needs no answer; :class:`Fail` raises its error."""
        if isinstance(action, Log):
            getattr(log, action.level)(
                "%s%s", f"txn={action.txn} " if action.txn else "", action.message
            )
        elif isinstance(action, CrashPoint):
            crash_point(action.name)
        elif action.cause is None:
            raise action.error
        else:
            raise action.error from action.cause

    def _perform(self, action: Request, df: DataFrame) -> Event:
        if isinstance(action, Fold):
            return self._fold()
        if isinstance(action, Publish):
            return self._publish(action.payload)
        if isinstance(action, ListInDoubt):
            sink = self._sink(action.sink)
            return Listed(tuple(STORE.call(sink.in_doubt, budget_s=SINK_RETRY_S, what="in_doubt")))
        if isinstance(action, ListStale):
            call = functools.partial(self._sink(action.sink).stale_parts, action.before_txn)
            return Listed(tuple(STORE.call(call, budget_s=SINK_RETRY_S, what="stale")))
        if isinstance(action, Resolve):
            sink = self._sink(action.sink)
            finish = sink.commit if action.outcome is Outcome.COMMIT else sink.abort
            STORE.call(
                functools.partial(finish, action.part),
                budget_s=SPARK_APPLY_S if action.decided else SINK_RETRY_S,
                what=f"{action.outcome.value} {action.part.token}",
            )
            return Done()
        if isinstance(action, RunTasks):
            return self._run_tasks(action, df)
        assert isinstance(action, CommitCheckpoint)
        # Readers start at the latest checkpoint: the coordinator group's offset points at it.
        self._offsets.commit(
            offsets=[TopicPartition(self.cfg.control_topic, 0, action.offset)], asynchronous=False
        )
        return Done()

    def _fold(self) -> Event:
        """Feed the control log, from the latest checkpoint, to the machine."""
        reader = ControlReader(self.cfg)
        try:
            for env in reader.replay():
                for action in self.machine.handle(Received(env)):
                    # A log line, or the refusal of another query's log.
                    assert isinstance(action, Log | Fail)
                    self._notice(action)
        finally:
            reader.close()
        return CaughtUp()

    def _publish(self, payload: Payload) -> Event:
        env = new_envelope(self.pipeline, self.machine.owner, payload)
        result = self._publisher.publish(env, attempts=SPARK_PUBLISH_ATTEMPTS)
        if result.fenced:
            return Fenced(result.error)
        if result.error and result.retriable:
            raise RetriableError(f"control topic write kept failing: {result.error}")
        if result.error:
            raise FatalError(f"control topic write failed: {result.error}")
        if result.offset is None:
            raise RetriableError("control message committed without a delivery report")
        if isinstance(payload, Decision):
            self._marks["decided"] = time.monotonic()
        return Published(env, result.offset, int(time.time() * 1000))

    def _run_tasks(self, action: RunTasks, df: DataFrame) -> Event:
        spec = TaskSpec(
            pipeline=self.pipeline,
            sinks_json=self._sinks_json,
            batch_id=action.batch_id,
            txn=action.txn,
            tag=action.tag,
            chunk_rows=self.chunk_rows,
            ts_ms=action.started_ms,
        )
        self._marks["opened"] = time.monotonic()
        try:
            task = functools.partial(write_partition, spec)
            results = _json_lines(df).mapPartitionsWithIndex(task).collect()
        except Exception as exc:  # noqa: BLE001 - any failed task aborts the attempt, named
            return TasksFailed(_first_line(exc), exc)
        self._marks["written"] = time.monotonic()
        return TasksFinished(tuple(results))

    def _finished(self, finish: Finish, batch_id: int) -> None:
        if not finish.committed:
            return
        m, done = self._marks, time.monotonic()
        log.info(
            "txn=%d batch %d committed: %d rows in %d parts, %.3fs (open %.3f, write+prepare "
            "%.3f, decide %.3f, apply %.3f)",
            finish.txn,
            batch_id,
            finish.rows,
            finish.parts,
            done - m["started"],
            m["opened"] - m["started"],
            m["written"] - m["opened"],
            m["decided"] - m["written"],
            done - m["decided"],
        )

    # -- sinks on the driver -----------------------------------------------------------------------

    def _sink(self, name: str) -> Sink:
        if self._sinks is None:
            sinks = build_sinks(self.cfg.sinks, pipeline=self.pipeline, participant="spark-driver")
            for sink in sinks:
                STORE.call(sink.setup, budget_s=SINK_RETRY_S, what=f"setup of sink {sink.name}")
            self._sinks = sinks
        return next(s for s in self._sinks if s.name == name)
