"""``source.format: json`` -- one record per value: a JSON object (decoded with orjson), or
a record in the source's ``value_format`` (a Kafka Connect envelope, a registry format).

The default format, and the one the compiled raw path reads: a sink that parses JSON itself
(:meth:`Sink.write_raw`, the PostgreSQL sink's Rust COPY encoder) gets the values scanned, not
decoded (:attr:`JsonDecoder.raw_shape`). Integers of any width decode exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import suppress
from typing import Any

import orjson
from confluent_kafka import Message

from twophase.config import SchemaRegistryConfig, SourceConfig
from twophase.participants.decoding.base import (
    TOMBSTONE,
    Decoded,
    Decoder,
    Headers,
    Row,
    Undecodable,
    oversize,
    record_of,
)
from twophase.participants.decoding.formats import exact, loads_exact, maybe_wide
from twophase.participants.sdk import AVRO, PLAIN_JSON, Record

try:
    from twophase_native import scan_values as _native_scan
except ImportError:  # the compiled extension is optional
    _native_scan = None  # type: ignore[assignment]

__all__ = ["JsonDecoder"]


def _not_an_object(value: bytes) -> tuple[dict[str, Any] | None, str]:
    """The decoded object, or None and why the value is not one."""
    obj, reason = loads_exact(value)
    if reason:
        return None, reason
    if obj.__class__ is not dict:
        return None, f"undecodable: JSON {type(obj).__name__}, expected an object"
    return obj, ""


class JsonDecoder(Decoder):
    format = "json"

    def __init__(
        self, source: SourceConfig | None = None, registry: SchemaRegistryConfig | None = None
    ) -> None:
        super().__init__(source, registry)
        # A sink may read the bytes itself only when they are the whole record: JSON, or the
        # registry's Avro framing (with the writer schemas the decoder fetched).
        if self.plain:
            self.raw_shape = PLAIN_JSON
        elif self.bare and source is not None and source.value_format == "avro":
            self.raw_shape = AVRO
        self._json = self.values.name == "json"

    def decode_value(
        self, value: bytes, headers: Headers, topic: str = ""
    ) -> dict[str, Any] | Row | str:
        if self._json:
            obj, reason = _not_an_object(value)
            return reason if obj is None else obj
        got = self.values.decode(value, topic)
        if isinstance(got, str):
            return got
        fields, schema = got
        if fields.__class__ is not dict:
            return f"undecodable: {self.values.name} {type(fields).__name__}, expected a record"
        return fields if schema is None else Row(fields, schema=schema)

    def decode_message(self, m: Message) -> Record | str:
        if not self.plain:
            return super().decode_message(m)
        value = m.value() or b""
        obj, reason = _not_an_object(value)
        if obj is None:
            return reason
        return record_of(m, m.topic() or "", m.partition() or 0, m.offset() or 0, obj, len(value))

    def decode_batch(
        self, msgs: Sequence[Message], max_record_bytes: int, decode: bool = True
    ) -> Decoded:
        """The base class's scan with JSON inlined: this loop is the hot path of every
        participant (~1 us per record), so it does not pay a method call per message. A source
        with options (key fields, Kafka coordinates, tombstones) takes the base class's."""
        if not self.plain:
            return super().decode_batch(msgs, max_record_bytes, decode)
        return _decode_batch(self, msgs, max_record_bytes, decode)


def _decode_batch(
    decoder: Decoder, msgs: Sequence[Message], max_record_bytes: int, decode: bool
) -> Decoded:
    """JSON objects become :class:`Record`; anything else is returned with the reason.

    ``decode=False``: only tombstones and oversize values are set aside; the rest are kept
    as bytes (for sinks that read JSON themselves) -- in one compiled pass when
    ``twophase_native`` is installed (:func:`_scan`)."""
    if not decode and _native_scan is not None:
        with suppress(TypeError):  # a value that is not bytes (never from Kafka): the loop below
            return _scan(decoder, msgs, max_record_bytes)
    good: list[Record] = []
    bad: list[Undecodable] = []
    kept: list[Message] = []
    values: list[bytes] = []
    last: dict[tuple[str, int], int] = {}
    counts: dict[tuple[str, int], int] = {}
    size = 0
    loads = orjson.loads
    wide = maybe_wide
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
            bad.append(Undecodable(m, TOMBSTONE))
            continue
        n = len(value)
        if n > max_record_bytes:
            bad.append(Undecodable(m, oversize(n, max_record_bytes)))
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
            obj = exact(value, obj)
        if obj.__class__ is not dict:
            # Why not, or (an integer past a double's range, which orjson cannot read) the
            # object after all.
            obj, reason = _not_an_object(value)
            if obj is None:
                bad.append(Undecodable(m, reason))
                continue
        append(record_of(m, topic, partition, offset, obj, n))
        run_good += 1
        size += n
    if run_partition >= 0:
        _merge_run(last, counts, (run_topic, run_partition), run_last, run_good)
    return Decoded(good, bad, last, counts, size, kept, values, decoder)


def _scan(decoder: Decoder, msgs: Sequence[Message], max_record_bytes: int) -> Decoded:
    """:func:`_decode_batch` with ``decode=False``, the loop in compiled code
    (``twophase_native.scan_values``; the same reads of each message, the same outcome)."""
    assert _native_scan is not None
    kept, values, set_aside, runs, size = _native_scan(
        msgs if isinstance(msgs, list) else list(msgs), max_record_bytes
    )
    bad = [
        Undecodable(msgs[i], TOMBSTONE if n < 0 else oversize(n, max_record_bytes))
        for i, n in set_aside
    ]
    last: dict[tuple[str, int], int] = {}
    counts: dict[tuple[str, int], int] = {}
    for topic, partition, run_last, run_good in runs:
        _merge_run(last, counts, (topic, partition), run_last, run_good)
    return Decoded([], bad, last, counts, size, kept, values, decoder)


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
