"""What the coordinated writer runs in Spark tasks: one partition's rows into every sink as one
prepared part. Rows never travel to the driver; a task returns a few counts
(:class:`~twophase.participants.spark.machine.TaskResult`).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import orjson

from twophase.participants.registry import build_sinks
from twophase.participants.sdk import (
    PLAIN_JSON,
    PartId,
    RawBatch,
    Record,
    Rejected,
    Sink,
    SinkError,
)
from twophase.participants.spark.machine import TaskResult
from twophase.retry import EARLY_ABORT_S, SINK_RETRY_S, STORE

__all__ = ["OFFSET_STRIDE", "TaskSpec", "virtual_topic", "write_partition"]

log = logging.getLogger("twophase.spark")

#: Record offsets are ``batchId * OFFSET_STRIDE + row index``: unique across batches (10**10
#: rows per partition and batch is far beyond anything one task writes) and readable in decimal.
OFFSET_STRIDE = 10**10


def virtual_topic(pipeline: str) -> str:
    """The topic name the writer's records carry (``Record.topic``)."""
    return f"spark.{pipeline}"


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """Everything a task needs, small and picklable (no config objects, no clients)."""

    pipeline: str
    sinks_json: str
    batch_id: int
    txn: int
    tag: int
    chunk_rows: int
    ts_ms: int


#: Sinks per executor Python worker, by config: workers are reused across tasks and batches, so
#: connections and set-up (catalog checks, indexes) are paid once, not per task.
_EXECUTOR_SINKS: dict[str, list[Sink]] = {}
_EXECUTOR_LOCK = threading.Lock()


def _executor_sinks(spec: TaskSpec) -> list[Sink]:
    key = f"{spec.pipeline}\n{spec.sinks_json}"
    with _EXECUTOR_LOCK:
        sinks = _EXECUTOR_SINKS.get(key)
        if sinks is None:
            sinks = build_sinks(
                json.loads(spec.sinks_json), pipeline=spec.pipeline, participant="spark-executor"
            )
            for sink in sinks:
                STORE.call(sink.setup, budget_s=SINK_RETRY_S, what=f"setup of sink {sink.name}")
            _EXECUTOR_SINKS[key] = sinks
        return sinks


def _drop_executor_sinks(spec: TaskSpec) -> None:
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
            STORE.call(
                functools.partial(sink.abort, part),
                budget_s=EARLY_ABORT_S,
                what=f"abort {part.token}",
            )
        except SinkError as exc:
            # The driver aborts every part of a failed attempt again; this is only early clean-up.
            log.warning("sink %s: abort of %s failed: %s", sink.name, part.token, exc)


def _decode(
    chunk: list[bytes], topic: str, index: int, first: int, ts_ms: int, i: int
) -> Record | str:
    """Row ``i`` of ``chunk`` as a record (offset ``first + i``), or why it is not one."""
    line = chunk[i]
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        return f"not JSON: {exc}"
    if not isinstance(value, dict):
        return f"not a JSON object: {type(value).__name__}"
    return Record(topic, index, first + i, ts_ms, None, value, size=len(line))


def write_partition(spec: TaskSpec, index: int, lines: Iterable[bytes]) -> Iterator[TaskResult]:
    """One task (on an executor): this partition's rows into every sink as one prepared part."""
    # Computed before the yield: a generator closed at the yield must not abort a prepared part.
    result = _write_part(spec, index, lines)
    yield result


def _write_part(spec: TaskSpec, index: int, lines: Iterable[bytes]) -> TaskResult:
    participant = f"spark-{index}.{spec.tag}.{_task_attempt_id()}"
    part = PartId(spec.pipeline, spec.txn, participant)
    topic = virtual_topic(spec.pipeline)
    base = spec.batch_id * OFFSET_STRIDE
    sinks: list[Sink] = []
    begun = False
    rows = 0

    def flush(chunk: list[bytes], first: int) -> TaskResult | None:
        """Write ``chunk`` (rows ``first``... of the partition) into every sink: as JSON bytes to
        a sink that reads them itself (:meth:`Sink.write_raw`, e.g. PostgreSQL's compiled
        COPY), as records decoded once to the others."""
        nonlocal begun
        if not begun:
            begun = True
            for sink in sinks:
                STORE.call(functools.partial(sink.begin, part), budget_s=SINK_RETRY_S, what="begin")
        batch = RawBatch(
            chunk,
            functools.partial(_decode, chunk, topic, index, first, spec.ts_ms),
            coords=lambda i: (topic, None),
        )
        for sink in sinks:
            write = (
                functools.partial(sink.write_raw, part, batch)
                if sink.accepts_raw_shape(PLAIN_JSON)
                else functools.partial(sink.write, part, batch.records())
            )
            refused: Sequence[Rejected] = STORE.call(
                write, budget_s=SINK_RETRY_S, what=f"write {part.token}"
            )
            if refused:
                return TaskResult(
                    index,
                    participant,
                    rows,
                    sink=sink.name,
                    error=refused[0].reason,
                    rejected=len(refused),
                )
        bad = batch.undecodable()
        if bad:  # Spark's to_json makes objects only: not expected, but never skipped
            at, reason = min(bad.items())
            return TaskResult(index, participant, rows, error=f"row {first + at}: {reason}")
        return None

    try:
        sinks = _executor_sinks(spec)
        chunk: list[bytes] = []
        for line in lines:
            chunk.append(line)
            rows += 1
            if len(chunk) >= spec.chunk_rows:
                failed = flush(chunk, base + rows - len(chunk))
                if failed is not None:
                    _abort_quietly(sinks, part)
                    return failed
                chunk = []
        if chunk:
            failed = flush(chunk, base + rows - len(chunk))
            if failed is not None:
                _abort_quietly(sinks, part)
                return failed
        if not begun:
            return TaskResult(index, None)
        positions = {(topic, index): base + rows}
        for sink in sinks:
            STORE.call(
                functools.partial(sink.prepare, part, positions),
                budget_s=SINK_RETRY_S,
                what=f"prepare {part.token}",
            )
    except SinkError as exc:
        if begun:
            _abort_quietly(sinks, part)
        return TaskResult(index, participant, rows, sink=exc.sink, error=str(exc))
    except BaseException:
        if begun:
            _abort_quietly(sinks, part)
        _drop_executor_sinks(spec)
        raise
    log.info("txn=%d part %s prepared: %d rows", spec.txn, participant, rows)
    return TaskResult(index, participant, rows, tuple(s.name for s in sinks))
