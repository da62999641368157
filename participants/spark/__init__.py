"""A coordinated ``foreachBatch`` writer: every Spark micro-batch lands in all the sinks of a
pipeline as one all-or-nothing transaction, exactly once across driver crashes and batch replays.

::

    from twophase.participants.spark import coordinated_writer

    (df.writeStream
       .foreachBatch(coordinated_writer("orders-spark.yaml"))
       .option("checkpointLocation", "s3://.../checkpoints/orders")
       .start())

Where each part lives: the driver's decisions in :mod:`.machine` (pure, driven by the Spark
simulator in ``tests/sim``), the driver's I/O in :mod:`.writer`, the tasks in :mod:`.executor`;
its retry budgets beside every other in :mod:`twophase.retry`.

How one micro-batch ``batchId`` is written (``docs/spark.md`` explains each choice):

* The pipeline has its own name and control topic, and the **driver is its only decider**. It
  publishes through the coordinator's transactional publisher
  (:class:`~twophase.kafka.ControlPublisher`) with the stable ``transactional.id``
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

from twophase.participants.spark.executor import OFFSET_STRIDE, virtual_topic
from twophase.participants.spark.machine import PipelineOwnerError, TwophaseBatchError
from twophase.participants.spark.writer import (
    CoordinatedWriter,
    coordinated_writer,
    load_spark_config,
)

__all__ = [
    "OFFSET_STRIDE",
    "CoordinatedWriter",
    "PipelineOwnerError",
    "TwophaseBatchError",
    "coordinated_writer",
    "load_spark_config",
    "virtual_topic",
]
