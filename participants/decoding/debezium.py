"""``source.format: debezium`` -- Debezium change events, as JSON, with or without the Kafka
Connect ``{schema, payload}`` envelope (the JSON converter's ``schemas.enable``).

An event is ``{before, after, op, source, ts_ms}``. Unwrapped (``debezium.unwrap``, the
default) a create (``c``), snapshot read (``r``) or update (``u``) becomes the row ``after``, and
a delete (``d``) becomes a delete of the row ``before`` names (its key's fields: with
``REPLICA IDENTITY DEFAULT`` PostgreSQL sends only those), or of the record key with
``key_format: json``. An update that changes a row's primary key arrives from Debezium as a
delete of the old key and a create of the new one, and is applied as such. A truncate (``t``)
or a logical-decoding message (``m``) is not a row change: dead-lettered with the reason.
Not unwrapped, every event is one record with the event's fields, never a delete.

Values typed by the envelope's schema (decimals, dates, times, timestamps) come out as exact
JSON values (:mod:`.connect`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from twophase.config import DebeziumConfig, SchemaRegistryConfig, SourceConfig
from twophase.participants.decoding.base import Decoder, Headers, Row
from twophase.participants.decoding.connect import ConnectError, record_schema, unwrap
from twophase.participants.decoding.formats import loads_exact
from twophase.participants.sdk import RawShape, RecordSchema

__all__ = ["DebeziumDecoder"]

_ROW_OPS = frozenset({"c", "r", "u"})


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 100 else text[:100] + "..."


class DebeziumDecoder(Decoder):
    format = "debezium"
    #: Debezium follows every delete event with a tombstone (for log compaction): the delete
    #: event already deleted the row.
    default_tombstones: ClassVar[str] = "skip"

    def __init__(
        self, source: SourceConfig | None = None, registry: SchemaRegistryConfig | None = None
    ) -> None:
        super().__init__(source, registry)
        self._json = self.values.name == "json"
        opts = (source.debezium if source is not None else None) or DebeziumConfig()
        self.unwrap = opts.unwrap
        self.added = [
            (name, opts.add_fields_prefix + name.replace(".", "_")) for name in opts.add_fields
        ]
        self.options += (self.unwrap, tuple(self.added))
        self.deletes = self.deletes or self.unwrap
        # A sink may read the events itself (RawShape "debezium": the after row of c, r and u)
        # when nothing but the row and the key's fields makes the record.
        if (
            self._json
            and self.unwrap
            and not self.added
            and not self.kafka_fields
            and self.tombstones in ("skip", "dead_letter")
            and self.key_format in ("none", "json")
        ):
            self.raw_shape = RawShape("debezium", key_fields=self.key_json)

    def decode_value(
        self, value: bytes, headers: Headers, topic: str = ""
    ) -> dict[str, Any] | Row | str:
        schema: RecordSchema | None = None
        if self._json:
            # JSON, with or without the Connect envelope (recognised by its shape); integers
            # of any width exact, as the JSON format reads them.
            obj, reason = loads_exact(value)
            if reason:
                return reason
            try:
                event = unwrap(obj)
            except ConnectError as exc:
                return f"undecodable: {exc}"
            envelope = obj["schema"] if event is not obj else None
        else:
            got = self.values.decode(value, topic)
            if isinstance(got, str):
                return got
            event, schema = got
            envelope = None
        if event.__class__ is not dict or "op" not in event:
            return "undecodable: not a Debezium change event (no op)"
        if not self.unwrap:
            return event if schema is None else Row(event, schema=schema)
        op = event["op"]
        if op.__class__ is not str:
            return f"undecodable: Debezium op {_shown(op)} is not a string"
        source = event.get("source")
        if source.__class__ is not dict:
            source = None
        # The row's schema: the envelope's ``after`` field (``before`` has the same one).
        if envelope is not None:
            try:
                row_schema = record_schema(envelope, "after")
            except ConnectError as exc:
                return f"undecodable: {exc}"
        elif schema is not None:
            row_schema = schema.sub("after")
        else:
            row_schema = None
        if op in _ROW_OPS:
            row = event.get("after")
            if row.__class__ is not dict:
                return f"undecodable: Debezium op {op!r} without an after row"
            return Row(self._with_added(row, event, source), schema=row_schema, source=source)
        if op == "d":
            before = event.get("before")
            if before is not None and before.__class__ is not dict:
                return "undecodable: Debezium delete whose before is not a row"
            return Row(
                self._with_added(before or {}, event, source),
                deleted=True,
                schema=row_schema,
                source=source,
            )
        return f"not a row change: Debezium op {op!r} (truncate and messages are not applied)"

    def _with_added(
        self, row: dict[str, Any], event: dict[str, Any], source: dict[str, Any] | None
    ) -> dict[str, Any]:
        if not self.added:
            return row
        out = dict(row)
        source = source or {}
        for name, field in self.added:
            if name in ("op", "ts_ms"):
                out[field] = event.get(name)
            else:
                out[field] = source.get(name.removeprefix("source."))
        return out
