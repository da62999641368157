"""Type mapping: a record becomes a MongoDB document with a deterministic ``_id``, or a reason.

* ``mode: insert`` -- ``_id`` is the record id ``"topic:partition:offset"``. A value that has its
  own ``_id`` is rejected (it would be silently overwritten); use ``mode: upsert, key: [_id]``.
* ``mode: upsert`` -- ``_id`` is the key: the value of the single key field itself, or for a
  composite key a sub-document ``{k1: v1, k2: v2}`` in the configured key order (type-preserving
  and queryable, unlike a joined string); with ``version_field``, the document carries
  ``{pipeline, txn}`` so an older part never overwrites a newer one. A delete
  (:attr:`Record.deleted`) stages only ``{_id}`` of its key, flagged ``delete``.

Refused here, at write time: field names MongoDB cannot store, nesting past its limit, integers
with no exact BSON form, and documents over the server's size limit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import bson
from bson.raw_bson import RawBSONDocument

from twophase.participants.sdk import PartId, Record
from twophase.participants.sinks.mongodb._store import Doc, Store
from twophase.participants.sinks.mongodb._typed import TypedDocuments

__all__ = ["STAGING_ROOM", "Documents", "Reject", "id_key"]

#: Bytes a staged entry leaves free under MongoDB's document limit for the chunk document
#: that holds it (its ``_id``, ``part``, ``seq``, ``n`` and the array around the entry).
STAGING_ROOM = 16 * 1024

#: MongoDB refuses documents nested deeper than 100 levels; a staged document adds one level.
_MAX_DEPTH = 99
#: Digits of a BSON Decimal128 (IEEE 754 decimal128): an integer with more has no exact form.
_DECIMAL128_DIGITS = 34


class Reject(Exception):
    """One record cannot become a document."""


class Documents:
    """Builds the staged documents of one sink (``write`` and ``check`` both use it)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.cfg = store.cfg
        self.typed = TypedDocuments()

    def staged(
        self, part: PartId, pk: str, record: Record, seq: int, coll: str | None = None
    ) -> RawBSONDocument:
        """The staged document of ``record`` (number ``seq`` of the part with marker ``pk``),
        ready to insert as it is; :class:`Reject` when the record cannot become a document.
        ``coll``: its target collection, with a ``collection`` template."""
        where = {} if coll is None else {"coll": coll}
        value: Any = record.value
        if not isinstance(value, Mapping):
            raise Reject(f"value is a {type(value).__name__}, not a JSON object")
        _check_fields(value, "", 1)
        if record.schema is not None:
            # Typed by the record's schema (``docs/types.md``), the key too.
            try:
                value = self.typed.convert(value, record.schema)
            except (ValueError, ArithmeticError) as exc:
                raise Reject(str(exc)) from None
        key = self.cfg.key or (record.schema.key if record.schema is not None else ())
        body: Doc
        if record.deleted:
            # A delete stages the key only; the commit deletes the document of that _id.
            if self.cfg.mode == "insert":
                raise Reject("a delete needs mode: upsert or update (a key to delete by)")
            try:
                doc_id = self.key_of(value, key)
            except Reject as exc:
                raise Reject(f"a delete needs its key: {exc}") from None
            deleted = {
                "_id": f"{pk}|{record.record_id}",
                "part": pk,
                "seq": seq,
                "delete": True,
                "doc": {"_id": doc_id},
                **where,
            }
            return RawBSONDocument(_encode(deleted))
        if self.cfg.mode == "insert":
            if "_id" in value:
                raise Reject(
                    "value has an _id field; insert mode sets _id to the record id "
                    "(use mode: upsert with key: [_id] to keep it)"
                )
            body = {"_id": record.record_id, **value}
        else:
            doc_id = self.key_of(value, key)
            body = {**value, "_id": doc_id}
            if self.cfg.version_field:
                body[self.cfg.version_field] = {"pipeline": part.pipeline, "txn": part.txn}
        staged = {"_id": f"{pk}|{record.record_id}", "part": pk, "seq": seq, "doc": body, **where}
        raw = _encode(staged)
        # Staged inside a chunk document (_staging.py), whose own fields need some room.
        if len(raw) > self.store.max_bson - STAGING_ROOM:
            raise Reject(
                f"document is {len(raw)} bytes staged; MongoDB's limit is {self.store.max_bson}, "
                f"less {STAGING_ROOM} for the staging chunk around it"
            )
        return RawBSONDocument(raw)

    def key_of(self, value: Mapping[str, Any], key: Sequence[str]) -> Any:
        """The ``_id`` of an upserted document: the key field's value, or ``{k1: v1, ...}``:
        ``key`` is the configured one, or without one the record schema's (``auto_create``)."""
        if not key:
            raise Reject(
                "no key: the sink's key is empty and the record has no schema naming its key "
                "(set key, or read keys with a schema: sources[].key_format)"
            )
        parts: Doc = {}
        for name in key:
            v = value.get(name)
            if v is None:
                raise Reject(f"key field {name!r} is {'null' if name in value else 'missing'}")
            if isinstance(v, list | tuple):
                raise Reject(f"key field {name!r} is an array; arrays cannot be part of _id")
            parts[name] = v
        if len(parts) == 1:
            return next(iter(parts.values()))
        return parts


def _check_fields(value: Mapping[Any, Any] | Sequence[Any], path: str, depth: int) -> None:
    """Reject field names MongoDB refuses or misreads, at any depth."""
    if depth > _MAX_DEPTH:
        raise Reject(f"nested deeper than {_MAX_DEPTH} levels at {path or 'top'}")
    if isinstance(value, Mapping):
        for name, inner in value.items():
            if not isinstance(name, str):
                raise Reject(f"field name {name!r} at {path or 'top'} is not a string")
            where = f"{path}.{name}" if path else name
            if name.startswith("$"):
                raise Reject(f"field name {where!r} starts with '$'")
            if "." in name:
                raise Reject(f"field name {where!r} contains '.'")
            if "\x00" in name:
                raise Reject(f"field name {where!r} contains a NUL character")
            if isinstance(inner, Mapping | list | tuple):
                _check_fields(inner, where, depth + 1)
    else:
        for i, inner in enumerate(value):
            if isinstance(inner, Mapping | list | tuple):
                _check_fields(inner, f"{path}[{i}]", depth + 1)


def _encode(staged: dict[str, Any]) -> bytes:
    """The staged document as BSON; its ``doc`` with integers outside int64 as Decimal128 (as
    for an upsert's document, so for a delete's ``_id`` too: the same key, the same ``_id``)."""
    try:
        try:
            return bson.encode(staged)
        except OverflowError:
            # An integer outside int64 (rare: checked only when BSON says so).
            staged["doc"] = _wide_ints_as_decimal(staged["doc"], "")
            return bson.encode(staged)
    except (bson.InvalidDocument, OverflowError, TypeError, ValueError) as exc:
        raise Reject(f"value cannot be stored as BSON: {exc}") from None


def _wide_ints_as_decimal(value: Any, path: str) -> Any:
    """``value`` with every integer outside int64 as an exact Decimal128 (the documented rule,
    ``docs/types.md``); one with more than 34 digits has no exact BSON form: refused."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        if -(2**63) <= value < 2**63:
            return value
        digits = len(str(abs(value)))
        if digits > _DECIMAL128_DIGITS:
            raise Reject(
                f"field {path or 'value'!r}: integer of {digits} digits has no exact BSON form "
                f"(int64, or Decimal128 up to {_DECIMAL128_DIGITS} digits)"
            )
        return bson.Decimal128(str(value))
    if isinstance(value, Mapping):
        return {
            k: _wide_ints_as_decimal(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_wide_ints_as_decimal(v, f"{path}[{i}]") for i, v in enumerate(value)]
    return value


def id_key(value: Any) -> bytes:
    """Hashable form of an ``_id`` (sub-documents included) for de-duplicating a chunk."""
    return bson.encode({"k": value})
