"""Writing one consumed batch into every sink: shared by the exactly-once participant and the
at-least-once runner, so both pay for exactly the same work per record."""

from __future__ import annotations

import gc
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from confluent_kafka import KafkaException, Message, Producer

from twophase.config import PipelineConfig
from twophase.kafka import client_settings, topic_max_message_bytes
from twophase.observability import Metrics
from twophase.participants.decoding import Decoder
from twophase.participants.registry import build_sinks
from twophase.participants.runtime.deadletter import DeadLetters, message_key
from twophase.participants.sdk import (
    AbortTransactionError,
    Held,
    PartId,
    RawShape,
    Record,
    Rejected,
    Sink,
)

__all__ = [
    "SOURCE_FETCH_DEFAULTS",
    "SOURCE_GROUP_SETTINGS",
    "BatchOutcome",
    "BatchResult",
    "Retractions",
    "decoding",
    "open_writers",
    "quiet_gc",
    "reads_raw",
    "write_batch",
]

log = logging.getLogger("twophase.participant")

T = TypeVar("T")

#: Per source partition of the batch: (last offset read, records written, records dead-lettered).
BatchResult = dict[tuple[str, int], tuple[int, int, int]]
#: Group membership of the source consumer, in either mode. Range assignment: a participant's
#: partitions are a function of the members alone. A short heartbeat because that is how a
#: member learns that a rebalance has begun, and until it does it reads records of the part the
#: rebalance abandons: with librdkafka's 3 s a second participant started beside a first one
#: waited up to 3 s for its partitions (2.4 s measured), while the first one read everything;
#: at 0.5 s the second generation came 0.52-0.53 s after the first (two participants started
#: together, 5 runs). 0.1 s was measured and not kept: the second 0.28 s after the first
#: (0.10-0.34, 7 runs), but at 16 participants on two cores the commit latency's p99 got worse
#: in 6 of 8 alternating pairs (medians 365 vs 221 ms; p50 140 vs 136).
SOURCE_GROUP_SETTINGS: dict[str, Any] = {
    "partition.assignment.strategy": "range",
    "session.timeout.ms": 10_000,
    "heartbeat.interval.ms": 500,
}
#: Fetching of the source consumer, in either mode; defaults the user's ``kafka.consumer`` may
#: override. librdkafka stops fetching a partition whose local queue is over its thresholds
#: and, by default, looks again only after ``fetch.queue.backoff.ms`` = 1000 ms: a consumer
#: that drains its queue in a few milliseconds then sat idle for the rest of that second --
#: one consumer read 170-310k records/s at 0.4-0.6 s of CPU per 400k (measured, 4 partitions,
#: ~220-byte records), 1.1-1.3M/s at 50 ms. The queue's size limits stay as they are.
SOURCE_FETCH_DEFAULTS: dict[str, Any] = {
    "fetch.queue.backoff.ms": 50,
}
#: Young-generation threshold of CPython's cycle collector while the hot loop runs (default 700).
GC_GEN0_THRESHOLD = 50_000


def quiet_gc() -> None:
    """Keep CPython's cycle collector off the hot path; called once set-up is done.

    Every batch allocates a few objects per record (the decoded value, the record, the sink's
    row), nearly all freed by reference counting when the batch is done. With the default
    thresholds the collector still ran every 700 allocations and, as a batch's objects survived
    into the older generations, walked the whole heap (modules, pydantic models, the client
    libraries) over and over: 1.6-1.9 us per record, a fifth of the participant's CPU
    (measured on a 200k-record consume -> decode -> PostgreSQL write loop). So: collect once,
    freeze what set-up left (it lives for the whole process), and collect the young generation
    every GC_GEN0_THRESHOLD net allocations. Reference cycles are still collected, later.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, older, oldest)


def close_quietly(
    closers: Sequence[Callable[[], object]], sinks: Sequence[Sink]
) -> Exception | None:
    """Run a runtime's Kafka closers (a consumer's close, a producer's flush), then close its
    sinks, however its run ended: one that raises is logged and the rest still run -- a Kafka
    client left to the interpreter's exit can call back into it as it is torn down.

    Returns the first error that is not a Kafka client's own (one a callback raised as its
    consumer closed -- an abort on revoke -- or a sink's), for the caller to raise when nothing
    else ended the run."""
    failed: Exception | None = None
    for close in closers:
        try:
            close()
        except (KafkaException, RuntimeError) as exc:
            log.info("closing a Kafka client: %s", exc)
        except Exception as exc:  # noqa: BLE001 -- a callback's error: say it, close the rest
            log.warning("closing a Kafka client: %s", exc)
            failed = failed or exc
    for sink in sinks:
        try:
            sink.close()
        except Exception as exc:  # noqa: BLE001 -- a sink's own code: say it, close the rest
            log.warning("closing sink %s: %s", sink.name, exc)
            failed = failed or exc
    return failed


def reads_raw(sinks: Sequence[Sink], decoder: Decoder) -> bool:
    """True when the values are JSON objects and every sink reads them itself: batches are
    scanned, not decoded, here."""
    shape = decoder.raw_shape
    return shape is not None and all(sink.accepts_raw_shape(shape) for sink in sinks)


def decoding(sinks: Sequence[Sink], decoder: Decoder) -> str:
    """How this participant's batches are decoded (for its start-up line)."""
    if reads_raw(sinks, decoder):
        return "every sink reads the JSON values itself"
    return f"values decoded once for all sinks (source.format: {decoder.format})"


def open_writers(
    cfg: PipelineConfig, me: str, metrics: Metrics, sinks: Sequence[Sink] | None = None
) -> tuple[list[Sink], Producer, DeadLetters]:
    """A participant's writing side, in either mode: its sinks (built from the config unless
    given), the idempotent producer, and the dead-letter topic over that producer."""
    built = (
        list(sinks)
        if sinks is not None
        else build_sinks(cfg.sinks, pipeline=cfg.pipeline, participant=me, source=cfg.source_file)
    )
    settings = client_settings(
        cfg,
        "participant-producer",
        **{"enable.idempotence": True, "acks": "all", "linger.ms": 5},
    )
    producer = Producer(settings)
    dlq = DeadLetters(
        producer,
        cfg.dead_letter_topic,
        cfg.pipeline,
        me,
        on_sent=lambda reason: metrics.dead_lettered.labels(
            cfg.pipeline, reason.split(":")[0][:40]
        ).inc(),
        max_bytes=int(settings.get("message.max.bytes", 1_000_000)),
        topic_limit=lambda: topic_max_message_bytes(cfg, cfg.dead_letter_topic),
    )
    return built, producer, dlq


#: Records retracted and not yet behind a committed position, at most (oldest forgotten first).
#: Each is a few hundred bytes; forgetting one early costs a second rewind when it is met again,
#: never a wrong result (it is refused again by the same sink).
MAX_RETRACTIONS = 10_000


class Retractions:
    """Source records that a later sink refused at write time after earlier sinks had stored
    them (PROTOCOL.md, "The record path"). The runtime rewinds the open part; this remembers
    the records -- source coordinates and reasons -- so the replay leaves them out before any
    sink writes. Owned by the runtime (it outlives the aborted part), pruned as positions
    commit, bounded by :data:`MAX_RETRACTIONS`."""

    def __init__(self, limit: int = MAX_RETRACTIONS) -> None:
        self._limit = limit
        self._reasons: OrderedDict[tuple[str, int, int], str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._reasons)

    def add(self, topic: str, partition: int, offset: int, reason: str) -> None:
        self._reasons[(topic, partition, offset)] = reason
        while len(self._reasons) > self._limit:
            self._reasons.popitem(last=False)

    def reason(self, topic: str, partition: int, offset: int) -> str | None:
        return self._reasons.get((topic, partition, offset))

    def prune(self, positions: Mapping[tuple[str, int], int]) -> None:
        """Forget records below committed ``positions`` (next offset per partition): a rewind
        never goes behind a committed position, so they are never read again here."""
        if not self._reasons:
            return
        for key in [k for k in self._reasons if k[2] < positions.get((k[0], k[1]), -1)]:
            del self._reasons[key]

    def split(self, msgs: Sequence[Message]) -> tuple[Sequence[Message], list[Message]]:
        """``msgs`` less the retracted ones, and those."""
        if not self._reasons:
            return msgs, []
        reasons = self._reasons
        kept: list[Message] = []
        out: list[Message] = []
        for m in msgs:
            key = (m.topic() or "", m.partition() or 0, m.offset() or 0)
            (out if key in reasons else kept).append(m)
        return (msgs, out) if not out else (kept, out)


@dataclass(slots=True)
class BatchOutcome:
    """What :func:`write_batch` did: per source partition ``(last offset, written, dead)``
    (:data:`BatchResult`), and the partitions whose part ends early: the offset of the first
    record a sink held for a later part (:class:`Held`). The caller reads each of those
    partitions again from that offset for the next part."""

    result: BatchResult
    held: dict[tuple[str, int], int] = field(default_factory=dict)


def write_batch(
    msgs: Sequence[Message],
    part: PartId,
    sinks: Sequence[Sink],
    *,
    dlq: DeadLetters,
    metrics: Metrics,
    decoder: Decoder,
    max_record_bytes: int,
    retry: Callable[[Callable[[], Any], str], Any],
    retractions: Retractions | None = None,
) -> BatchOutcome:
    """Decode ``msgs`` with ``decoder``, dead-letter what no sink can take, write the rest into every sink in
    order. A record is all-or-nothing across sinks (PROTOCOL.md, "The record path"):

    1. records in ``retractions`` (refused by a sink during an earlier try of this part) are
       left out -- dead-lettered already, counted as dead-lettered here;
    2. every sink but the first is asked :meth:`Sink.check` before any sink writes; the union
       of what they refuse is dead-lettered (naming the sink) and offered to no sink;
    3. every sink that makes its targets is asked :meth:`Sink.open_targets`: what it refuses is
       dead-lettered likewise; a record it holds (:class:`Held`) and every later record of its
       partition are left for the next part -- written nowhere, dead-lettered nowhere, read
       again (:attr:`BatchOutcome.held`);
    4. each sink writes the rest. A record the first sink refuses is dead-lettered and not
       offered to the next ones. A record a *later* sink refuses at write time is already in
       the earlier sinks: it is dead-lettered, remembered in ``retractions``, and
       :class:`AbortTransactionError` makes the caller abort the part and re-read it.

    When every sink reads JSON itself (:meth:`Sink.accepts_raw`) nothing is decoded here: the
    sinks get the values (:meth:`Sink.write_raw`) and the values they found undecodable are
    dead-lettered afterwards, with the same reasons.

    Raises what the sinks raise once ``retry`` gives up: the caller decides what a failed
    write costs (a rewind of the open part, or a re-read of the batch). Callers that rewind
    pass the same ``retractions`` every time (a fresh one per call cannot end a rewind loop)."""
    txn = part.txn
    if retractions is None:
        retractions = Retractions()
    msgs, retracted = retractions.split(msgs)
    routes = _Routes(sinks)
    msgs, untaken = routes.split(msgs)
    targeting = [s for s in sinks if _makes_targets(s)]
    # Raw values go to the sinks only when no sink needs open_targets for them: one that makes
    # targets but says these values need none (its targets follow records' own schemas, which
    # plain JSON values do not carry) keeps the raw path.
    raw_mode = (
        reads_raw(sinks, decoder)
        and not routes.routed
        and not any(_targets_raw(s, decoder.raw_shape) for s in targeting)
    )
    decoded = decoder.decode_batch(msgs, max_record_bytes, decode=not raw_mode)
    letters = _Letters(dlq, txn)
    for m in untaken:
        tp = (m.topic() or "", m.partition() or 0)
        letters.message(m, f"no sink takes topic {tp[0]} (sinks[].topics)")
        decoded.last[tp] = max(decoded.last.get(tp, -1), m.offset() or 0)
    for m in retracted:
        # Dead-lettered again on every try, not only when it was refused: that first letter may
        # have failed delivery (the flush that failed the part cleared its error), and this try
        # is the one whose flush the vote waits for. The DLQ is at-least-once by key.
        tp = (m.topic() or "", m.partition() or 0)
        offset = m.offset() or 0
        letters.message(m, retractions.reason(tp[0], tp[1], offset) or "retracted")
        decoded.last[tp] = max(decoded.last.get(tp, -1), offset)
    for u in decoded.bad:
        letters.message(u.msg, u.reason)
    values: dict[str, bytes | None] = {}
    checked = [s for s in sinks[1:] if getattr(type(s), "check", Sink.check) is not Sink.check]

    def retract(sink: Sink, rejected: Sequence[Rejected]) -> AbortTransactionError:
        """``sink`` refused at write time records that earlier sinks stored: rewind."""
        refuse(sink, rejected)
        letters.send({})
        for r in rejected:
            rec = r.record
            retractions.add(
                rec.topic, rec.partition, rec.offset, f"rejected by sink {sink.name}: {r.reason}"
            )
        log.warning(
            "txn=%s sink %s refused %d record(s) the sinks before it stored; the part is "
            "aborted and re-read without them (first: %s)",
            txn,
            sink.name,
            len(rejected),
            rejected[0].reason,
        )
        return AbortTransactionError(
            f"txn={txn}: {len(rejected)} record(s) refused by sink {sink.name} after earlier "
            "sinks stored them: retracting by re-reading the part without them",
            sink=sink.name,
        )

    def refuse(sink: Sink, rejected: Sequence[Rejected]) -> tuple[set[str], int]:
        """Dead-letter what ``sink`` refused: the records' ids and their bytes."""
        if not values:
            values.update((f"{m.topic()}:{m.partition()}:{m.offset()}", m.value()) for m in msgs)
        ids: set[str] = set()
        gone = 0
        for r in rejected:
            rec = r.record
            if rec.record_id in ids:
                continue  # a sink that names a record twice: it is dead-lettered once
            ids.add(rec.record_id)
            letters.refused(rec, values.get(rec.record_id), sink.name, r.reason)
            gone += rec.size
        return ids, gone

    size = decoded.size
    held: dict[tuple[str, int], int] = {}
    remaining: list[Record] = decoded.records
    if raw_mode:
        batch = decoded.raw_batch().with_messages(decoded.kept)
        every: list[Record] | None = None
        for sink in checked:
            # A sink that checks raw values itself does; for the others the records are decoded
            # once, shared with every sink's write through the batch.
            check_raw = getattr(sink, "check_raw", None)
            rejected = check_raw(batch) if check_raw is not None else None
            if rejected is None:
                if every is None:
                    every = batch.records()
                rejected = sink.check(every)
            if rejected:
                ids, gone = refuse(sink, rejected)
                size -= gone
                batch = batch.without(ids)
                if every is not None:
                    every = [r for r in every if r.record_id not in ids]
        for i, sink in enumerate(sinks):
            rejected = retry(partial(sink.write_raw, part, batch), f"txn={txn} write {sink.name}")
            if rejected and i > 0:
                raise retract(sink, rejected)
            if rejected:
                ids, gone = refuse(sink, rejected)
                size -= gone
                batch = batch.without(ids)
            undecodable = batch.undecodable()
            lost = sum(len(decoded.values[at]) for at in undecodable)
            metrics.records.labels(part.pipeline, sink.name).inc(len(batch) - len(undecodable))
            metrics.bytes.labels(part.pipeline, sink.name).inc(size - lost)
        for at, reason in batch.undecodable().items():
            # Counted as decoded by the scan: out of the written count, like a refusal.
            letters.message(decoded.kept[at], reason, counted=True)
    else:
        for sink in checked:
            rejected = sink.check(routes.of(sink, remaining))
            if rejected:
                ids, gone = refuse(sink, rejected)
                size -= gone
                remaining = [r for r in remaining if r.record_id not in ids]
        for sink in targeting:
            answer = retry(
                partial(sink.open_targets, part, routes.of(sink, remaining)),
                f"txn={txn} open targets {sink.name}",
            )
            rejected = [a for a in answer if a.__class__ is Rejected]
            for h in answer:
                if h.__class__ is Held:
                    rec = h.record
                    tp = (rec.topic, rec.partition)
                    if rec.offset < held.get(tp, rec.offset + 1):
                        held[tp] = rec.offset
                        log.info(
                            "txn=%s %s[%d] ends before offset %d in this part: %s",
                            txn,
                            rec.topic,
                            rec.partition,
                            rec.offset,
                            h.reason,
                        )
            if rejected:
                ids, gone = refuse(sink, rejected)
                size -= gone
                remaining = [r for r in remaining if r.record_id not in ids]
        if held:
            kept = [
                r for r in remaining if r.offset < held.get((r.topic, r.partition), r.offset + 1)
            ]
            size -= sum(r.size for r in remaining) - sum(r.size for r in kept)
            remaining = kept
        for i, sink in enumerate(sinks):
            mine = routes.of(sink, remaining)
            rejected = retry(partial(sink.write, part, mine), f"txn={txn} write {sink.name}")
            if rejected and i > 0:
                raise retract(sink, rejected)
            if rejected:
                ids, gone = refuse(sink, rejected)
                size -= gone
                remaining = [r for r in remaining if r.record_id not in ids]
                mine = [r for r in mine if r.record_id not in ids]
            metrics.records.labels(part.pipeline, sink.name).inc(len(mine))
            metrics.bytes.labels(part.pipeline, sink.name).inc(
                size if mine is remaining else sum(r.size for r in mine)
            )
    dead, refused = letters.send(held)
    result: BatchResult = {}
    for tp, last in decoded.last.items():
        out = refused.get(tp, 0)
        stop = held.get(tp)
        if stop is None:
            result[tp] = (last, decoded.counts.get(tp, 0) - out, dead.get(tp, 0) + out)
        else:
            written = sum(1 for r in remaining if (r.topic, r.partition) == tp)
            result[tp] = (stop - 1, written, dead.get(tp, 0) + out)
    return BatchOutcome(result, held)


def _makes_targets(sink: Sink) -> bool:
    """:attr:`Sink.makes_targets`; for a sink that does not derive from :class:`Sink`, whether
    its class has an ``open_targets`` of its own."""
    says = getattr(sink, "makes_targets", None)
    if says is not None:
        return bool(says)
    return getattr(type(sink), "open_targets", Sink.open_targets) is not Sink.open_targets


def _targets_raw(sink: Sink, shape: RawShape | None) -> bool:
    """:meth:`Sink.makes_targets_for` of a sink that makes targets (True when it cannot say)."""
    says = getattr(sink, "makes_targets_for", None)
    return True if says is None or shape is None else bool(says(shape))


class _Letters:
    """The batch's dead letters, sent once it is known which records the batch keeps: one at
    or after a held record of its partition is read again for the next part, so it is judged
    (and dead-lettered, if it must be) then, not now."""

    def __init__(self, dlq: DeadLetters, txn: int) -> None:
        self.dlq = dlq
        self.txn = txn
        #: (counted as decoded -- refused by a sink, or raw and undecodable?, the letter)
        self.items: list[tuple[bool, dict[str, Any]]] = []

    def message(self, m: Message, reason: str, counted: bool = False) -> None:
        """A message dead-lettered as it came; ``counted`` when the batch's scan counted it
        as decoded (a raw value a sink found undecodable)."""
        self.items.append(
            (
                counted,
                {
                    "topic": m.topic() or "",
                    "partition": m.partition() or 0,
                    "offset": m.offset() or 0,
                    "key": message_key(m),
                    "value": m.value(),
                    "reason": reason,
                },
            )
        )

    def refused(self, rec: Record, value: bytes | None, sink: str, reason: str) -> None:
        self.items.append(
            (
                True,
                {
                    "topic": rec.topic,
                    "partition": rec.partition,
                    "offset": rec.offset,
                    "key": rec.key,
                    "value": value,
                    "reason": f"rejected by sink {sink}: {reason}",
                    "sink": sink,
                },
            )
        )

    def send(
        self, held: Mapping[tuple[str, int], int]
    ) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int], int]]:
        """Send every letter before its partition's held offset; per partition, how many were
        dead-lettered before being counted as decoded, and how many after (refused by a sink,
        or found undecodable by one)."""
        dead: dict[tuple[str, int], int] = {}
        refused: dict[tuple[str, int], int] = {}
        for counted, letter in self.items:
            tp = (letter["topic"], letter["partition"])
            if letter["offset"] >= held.get(tp, letter["offset"] + 1):
                continue
            self.dlq.send(txn=self.txn, **letter)
            tally = refused if counted else dead
            tally[tp] = tally.get(tp, 0) + 1
        self.items.clear()
        return dead, refused


class _Routes:
    """Which sinks take which topics (``sinks[].topics``), looked up once per topic."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self.sinks = sinks
        self.routed = any(s.config.topics for s in sinks)
        self._takes: dict[tuple[str, str], bool] = {}

    def takes(self, sink: Sink, topic: str) -> bool:
        key = (sink.name, topic)
        if (known := self._takes.get(key)) is None:
            known = self._takes[key] = sink.config.takes(topic)
        return known

    def split(self, msgs: Sequence[Message]) -> tuple[Sequence[Message], list[Message]]:
        """``msgs`` some sink takes, and those no sink takes."""
        if not self.routed:
            return msgs, []
        kept: list[Message] = []
        untaken: list[Message] = []
        for m in msgs:
            topic = m.topic() or ""
            (kept if any(self.takes(s, topic) for s in self.sinks) else untaken).append(m)
        return kept, untaken

    def of(self, sink: Sink, records: list[Record]) -> list[Record]:
        """The records of ``records`` that ``sink`` takes."""
        if not sink.config.topics:
            return records
        return [r for r in records if self.takes(sink, r.topic)]
