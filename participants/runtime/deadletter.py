"""The dead-letter topic, for the records no sink can take.

A dead-lettered record counts as handled inside the transaction that met it: its offset is
covered by the part's vote, and the DLQ write is flushed before the vote goes out, so it is never
lost. If that transaction aborts, the record is read and dead-lettered again: the DLQ is
at-least-once, keyed by the source coordinates (``topic:partition:offset``) so a reader can
de-duplicate. What cannot be decoded comes here from :mod:`twophase.participants.decoding`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from twophase.errors import RetriableError
from twophase.observability import txn_extra

__all__ = ["DeadLetters", "message_key"]

H_REASON = "twophase.reason"
log = logging.getLogger("twophase.participant")


def message_key(m: Message) -> bytes | None:
    key = m.key()
    return key if isinstance(key, bytes) else None


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
