"""``participant.mode: at_least_once``: the same sinks, decoding and dead-letter topic as the
exactly-once participant, with no coordinator and no control topic.

Each consumed batch is one local part: ``begin``, ``write``, ``prepare``, ``commit`` in every
sink, one after the other, then the batch's offsets are committed to the source group. A crash
between a sink's commit and the offset commit replays the batch: duplicates, unless the sinks
upsert by key. Nothing is all-or-nothing across sinks either -- a crash between two sinks'
commits leaves the batch in one and not (yet) the other. This mode exists to measure what the
coordination costs (``make bench``) and for pipelines whose sinks absorb replays.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any, TypeVar

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

from twophase.config import PipelineConfig
from twophase.errors import RetriableError
from twophase.faults import crash_point
from twophase.kafka import CALL_TIMEOUT_S, client_settings, raise_fatal
from twophase.observability import HealthServer, Metrics, txn_extra
from twophase.participants.decoding import source_decoder
from twophase.participants.runtime.batch import (
    SOURCE_FETCH_DEFAULTS,
    SOURCE_GROUP_SETTINGS,
    Retractions,
    close_quietly,
    decoding,
    open_writers,
    quiet_gc,
    write_batch,
)
from twophase.participants.runtime.gaps import UnreadStarts
from twophase.participants.runtime.subscription import Subscription
from twophase.participants.sdk import PartId, Sink, SinkError
from twophase.retry import STORE_OR_KAFKA, STORE_WAIT_S

__all__ = ["AtLeastOnceRuntime"]

log = logging.getLogger("twophase.participant")
T = TypeVar("T")

CONSUME_TIMEOUT_S = 0.2
#: A batch is what one consume() returns, up to participant.max_batch_records.


class AtLeastOnceRuntime:
    def __init__(
        self,
        cfg: PipelineConfig,
        *,
        participant_id: str = "",
        metrics: Metrics | None = None,
        sinks: Sequence[Sink] | None = None,
    ) -> None:
        self.cfg = cfg
        self.me = participant_id or cfg.participant_id
        self.metrics = metrics or Metrics(cfg.pipeline, "participant")
        self.sinks, self.producer, self.dlq = open_writers(cfg, self.me, self.metrics, sinks)
        self.decoder = source_decoder(cfg)
        self.stop_event = threading.Event()
        self.consumer = Consumer(
            client_settings(
                cfg,
                "source-consumer",
                SOURCE_FETCH_DEFAULTS,
                **{
                    "client.id": f"twophase-{cfg.pipeline}-participant-{self.me}",
                    "group.id": cfg.group_id,
                    "enable.auto.commit": False,
                    "auto.offset.reset": "earliest",
                    "isolation.level": "read_committed",
                    **SOURCE_GROUP_SETTINGS,
                },
            )
        )
        self.subscription = Subscription(cfg, self.consumer, self._on_assign, self._on_revoke)
        self._assigned = False
        self.health = HealthServer(self.metrics, ready=lambda: self._assigned, status=self.status)
        self._txn = 0
        self.batches = 0
        #: Records a later sink refused after earlier ones stored them: the re-read leaves them
        #: out, so a record is in every sink or in none here too.
        self.retractions = Retractions()
        #: Records deleted from a partition before they were delivered: logged and counted.
        self._unread = UnreadStarts(cfg.pipeline, self.metrics.deleted_unread)

    def status(self) -> dict[str, Any]:
        return {
            "role": "participant",
            "mode": "at_least_once",
            "participant": self.me,
            "pipeline": self.cfg.pipeline,
            "ready": self._assigned,
            "batches": self.batches,
            "sinks": [s.name for s in self.sinks],
        }

    def stop(self) -> None:
        self.stop_event.set()

    def run(self) -> None:
        ended: BaseException | None = None
        try:
            # Inside the try: a port in use (ConfigError naming metrics.port) still closes the
            # Kafka clients, which would otherwise keep the process alive.
            self.health.start(self.cfg.metrics.host, self.cfg.metrics.port)
            for sink in self.sinks:
                self._retry(sink.setup, f"setup {sink.name}", STORE_WAIT_S)
            self._txn = self._next_txn()
            self._discard_leftovers()
            self.subscription.start()
            log.info(
                "participant %s running at-least-once for pipeline %s (%s)",
                self.me,
                self.cfg.pipeline,
                decoding(self.sinks, self.decoder),
            )
            quiet_gc()
            while not self.stop_event.is_set():
                self.health.beat()
                self.subscription.refresh()
                msgs = self.consumer.consume(
                    self.cfg.participant.max_batch_records, CONSUME_TIMEOUT_S
                )
                for m in msgs:
                    err = m.error()
                    if err is not None:
                        raise_fatal(err)
                self._unread.check(self.consumer, msgs)
                if msgs:
                    self._batch(msgs)
        except BaseException as exc:
            ended = exc
            raise
        finally:
            failed = close_quietly(
                [self.consumer.close, lambda: self.producer.flush(5)], self.sinks
            )
            self.health.stop()
            if failed is not None and ended is None:
                raise failed

    def _next_txn(self) -> int:
        """Part numbers only need to grow per participant, across restarts too: centiseconds
        since the epoch (12 digits, as the sinks' part names are padded to)."""
        self._txn = max(self._txn + 1, int(time.time() * 100))
        return self._txn

    def _txn_extra(self, txn: int, tps: Iterable[tuple[str, int]]) -> dict[str, Any]:
        return txn_extra(txn, tps, pipeline=self.cfg.pipeline, participant=self.me)

    def _discard_leftovers(self) -> None:
        """A crashed run of this participant may have left parts behind; their offsets were
        never committed, so the records come again. An open part is aborted. A prepared one is
        committed -- rolled forward, never back: the crash may have come in the middle of its
        commit, after a sink had already shown it (a files commit that published its files and
        not yet its manifest cannot be undone), and committing a batch whose records come again
        is what at-least-once allows."""
        for sink in self.sinks:
            prepared = self._retry(sink.in_doubt, f"in_doubt {sink.name}", STORE_WAIT_S)
            stale = self._retry(
                partial(sink.stale_parts, self._txn), f"stale {sink.name}", STORE_WAIT_S
            )
            for part, decide, what in [
                *((p, sink.commit, "committed") for p in prepared),
                *((p, sink.abort, "aborted") for p in stale),
            ]:
                if part.pipeline == self.cfg.pipeline and part.participant == self.me:
                    self._retry(
                        partial(decide, part), f"{what} {part.token} {sink.name}", STORE_WAIT_S
                    )
                    # A leftover's partitions are not known here (it is decided unread): none.
                    log.info(
                        "txn=%s %s a leftover part in %s",
                        part.txn,
                        what,
                        sink.name,
                        extra=self._txn_extra(part.txn, ()),
                    )

    def _batch(self, msgs: list[Any]) -> None:
        part = PartId(self.cfg.pipeline, self._next_txn(), self.me)
        try:
            for sink in self.sinks:
                self._retry(partial(sink.begin, part), f"begin {sink.name}")
            batch = write_batch(
                msgs,
                part,
                self.sinks,
                dlq=self.dlq,
                metrics=self.metrics,
                decoder=self.decoder,
                max_record_bytes=self.cfg.participant.max_record_bytes,
                retry=self._retry,
                retractions=self.retractions,
            )
            positions = {tp: last + 1 for tp, (last, _w, _d) in batch.result.items()}
            self.dlq.flush(CALL_TIMEOUT_S)
            for sink in self.sinks:
                self._retry(partial(sink.prepare, part, positions), f"prepare {sink.name}")
        except (SinkError, RetriableError) as exc:
            # Nothing of the batch's offsets is committed: re-read it from the last commit.
            log.error(
                "txn=%s batch failed, re-reading it: %s",
                part.txn,
                exc,
                extra=self._txn_extra(part.txn, {(m.topic(), m.partition()) for m in msgs}),
            )
            for sink in self.sinks:
                # Before re-reading: the batch must be gone from every sink, however long a
                # store takes to answer.
                self._retry(partial(sink.abort, part), f"abort {sink.name}", STORE_WAIT_S)
            self._rewind()
            return
        # Prepared in every sink: from here the batch only goes forward. Once one sink shows
        # it, aborting the others would need an abort of a committed part, which is refused.
        for i, sink in enumerate(self.sinks):
            if i:
                crash_point("alo_mid_commit")  # a sink shows the batch, the next does not yet
            self._retry(partial(sink.commit, part), f"commit {sink.name}", STORE_WAIT_S)
        self.consumer.commit(
            offsets=[TopicPartition(t, p, o) for (t, p), o in sorted(positions.items())],
            asynchronous=False,
        )
        for (topic, partition), offset in batch.held.items():
            # Held for a later batch (Held): read again from there.
            self.consumer.seek(TopicPartition(topic, partition, offset))
            self._unread.expect(self.consumer, {(topic, partition): offset})
        self.retractions.prune(positions)
        self.batches += 1
        self.metrics.cycles.labels(self.cfg.pipeline, "commit").inc()

    def _rewind(self) -> None:
        assignment = self.consumer.assignment()
        if not assignment:
            return
        for c in self.consumer.committed(assignment, timeout=CALL_TIMEOUT_S):
            # Nothing committed yet: from the start, as auto.offset.reset = earliest read it
            # (without this seek the failed batch was skipped, not re-read).
            self.consumer.seek(
                c if c.offset >= 0 else TopicPartition(c.topic, c.partition, OFFSET_BEGINNING)
            )
            self._unread.expect(self.consumer, {(c.topic, c.partition): c.offset})

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._assigned = True
        log.info("assigned %s", ", ".join(f"{p.topic}[{p.partition}]" for p in partitions))
        # Reading starts at the group's committed offsets: watched for records deleted unread.
        self._unread.clear()
        self._unread.assigned((p.topic, p.partition) for p in partitions)
        try:
            committed = consumer.committed(partitions, timeout=CALL_TIMEOUT_S)
        except KafkaException as exc:
            log.info("committed offsets not read, deletions unread not watched: %s", exc)
            return
        self._unread.expect(consumer, {(c.topic, c.partition): c.offset for c in committed})

    def _on_revoke(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        log.info("revoked %s", ", ".join(f"{p.topic}[{p.partition}]" for p in partitions))

    def _retry(self, fn: Callable[[], T], what: str, budget_s: float | None = None) -> T:
        budget = self.cfg.participant.sink_retry_s if budget_s is None else budget_s
        return STORE_OR_KAFKA.call(
            fn, what, budget_s=budget, stop=self.stop_event, give_up=RetriableError, logger=log
        )
