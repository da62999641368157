"""Decoding source records, and the dead-letter topic for the ones no sink can take.

A dead-lettered record counts as handled inside the transaction that met it: its offset is
covered by the part's vote, and the DLQ write is flushed before the vote goes out, so it is never
lost. If that transaction aborts, the record is read and dead-lettered again: the DLQ is
at-least-once, keyed by the source coordinates (``topic:partition:offset``) so a reader can
de-duplicate.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from confluent_kafka import KafkaError, KafkaException, Message, Producer

from twophase.errors import RetriableError
from twophase.observability import txn_extra
from twophase.participants.sdk import RawBatch, Record

__all__ = ["DeadLetters", "Decoded", "decode_batch", "decode_message", "message_key"]

H_REASON = "twophase.reason"
log = logging.getLogger("twophase.participant")


@dataclass(frozen=True, slots=True)
class Undecodable:
    msg: Message
    reason: str


def message_key(m: Message) -> bytes | None:
    key = m.key()
    return key if isinstance(key, bytes) else None


@dataclass(slots=True)
class Decoded:
    """One consumed batch, decoded: the records, what could not be decoded, and per source
    partition the highest offset read and how many records decoded (counted in the same pass,
    so the caller never walks the batch again).

    Scanned without decoding (``decode_batch(..., decode=False)``), ``records`` is empty and
    ``kept``/``values`` hold the messages that passed the size and tombstone checks and their
    values, counted as decoded until a :class:`RawBatch` finds otherwise."""

    records: list[Record]
    bad: list[Undecodable]
    last: dict[tuple[str, int], int]
    counts: dict[tuple[str, int], int]
    #: Bytes of the decoded records' values.
    size: int
    kept: list[Message]
    values: list[bytes]

    def raw_batch(self) -> RawBatch:
        """The kept values for :meth:`Sink.write_raw`, decoding on demand."""
        kept = self.kept
        return RawBatch(self.values, lambda i: decode_message(kept[i]))


#: ``Record(...)`` through its generated ``__new__`` costs ~0.2 us more per record than the
#: tuple constructor it calls (measured); the field order is Record's.
_new_tuple = tuple.__new__


def _record(
    m: Message, topic: str, partition: int, offset: int, obj: dict[str, Any], n: int
) -> Record:
    ts = m.timestamp()[1]
    key = m.key()
    return _new_tuple(
        Record,
        (
            topic,
            partition,
            offset,
            # Kafka's value as it is: any int64 create time, -1 when the record has none.
            ts,
            key if key.__class__ is bytes else None,
            obj,
            (),
            n,
        ),
    )


#: orjson decodes an integer outside -2**63 .. 2**64-1 as the nearest double:
#: 18446744073709551617 would become 1.8446744073709552e+19. Any such double is at least this
#: large; a decoded value holding one is decoded again by the standard library, which keeps
#: every integer exact (a float literal this large is decoded again too, to the same value).
#: Looking costs ~0.3 us for a flat ~200-byte record (a regex over the bytes cost ~1.5 us).
_WIDE = 9.2e18


def _maybe_wide(obj: dict[str, Any]) -> bool:
    """True when ``obj`` (orjson's decoding) holds a double that may be a rounded integer."""
    stack: list[Any] = [obj]
    while stack:
        item = stack.pop()
        for v in item.values() if item.__class__ is dict else item:
            kind = v.__class__
            if kind is float:
                if v >= _WIDE or v <= -_WIDE:
                    return True
            elif kind is dict or kind is list:
                stack.append(v)
    return False


def _exact(value: bytes, obj: Any) -> Any:
    """``obj`` (orjson's decoding of ``value``, so strict JSON) with integers of any size kept
    exact, or a str saying why it cannot be."""
    if not _maybe_wide(obj):
        return obj
    try:
        return json.loads(value)
    except RecursionError:
        return "undecodable: nested too deeply"
    except ValueError as exc:  # an integer past the interpreter's digit limit
        return f"undecodable: {exc}"


def _not_an_object(value: bytes) -> tuple[dict[str, Any] | None, str]:
    """The decoded object, or None and why the value is not one."""
    try:
        obj = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        return None, f"undecodable: not JSON ({exc})"
    if obj.__class__ is not dict:
        return None, f"undecodable: JSON {type(obj).__name__}, expected an object"
    obj = _exact(value, obj)
    if obj.__class__ is str:
        return None, obj
    return obj, ""


def decode_message(m: Message) -> Record | str:
    """One kept message decoded: its record, or why it is undecodable."""
    value = m.value() or b""
    obj, reason = _not_an_object(value)
    if obj is None:
        return reason
    return _record(m, m.topic() or "", m.partition() or 0, m.offset() or 0, obj, len(value))


def decode_batch(msgs: Sequence[Message], max_record_bytes: int, decode: bool = True) -> Decoded:
    """JSON objects become :class:`Record`; anything else is returned with the reason.

    ``decode=False``: only tombstones and oversize values are set aside; the rest are kept
    as bytes (for sinks that read JSON themselves)."""
    good: list[Record] = []
    bad: list[Undecodable] = []
    kept: list[Message] = []
    values: list[bytes] = []
    last: dict[tuple[str, int], int] = {}
    counts: dict[tuple[str, int], int] = {}
    size = 0
    loads = orjson.loads
    wide = _maybe_wide
    append = good.append
    # Messages come in runs of one partition: the summary is updated once per run.
    run_topic = ""
    run_partition = -1
    run_last = -1
    run_good = 0
    for m in msgs:
        topic = m.topic() or ""
        partition = m.partition() or 0
        offset = m.offset() or 0
        if partition != run_partition or topic != run_topic:
            if run_partition >= 0:
                _merge_run(last, counts, (run_topic, run_partition), run_last, run_good)
            run_topic, run_partition, run_last, run_good = topic, partition, -1, 0
        if offset > run_last:
            run_last = offset
        value = m.value()
        if value is None:
            bad.append(Undecodable(m, "null value (tombstone): nothing to write"))
            continue
        n = len(value)
        if n > max_record_bytes:
            bad.append(Undecodable(m, f"oversize: {n} bytes > {max_record_bytes}"))
            continue
        if not decode:
            kept.append(m)
            values.append(value)
            run_good += 1
            size += n
            continue
        try:
            obj = loads(value)
        except orjson.JSONDecodeError:
            obj = None
        if obj.__class__ is dict and wide(obj):
            obj = _exact(value, obj)
        if obj.__class__ is not dict:
            bad.append(Undecodable(m, _not_an_object(value)[1]))
            continue
        append(_record(m, topic, partition, offset, obj, n))
        run_good += 1
        size += n
    if run_partition >= 0:
        _merge_run(last, counts, (run_topic, run_partition), run_last, run_good)
    return Decoded(good, bad, last, counts, size, kept, values)


def _merge_run(
    last: dict[tuple[str, int], int],
    counts: dict[tuple[str, int], int],
    tp: tuple[str, int],
    run_last: int,
    run_good: int,
) -> None:
    if run_last > last.get(tp, -1):
        last[tp] = run_last
    counts[tp] = counts.get(tp, 0) + run_good


#: Headers of a dead letter whose original did not fit the DLQ (see :class:`DeadLetters`).
H_TRUNCATED = "twophase.truncated"
H_VALUE_SIZE = "twophase.original.value.size"
H_KEY_SIZE = "twophase.original.key.size"
#: What librdkafka and the broker count on top of key, value and headers: the record and
#: record-batch framing (~100 bytes) and per-header varints; generous so a trimmed letter fits.
_FRAMING_BYTES = 1024
#: A source key kept in full up to this size; a longer one is cut to it (its size is in a
#: header): the coordinates, not the key, identify the record.
_KEY_KEEP_BYTES = 4096
#: librdkafka's default ``message.max.bytes`` (the producer's own limit on one message).
_DEFAULT_MESSAGE_MAX_BYTES = 1_000_000
#: How long one dead letter waits for room in a full producer queue before it is given up
#: for this part (which then fails its prepare and is retried).
_QUEUE_FULL_WAIT_S = 5.0


class DeadLetters:
    """Produces rejected records to the DLQ with the reason and source coordinates in headers.

    Any record can be dead-lettered: when the original (value, source key and headers) does
    not fit the smaller of the producer's ``message.max.bytes`` and the DLQ topic's
    ``max.message.bytes``, the letter keeps the coordinates and the reason, the value cut to
    what fits and ``twophase.truncated`` naming what was cut (``value``, ``key``) with the
    original sizes. A produce error of one letter never raises out of :meth:`send`: it is
    kept, and :meth:`flush` (before the vote) fails the part with it, so the part is retried
    and nothing is lost."""

    def __init__(
        self,
        producer: Producer,
        topic: str,
        pipeline: str,
        participant: str,
        on_sent: Callable[[str], None] = lambda reason: None,
        *,
        max_bytes: int = _DEFAULT_MESSAGE_MAX_BYTES,
        topic_limit: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.on_sent = on_sent
        self.producer = producer
        self.topic = topic
        self.pipeline = pipeline
        self.participant = participant
        self._errors: list[str] = []
        #: Letters the broker refused as too large, for flush() to send again cut harder.
        self._smaller: list[tuple[bytes, bytes | None, list[tuple[str, bytes]], int, str]] = []
        self._max_bytes = max_bytes
        self._topic_limit = topic_limit
        self._limit: int | None = None

    def limit(self) -> int:
        """The largest letter the DLQ takes: the producer's limit or the topic's, if smaller
        (looked up once; a failed look-up leaves the producer's, and a broker refusal then
        trims the letter further)."""
        if self._limit is None:
            try:
                topic_max = self._topic_limit()
            except (KafkaException, TimeoutError, ValueError) as exc:
                # Not authorised (DescribeConfigs), no such topic yet, slow broker: the
                # producer's limit holds, and a broker refusal cuts the letter further.
                log.warning("dead-letter topic %s: max.message.bytes unknown: %s", self.topic, exc)
                topic_max = None
            self._limit = min(self._max_bytes, topic_max or self._max_bytes)
        return self._limit

    def send(
        self,
        *,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        reason: str,
        txn: int,
        sink: str = "",
    ) -> None:
        headers = [
            (H_REASON, reason.encode(errors="replace")[:4000]),
            ("twophase.pipeline", self.pipeline.encode()),
            ("twophase.participant", self.participant.encode()),
            ("twophase.txn", str(txn).encode()),
            ("twophase.source.topic", topic.encode(errors="replace")),
            ("twophase.source.partition", str(partition).encode()),
            ("twophase.source.offset", str(offset).encode()),
            ("twophase.source.key", key or b""),
        ]
        if sink:
            headers.append(("twophase.sink", sink.encode()))
        letter_key = f"{topic}:{partition}:{offset}".encode(errors="replace")
        self._produce(letter_key, value, headers, self.limit(), f"{topic}[{partition}]@{offset}")
        self.on_sent(reason)
        log.warning(
            "txn=%s dead-lettered %s[%s]@%s: %s",
            txn,
            topic,
            partition,
            offset,
            reason,
            extra=txn_extra(
                txn, [(topic, partition)], pipeline=self.pipeline, participant=self.participant
            ),
        )

    def _produce(
        self,
        key: bytes,
        value: bytes | None,
        headers: list[tuple[str, bytes]],
        limit: int,
        where: str,
    ) -> None:
        """Produce one letter cut to ``limit`` bytes; errors are kept for :meth:`flush`."""
        value_out, headers_out = fit_letter(key, value, headers, limit)

        def delivered(err: KafkaError | None, _msg: Message) -> None:
            # Runs inside poll()/flush(): it must never raise.
            if err is None:
                return
            if err.code() == KafkaError.MSG_SIZE_TOO_LARGE and limit > _FRAMING_BYTES:
                # The broker's limit is lower than we knew (the topic's, or a batch of
                # letters over it): flush() sends the same letter again, cut harder. Not
                # from here: librdkafka must not be re-entered from its delivery callback.
                self._smaller.append((key, value, headers, limit // 4, where))
                return
            self._errors.append(f"{where}: {err.str()}")

        deadline = time.monotonic() + _QUEUE_FULL_WAIT_S
        while True:
            try:
                self.producer.produce(
                    self.topic,
                    value=value_out,
                    key=key,
                    headers=headers_out,  # type: ignore[arg-type]
                    on_delivery=delivered,
                )
                break
            except BufferError:
                # The producer's queue is full: make room by serving deliveries, then retry.
                if time.monotonic() > deadline:
                    self._errors.append(f"{where}: producer queue full")
                    return
                self.producer.poll(0.1)
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                code = err.code() if isinstance(err, KafkaError) else None
                if code == KafkaError.MSG_SIZE_TOO_LARGE and limit > _FRAMING_BYTES:
                    self._produce(key, value, headers, limit // 4, where)
                    return
                self._errors.append(f"{where}: {err.str() if isinstance(err, KafkaError) else exc}")
                return
            except (TypeError, ValueError) as exc:
                self._errors.append(f"{where}: {exc}")
                return
        self.producer.poll(0)

    def flush(self, timeout_s: float) -> None:
        """Before a vote: every dead letter of the part is durable, or the prepare fails."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.producer.flush(max(deadline - time.monotonic(), 0)) > 0:
                raise RetriableError(f"dead letters not delivered within {timeout_s}s")
            if not self._smaller:
                break
            # Letters the broker found too large: again, cut harder, one at a time so no
            # batch of them is over the topic's limit.
            retry, self._smaller = self._smaller, []
            self._limit = min(self.limit(), max(r[3] for r in retry))
            for key, value, headers, limit, where in retry:
                self._produce(key, value, headers, limit, where)
                if self.producer.flush(max(deadline - time.monotonic(), 0)) > 0:
                    raise RetriableError(f"dead letters not delivered within {timeout_s}s")
        if self._errors:
            first, n = self._errors[0], len(self._errors)
            self._errors = []
            raise RetriableError(f"dead letter not delivered ({n} failed): {first}")


def fit_letter(
    key: bytes, value: bytes | None, headers: list[tuple[str, bytes]], limit: int
) -> tuple[bytes | None, list[tuple[str, bytes]]]:
    """The value and headers of a letter of at most ``limit`` bytes (key, value, headers and
    framing): the original when it fits, else the source key cut to :data:`_KEY_KEEP_BYTES`
    and the value cut to the room left, with ``twophase.truncated`` naming what was cut and
    the original sizes."""

    def size(v: bytes | None, hs: list[tuple[str, bytes]]) -> int:
        return len(key) + len(v or b"") + sum(len(k) + len(x) + 8 for k, x in hs) + _FRAMING_BYTES

    if size(value, headers) <= limit:
        return value, headers
    cut: list[str] = []
    out: list[tuple[str, bytes]] = []
    for name, data in headers:
        if name == "twophase.source.key" and len(data) > _KEY_KEEP_BYTES:
            out.append((name, data[:_KEY_KEEP_BYTES]))
            out.append((H_KEY_SIZE, str(len(data)).encode()))
            cut.append("key")
        else:
            out.append((name, data))
    out.append((H_VALUE_SIZE, str(len(value or b"")).encode()))
    marker = (H_TRUNCATED, b"key,value")  # the longest it can be: room for it is kept
    room = limit - size(b"", [*out, marker])
    if room < 0:
        # Even the coordinates do not fit (a tiny limit): no key, a short reason.
        out = [
            (n, b"" if n == "twophase.source.key" else d[:256] if n == H_REASON else d)
            for n, d in out
        ]
        room = limit - size(b"", [*out, marker])
    kept = value
    if value is not None and len(value) > max(room, 0):
        kept = value[: max(room, 0)]
        cut.append("value")
    out.append((H_TRUNCATED, ",".join(cut).encode()))
    return kept, out
