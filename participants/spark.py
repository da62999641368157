"""A coordinated ``foreachBatch`` writer: every Spark micro-batch lands in all the sinks of a
pipeline as one all-or-nothing transaction, exactly once across driver crashes and batch replays.

::

    from twophase.participants.spark import coordinated_writer

    (df.writeStream
       .foreachBatch(coordinated_writer("orders-spark.yaml"))
       .option("checkpointLocation", "s3://.../checkpoints/orders")
       .start())

How one micro-batch ``batchId`` is written (``docs/spark.md`` explains each choice):

* The pipeline has its own name and control topic, and the **driver is its only decider**. It
  publishes through a transactional producer with the stable ``transactional.id``
  ``twophase.<pipeline>.coordinator``, initialised once per writer: a second driver of the same
  pipeline fences the first, which can then never write to the log again.
* Transaction ``T = batchId + 1``. Spark replays only the last batch after a restart, and every
  batch gets a COMMIT decision, so ``T <= last decided`` means "already committed".
* **Replayed batch** (a COMMIT decision for ``T`` exists): make sure every part it names is
  applied (``commit`` is idempotent and works from any process), write nothing, return.
* **Otherwise** the attempt starts with PREPARE(T) in a Kafka transaction. Its offset in the
  control topic is the attempt's *tag*: strictly increasing, and only a driver that is not fenced
  gets one. Parts are named ``spark-<partition>.<tag>.<task attempt id>``, so no two attempts --
  of the driver, of a task, speculative or not -- ever share a part id.
* In-doubt parts are resolved: parts of a committed transaction are committed if its decision
  names them and aborted if not; parts of an uncommitted transaction with an older tag belong to
  an attempt that can never decide (its driver is fenced or dead) and are aborted; a *newer* tag
  means this driver was replaced: :class:`~twophase.errors.FencedError`.
* The executors write in parallel, one part per non-empty partition: begin, write in chunks,
  prepare, in every sink, and return a few counts. Rows never travel to the driver.
* Any failed task or any row a sink rejects aborts every part of the attempt and raises
  :class:`TwophaseBatchError`, which names the sink and its reason. The batch is invisible.
* Otherwise DECISION(T, commit, parts) is published in a Kafka transaction -- the commit point --
  then the driver commits every part in every sink, publishes COMPLETE(T), and every
  ``commit.checkpoint_every`` decisions a CHECKPOINT, so a restart reads a bounded tail.

Rows reach the sinks as the JSON objects Spark's ``to_json`` makes of them (nulls kept): the same
values a participant would decode had the job written JSON to Kafka. Each row becomes a
:class:`~twophase.participants.sdk.Record` on the virtual topic ``spark.<pipeline>``, partition = the
Spark partition index, offset = ``batchId * 10**10 + row index`` (unique across batches, so a
MongoDB sink in insert mode gets distinct deterministic ``_id`` s).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import orjson
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from twophase.config import PipelineConfig, load_yaml, parse_config
from twophase.errors import AbortError, FatalError, FencedError, RetriableError
from twophase.kafka import CALL_TIMEOUT_S, ControlReader, client_settings, commit_transaction
from twophase.participants.registry import build_sinks
from twophase.participants.sdk import (
    BackpressureError,
    PartId,
    Record,
    Rejected,
    RetriableSinkError,
    Sink,
    SinkError,
)
from twophase.protocol.codec import encode, new_envelope
from twophase.protocol.logview import LogView
from twophase.protocol.messages import (
    Checkpoint,
    Complete,
    Decision,
    Envelope,
    Outcome,
    Part,
    Payload,
    Prepare,
)
from twophase.protocol.topics import topic_settings

if TYPE_CHECKING:
    from pyspark.rdd import RDD
    from pyspark.sql import DataFrame

__all__ = [
    "OFFSET_STRIDE",
    "CoordinatedWriter",
    "PipelineOwnerError",
    "TwophaseBatchError",
    "coordinated_writer",
    "load_spark_config",
    "virtual_topic",
]

log = logging.getLogger("twophase.spark")
T_ = TypeVar("T_")

#: Record offsets are ``batchId * OFFSET_STRIDE + row index``: unique across batches (10**10
#: rows per partition and batch is far beyond anything one task writes) and readable in decimal.
OFFSET_STRIDE = 10**10
#: Rows per ``Sink.write`` call on an executor when the config does not say
#: (``participant.max_batch_records``): large enough for COPY to pay off, small enough that a
#: rejection stops the task early.
DEFAULT_CHUNK_ROWS = 5000
#: Retriable sink errors (lock timeouts, a store restarting) are retried this long in a task, as
#: the participant runtime does, before the part is given up and the batch aborted.
SINK_RETRY_BUDGET_S = 60.0
#: Applying a published decision is retried this long before the batch call fails. The decision
#: stays: the query restarts, Spark replays the batch, and the replay applies it.
APPLY_RETRY_BUDGET_S = 600.0
#: Attempts at one control-topic write whose transaction must be aborted (broker failover).
PUBLISH_ATTEMPTS = 5
#: Owner (envelope ``sender``) of messages written by a writer called outside a streaming query.
DIRECT_OWNER = "spark:direct"

_FENCED = {
    KafkaError._FENCED,
    KafkaError.PRODUCER_FENCED,
    KafkaError.INVALID_PRODUCER_EPOCH,
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
}


class TwophaseBatchError(AbortError):
    """A micro-batch was aborted as a whole: nothing of it is visible in any sink.

    ``sink`` and ``reason`` name the first sink that refused and why (empty when a Spark task
    failed outside the sinks); ``rejected`` counts the rows sinks refused.
    """

    def __init__(
        self,
        batch_id: int,
        txn: int,
        details: str,
        *,
        sink: str = "",
        reason: str = "",
        rejected: int = 0,
    ) -> None:
        super().__init__(f"batch {batch_id} aborted: {details}")
        self.batch_id = batch_id
        self.txn = txn
        self.sink = sink
        self.reason = reason
        self.rejected = rejected


class PipelineOwnerError(FatalError):
    """The pipeline's control log was written by another streaming query (or by a coordinator).

    ``T = batchId + 1`` only means something for the query whose checkpoint numbers the batches:
    another query's batch 3 would look "already committed" and be skipped.
    """


def virtual_topic(pipeline: str) -> str:
    """The topic name the writer's records carry (``Record.topic``)."""
    return f"spark.{pipeline}"


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


# -- fault injection ----------------------------------------------------------------------------


def _crash_point(name: str) -> None:
    """``TWOPHASE_CRASH_AT=name:n`` SIGKILLs the driver the n-th time it passes ``name``, as the
    participant's crash points do: the tests kill a driver with parts prepared or half applied."""
    spec = os.environ.get("TWOPHASE_CRASH_AT", "")
    if not spec.startswith(name + ":"):
        return
    key = f"_TWOPHASE_CRASH_COUNT_{name}"
    count = int(os.environ.get(key, "0")) + 1
    os.environ[key] = str(count)
    if count >= int(spec.split(":", 1)[1]):
        logging.getLogger("twophase.crash").warning("crash point %s reached: SIGKILL", name)
        os.kill(os.getpid(), signal.SIGKILL)


# -- retries ------------------------------------------------------------------------------------


def _retry(call: Callable[[], T_], *, budget_s: float, what: str) -> T_:
    """Run ``call``, repeating it on retriable sink errors until ``budget_s`` is spent."""
    deadline = time.monotonic() + budget_s
    backoff = 0.05
    last: RetriableSinkError
    while True:
        try:
            return call()
        except BackpressureError as exc:
            wait, last = exc.retry_after_s, exc
        except RetriableSinkError as exc:
            wait, last = backoff, exc
            backoff = min(backoff * 2, 2.0)
        if time.monotonic() + wait > deadline:
            raise last
        log.info("%s: %s; retrying in %.2fs", what, last, wait)
        time.sleep(wait)


# -- executors ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _TaskSpec:
    """Everything a task needs, small and picklable (no config objects, no clients)."""

    pipeline: str
    sinks_json: str
    batch_id: int
    txn: int
    tag: int
    chunk_rows: int
    ts_ms: int


@dataclass(frozen=True, slots=True)
class _PartResult:
    """What a task sends back to the driver: counts and names, never rows."""

    partition: int
    participant: str | None  # None: an empty partition, no part was begun
    rows: int = 0
    sinks: tuple[str, ...] = ()
    sink: str = ""  # the sink that refused or failed
    error: str = ""
    rejected: int = 0


#: Sinks per executor Python worker, by config: workers are reused across tasks and batches, so
#: connections and set-up (catalog checks, indexes) are paid once, not per task.
_EXECUTOR_SINKS: dict[str, list[Sink]] = {}
_EXECUTOR_LOCK = threading.Lock()


def _executor_sinks(spec: _TaskSpec) -> list[Sink]:
    key = f"{spec.pipeline}\n{spec.sinks_json}"
    with _EXECUTOR_LOCK:
        sinks = _EXECUTOR_SINKS.get(key)
        if sinks is None:
            sinks = build_sinks(
                json.loads(spec.sinks_json), pipeline=spec.pipeline, participant="spark-executor"
            )
            for sink in sinks:
                _retry(sink.setup, budget_s=SINK_RETRY_BUDGET_S, what=f"setup of sink {sink.name}")
            _EXECUTOR_SINKS[key] = sinks
        return sinks


def _drop_executor_sinks(spec: _TaskSpec) -> None:
    with _EXECUTOR_LOCK:
        sinks = _EXECUTOR_SINKS.pop(f"{spec.pipeline}\n{spec.sinks_json}", [])
    for sink in sinks:
        try:
            sink.close()
        except Exception as exc:  # noqa: BLE001 - dropping a broken sink must not hide the cause
            log.warning("closing sink %s: %s", sink.name, exc)


def _task_attempt_id() -> int:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return ctx.taskAttemptId() if ctx is not None else 0


def _abort_quietly(sinks: Sequence[Sink], part: PartId) -> None:
    for sink in sinks:
        try:
            _retry(functools.partial(sink.abort, part), budget_s=10.0, what=f"abort {part.token}")
        except SinkError as exc:
            # The driver aborts every part of a failed attempt again; this is only early clean-up.
            log.warning("sink %s: abort of %s failed: %s", sink.name, part.token, exc)


def _write_partition(spec: _TaskSpec, index: int, lines: Iterable[str]) -> Iterator[_PartResult]:
    """One task (on an executor): this partition's rows into every sink as one prepared part."""
    # Computed before the yield: a generator closed at the yield must not abort a prepared part.
    result = _write_part(spec, index, lines)
    yield result


def _write_part(spec: _TaskSpec, index: int, lines: Iterable[str]) -> _PartResult:
    participant = f"spark-{index}.{spec.tag}.{_task_attempt_id()}"
    part = PartId(spec.pipeline, spec.txn, participant)
    topic = virtual_topic(spec.pipeline)
    base = spec.batch_id * OFFSET_STRIDE
    sinks: list[Sink] = []
    begun = False
    rows = 0

    def flush(chunk: list[Record]) -> _PartResult | None:
        nonlocal begun
        if not begun:
            begun = True
            for sink in sinks:
                _retry(
                    functools.partial(sink.begin, part), budget_s=SINK_RETRY_BUDGET_S, what="begin"
                )
        for sink in sinks:
            refused: Sequence[Rejected] = _retry(
                functools.partial(sink.write, part, chunk),
                budget_s=SINK_RETRY_BUDGET_S,
                what=f"write {part.token}",
            )
            if refused:
                return _PartResult(
                    index,
                    participant,
                    rows,
                    sink=sink.name,
                    error=refused[0].reason,
                    rejected=len(refused),
                )
        return None

    try:
        sinks = _executor_sinks(spec)
        chunk: list[Record] = []
        loads = orjson.loads
        for line in lines:
            chunk.append(
                Record(topic, index, base + rows, spec.ts_ms, None, loads(line), size=len(line))
            )
            rows += 1
            if len(chunk) >= spec.chunk_rows:
                failed = flush(chunk)
                if failed is not None:
                    _abort_quietly(sinks, part)
                    return failed
                chunk = []
        if chunk:
            failed = flush(chunk)
            if failed is not None:
                _abort_quietly(sinks, part)
                return failed
        if not begun:
            return _PartResult(index, None)
        positions = {(topic, index): base + rows}
        for sink in sinks:
            _retry(
                functools.partial(sink.prepare, part, positions),
                budget_s=SINK_RETRY_BUDGET_S,
                what=f"prepare {part.token}",
            )
    except SinkError as exc:
        if begun:
            _abort_quietly(sinks, part)
        return _PartResult(index, participant, rows, sink=exc.sink, error=str(exc))
    except BaseException:
        if begun:
            _abort_quietly(sinks, part)
        _drop_executor_sinks(spec)
        raise
    log.info("txn=%d part %s prepared: %d rows", spec.txn, participant, rows)
    return _PartResult(index, participant, rows, tuple(s.name for s in sinks))


def _json_lines(df: DataFrame) -> RDD[str]:
    """The batch as JSON text, one object per row, made on the JVM (nulls kept).

    Spark's JSON writer is several times faster than pickling Rows to Python, and its output is
    what the participants would decode from Kafka. ``DataFrame.toJSON`` would drop null fields,
    which an upsert must see, hence ``to_json`` with ``ignoreNullFields=false``.
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
    return RDD(jrdd, sc, UTF8Deserializer())  # type: ignore[no-untyped-call]


# -- the driver ---------------------------------------------------------------------------------


def _tag_of(part: PartId) -> int | None:
    """The attempt tag in ``spark-<partition>.<tag>.<task>``; None for other names."""
    pieces = part.participant.split(".")
    if len(pieces) != 3 or not pieces[0].startswith("spark-") or not pieces[1].isdigit():
        return None
    return int(pieces[1])


def _first_line(exc: BaseException, limit: int = 400) -> str:
    text = str(exc).strip()
    for line in text.splitlines():
        # Py4J wraps the cause: prefer the line that names the exception over the wrapper's.
        if "Exception:" in line or "Error:" in line:
            return line.strip()[:limit]
    return text.splitlines()[0][:limit] if text else type(exc).__name__


@dataclass
class _Attempt:
    batch_id: int
    txn: int
    tag: int
    started_ms: int
    results: list[_PartResult] = field(default_factory=list)


class CoordinatedWriter:
    """The ``foreachBatch`` callable. One per streaming query; see the module docstring."""

    def __init__(self, cfg: PipelineConfig, *, chunk_rows: int | None = None) -> None:
        self.cfg = cfg
        self.pipeline = cfg.pipeline
        self.chunk_rows = chunk_rows or cfg.participant.max_batch_records or DEFAULT_CHUNK_ROWS
        self._sinks_json = json.dumps(cfg.sinks, sort_keys=True, default=str)
        self._sinks: list[Sink] | None = None
        self._view: LogView | None = None
        self._owner = ""
        self._decisions_since_checkpoint = 0
        self._fenced = False
        # Validate every sink section now, on the driver, so a bad config fails before a batch.
        build_sinks(cfg.sinks, pipeline=cfg.pipeline, participant="spark-driver")
        _ensure_control_topic(cfg)
        self._producer = Producer(
            client_settings(
                cfg,
                "spark-driver-producer",
                **{
                    "transactional.id": cfg.transactional_id,
                    "enable.idempotence": True,
                    "acks": "all",
                    "transaction.timeout.ms": 60_000,
                },
            )
        )
        # Bumps the producer epoch: any earlier driver of this pipeline is fenced from here on,
        # and a transaction it left open is aborted by the broker.
        self._producer.init_transactions(CALL_TIMEOUT_S)
        # Never subscribes: commits the coordinator group's offset on the control partition to
        # the latest CHECKPOINT, where every reader of the log starts.
        self._offsets = Consumer(
            client_settings(
                cfg,
                "spark-checkpoint-consumer",
                **{"group.id": cfg.coordinator_group_id, "enable.auto.commit": False},
            )
        )
        log.info(
            "coordinated writer for pipeline %s ready (control %s)",
            self.pipeline,
            cfg.control_topic,
        )

    # -- the foreachBatch entry point -------------------------------------------------------------

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        if self._fenced:
            raise FencedError(f"pipeline {self.pipeline}: this writer was fenced by a newer driver")
        txn = batch_id + 1
        query_id = df.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId")
        owner = f"spark:{query_id}" if query_id else DIRECT_OWNER
        try:
            if self._view is None or owner != self._owner:
                self._view = self._fold(owner)
            if txn <= self._view.last_decided:
                self._replay(batch_id, txn)
            else:
                self._write(df, batch_id, txn)
        except BaseException:
            # The log is the truth: whatever failed, the next call starts from a fresh fold.
            self._view = None
            raise

    def close(self) -> None:
        """Release the driver's clients. Prepared parts stay for the next writer to resolve."""
        self._producer.flush(5)
        self._offsets.close()
        for sink in self._sinks or []:
            sink.close()
        self._sinks = None

    # -- log -------------------------------------------------------------------------------------

    def _fold(self, owner: str) -> LogView:
        """Read the control log from the latest checkpoint; refuse another owner's pipeline."""
        view = LogView()
        since_checkpoint = 0
        reader = ControlReader(self.cfg)
        try:
            for env in reader.replay():
                if env.sender != owner:
                    raise PipelineOwnerError(
                        f"pipeline {self.pipeline}: its control log ({self.cfg.control_topic}) "
                        f"was written by {env.sender}, not by this query ({owner}). Batch ids "
                        "number transactions only within one query's checkpoint: give a new "
                        "query (or a new checkpoint) a pipeline of its own"
                    )
                if not view.apply(env):
                    log.warning(
                        "pipeline %s: skipping control message: out_of_sequence: %s",
                        self.pipeline,
                        view.why_out_of_sequence(env),
                    )
                    continue
                if isinstance(env.payload, Checkpoint):
                    since_checkpoint = 0
                elif isinstance(env.payload, Decision):
                    since_checkpoint += 1
        finally:
            reader.close()
        self._owner = owner
        self._decisions_since_checkpoint = since_checkpoint
        log.info(
            "pipeline %s: log folded, last committed txn %d, %d pending",
            self.pipeline,
            view.last_decided,
            len(view.pending),
        )
        return view

    def _publish(self, payload: Payload) -> int:
        """Write one control message in its own Kafka transaction; returns its offset."""
        assert self._view is not None
        env: Envelope = new_envelope(self.pipeline, self._owner, payload)
        value, headers = encode(env, self.cfg.hmac_key)
        producer = self._producer
        last = ""
        offsets: list[int] = []

        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            if err is None:
                offsets.append(msg.offset() or 0)

        for _attempt in range(PUBLISH_ATTEMPTS):
            offsets.clear()
            try:
                producer.begin_transaction()
                producer.produce(
                    self.cfg.control_topic,
                    value=value,
                    key=self.pipeline.encode(),
                    headers=list(headers),
                    on_delivery=on_delivery,
                )
                producer.flush(CALL_TIMEOUT_S)
                commit_transaction(self._producer, PUBLISH_ATTEMPTS)
            except KafkaException as exc:
                err: KafkaError = exc.args[0]
                if err.fatal() or err.code() in _FENCED:
                    self._fenced = True
                    raise FencedError(
                        f"pipeline {self.pipeline}: fenced while writing "
                        f"{type(payload).__name__}: another driver took over ({err.str()})"
                    ) from None
                last = err.str()
                if err.txn_requires_abort():
                    self._abort_transaction()
                    continue
                if err.retriable():
                    continue
                raise FatalError(f"control topic write failed: {last}") from None
            if not offsets:
                raise RetriableError("control message committed without a delivery report")
            self._view.apply(env)
            return offsets[0]
        raise RetriableError(f"control topic write kept failing: {last}")

    def _abort_transaction(self) -> None:
        try:
            self._producer.abort_transaction(CALL_TIMEOUT_S)
        except KafkaException as exc:
            log.warning("abort_transaction failed: %s", exc.args[0].str())

    def _checkpoint_if_due(self) -> None:
        assert self._view is not None
        self._decisions_since_checkpoint += 1
        if self._decisions_since_checkpoint < self.cfg.commit.checkpoint_every:
            return
        offset = self._publish(self._view.checkpoint())
        # Readers start at the latest checkpoint. Losing this commit only lengthens the tail.
        self._offsets.commit(
            offsets=[TopicPartition(self.cfg.control_topic, 0, offset)], asynchronous=False
        )
        self._decisions_since_checkpoint = 0

    # -- sinks on the driver -----------------------------------------------------------------------

    def _driver_sinks(self) -> list[Sink]:
        if self._sinks is None:
            sinks = build_sinks(self.cfg.sinks, pipeline=self.pipeline, participant="spark-driver")
            for sink in sinks:
                _retry(sink.setup, budget_s=SINK_RETRY_BUDGET_S, what=f"setup of sink {sink.name}")
            self._sinks = sinks
        return self._sinks

    def _decide(self, sink: Sink, part: PartId, outcome: Outcome, budget_s: float) -> None:
        call = sink.commit if outcome is Outcome.COMMIT else sink.abort
        _retry(
            functools.partial(call, part), budget_s=budget_s, what=f"{outcome.value} {part.token}"
        )

    def _apply_pending(self) -> None:
        """Apply every committed transaction whose COMPLETE is missing (a crash mid-apply)."""
        assert self._view is not None
        for txn, pending in sorted(self._view.pending.items()):
            self._apply(txn, tuple(pending.parts.values()))
            self._publish(Complete(txn))

    def _apply(self, txn: int, parts: Sequence[Part]) -> None:
        for i, sink in enumerate(self._driver_sinks()):
            for part in parts:
                if sink.name in part.sinks:
                    self._decide(
                        sink,
                        PartId(self.pipeline, txn, part.participant),
                        Outcome.COMMIT,
                        APPLY_RETRY_BUDGET_S,
                    )
            if i == 0:
                _crash_point("spark_mid_apply")
        log.info("txn=%d applied: %d parts", txn, len(parts))

    def _resolve_in_doubt(self, txn: int, tag: int | None) -> None:
        """Finish what earlier attempts left in the sinks (see the module docstring)."""
        assert self._view is not None
        view = self._view
        for sink in self._driver_sinks():
            for part in _retry(sink.in_doubt, budget_s=SINK_RETRY_BUDGET_S, what="in_doubt"):
                if part.txn <= view.last_decided:
                    outcome = view.outcome_of(part.txn, part.participant) or Outcome.ABORT
                    log.info(
                        "txn=%d part %s in %s: %s (decided)",
                        part.txn,
                        part.participant,
                        sink.name,
                        outcome.value,
                    )
                    self._decide(sink, part, outcome, APPLY_RETRY_BUDGET_S)
                    continue
                if tag is None:
                    continue  # undecided: only an attempt holding a tag may judge it
                other = _tag_of(part)
                if other is None:
                    log.warning(
                        "sink %s: ignoring prepared part %s (not a Spark writer's)",
                        sink.name,
                        part.token,
                    )
                elif other < tag:
                    log.info(
                        "txn=%d part %s in %s: abort (dead attempt %d)",
                        part.txn,
                        part.participant,
                        sink.name,
                        other,
                    )
                    self._decide(sink, part, Outcome.ABORT, SINK_RETRY_BUDGET_S)
                elif other > tag:
                    self._fenced = True
                    raise FencedError(
                        f"pipeline {self.pipeline}: sink {sink.name} holds part {part.token} of "
                        f"a newer driver (attempt {other} > {tag}); this driver was replaced"
                    )
            if tag is None:
                continue
            for part in _retry(
                functools.partial(sink.stale_parts, txn + 1),
                budget_s=SINK_RETRY_BUDGET_S,
                what="stale",
            ):
                other = _tag_of(part)
                if part.txn < txn or (other is not None and other < tag):
                    self._decide(sink, part, Outcome.ABORT, SINK_RETRY_BUDGET_S)

    # -- one batch ---------------------------------------------------------------------------------

    def _replay(self, batch_id: int, txn: int) -> None:
        """Spark re-runs a batch that is already committed: apply what may be missing, no more."""
        log.info(
            "txn=%d batch %d is a replay of a committed batch: applying, not writing", txn, batch_id
        )
        self._apply_pending()
        self._resolve_in_doubt(txn, None)

    def _write(self, df: DataFrame, batch_id: int, txn: int) -> None:
        started = time.monotonic()
        # The fenced write that opens the attempt; its offset is the attempt's tag.
        tag = self._publish(Prepare(txn, deadline_ms=0))
        attempt = _Attempt(batch_id, txn, tag, int(time.time() * 1000))
        self._apply_pending()
        self._resolve_in_doubt(txn, tag)
        spec = _TaskSpec(
            pipeline=self.pipeline,
            sinks_json=self._sinks_json,
            batch_id=batch_id,
            txn=txn,
            tag=tag,
            chunk_rows=self.chunk_rows,
            ts_ms=attempt.started_ms,
        )
        opened = time.monotonic()
        try:
            task = functools.partial(_write_partition, spec)
            attempt.results = _json_lines(df).mapPartitionsWithIndex(task).collect()
        except Exception as exc:
            self._abort_attempt(attempt)
            raise TwophaseBatchError(
                batch_id, txn, f"a Spark task failed: {_first_line(exc)}"
            ) from exc
        failed = [r for r in attempt.results if r.error]
        if failed:
            self._abort_attempt(attempt)
            raise _batch_error(batch_id, txn, failed)
        prepared = [r for r in attempt.results if r.participant is not None]
        written = time.monotonic()
        _crash_point("spark_after_prepare")
        decision = Decision(
            txn,
            Outcome.COMMIT,
            parts=tuple(Part(r.participant or "", tag, r.sinks) for r in prepared),
        )
        try:
            self._publish(decision)  # the commit point
        except FencedError:
            self._abort_attempt(attempt)  # only this attempt could have committed them
            raise
        decided = time.monotonic()
        _crash_point("spark_after_decision")
        self._apply(txn, decision.parts)
        if decision.parts:
            self._publish(Complete(txn))
        self._checkpoint_if_due()
        rows = sum(r.rows for r in prepared)
        done = time.monotonic()
        log.info(
            "txn=%d batch %d committed: %d rows in %d parts, %.3fs (open %.3f, write+prepare "
            "%.3f, decide %.3f, apply %.3f)",
            txn,
            batch_id,
            rows,
            len(prepared),
            done - started,
            opened - started,
            written - opened,
            decided - written,
            done - decided,
        )

    def _abort_attempt(self, attempt: _Attempt) -> None:
        """Abort every part this attempt may have left: reported ones, and any with its tag."""
        known = {r.participant for r in attempt.results if r.participant is not None}
        for sink in self._driver_sinks():
            names = set(known)
            for part in _retry(sink.in_doubt, budget_s=SINK_RETRY_BUDGET_S, what="in_doubt"):
                if part.txn == attempt.txn and _tag_of(part) == attempt.tag:
                    names.add(part.participant)
            for part in _retry(
                functools.partial(sink.stale_parts, attempt.txn + 1),
                budget_s=SINK_RETRY_BUDGET_S,
                what="stale",
            ):
                if part.txn == attempt.txn and _tag_of(part) == attempt.tag:
                    names.add(part.participant)
            for name in sorted(names):
                self._decide(
                    sink,
                    PartId(self.pipeline, attempt.txn, name),
                    Outcome.ABORT,
                    SINK_RETRY_BUDGET_S,
                )
        log.warning(
            "txn=%d batch %d aborted (attempt %d)", attempt.txn, attempt.batch_id, attempt.tag
        )


def _batch_error(batch_id: int, txn: int, failed: list[_PartResult]) -> TwophaseBatchError:
    """One message naming every sink that refused, with the first reason of each."""
    by_sink: dict[str, list[_PartResult]] = {}
    for r in failed:
        by_sink.setdefault(r.sink, []).append(r)
    details = []
    for sink, results in by_sink.items():
        rejected = sum(r.rejected for r in results)
        name = f"sink {sink}" if sink else "a task"
        if rejected:
            rows = "row" if rejected == 1 else "rows"
            details.append(f"{name} rejected {rejected} {rows}: {results[0].error}")
        else:
            details.append(f"{name} failed: {results[0].error}")
    first = failed[0]
    return TwophaseBatchError(
        batch_id,
        txn,
        "; ".join(details),
        sink=first.sink,
        reason=first.error,
        rejected=sum(r.rejected for r in failed),
    )


def _ensure_control_topic(cfg: PipelineConfig) -> None:
    """Create the pipeline's control topic when missing (the writer needs no other topic)."""
    admin = AdminClient(client_settings(cfg, "admin"))
    md = admin.list_topics(timeout=CALL_TIMEOUT_S)
    if cfg.control_topic in md.topics and not md.topics[cfg.control_topic].error:
        return
    name, partitions, rf, conf = topic_settings(cfg)[0]
    rf = max(1, min(rf, len(md.brokers)))
    conf = dict(conf)
    if "min.insync.replicas" in conf:
        conf["min.insync.replicas"] = str(
            max(1, min(int(conf["min.insync.replicas"]), rf - 1 or 1))
        )
    future = admin.create_topics(
        [NewTopic(name, num_partitions=partitions, replication_factor=rf, config=conf)],
        operation_timeout=CALL_TIMEOUT_S,
    )[name]
    try:
        future.result()
    except KafkaException as exc:
        if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise FatalError(f"cannot create topic {name}: {exc.args[0].str()}") from None
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while time.monotonic() < deadline:
        topic = admin.list_topics(name, timeout=CALL_TIMEOUT_S).topics.get(name)
        if topic is not None and not topic.error and topic.partitions:
            return
        time.sleep(0.1)
    raise RetriableError(f"control topic {name} not ready after {CALL_TIMEOUT_S}s")
