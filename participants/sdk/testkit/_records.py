"""The kit's records: what both the kit and its crashing child build batches from (the child
imports only this, never the kit)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from twophase.participants.sdk.records import Record

__all__ = ["TOPIC", "change", "ids", "positions_of", "record", "records"]

TOPIC = "kit.orders"
#: 2023-11-14T22:13:20Z: any fixed time works; sinks that partition by date get one date.
_T0_MS = 1_700_000_000_000


def record(offset: int, *, partition: int = 0, topic: str = TOPIC) -> Record:
    """The kit's record at ``offset``; its value carries its own id."""
    rid = f"{topic}:{partition}:{offset}"
    value = {"id": rid, "n": offset, "text": f"row {offset}"}
    return Record(topic, partition, offset, _T0_MS + offset, None, value, size=len(rid) + 24)


def change(offset: int, key: int, *, deleted: bool = False, partition: int = 0) -> Record:
    """A change at ``offset`` of the key of the kit's record at offset ``key`` (its ``id``):
    a write of new fields, or with ``deleted`` a delete carrying only the key."""
    rid = f"{TOPIC}:{partition}:{key}"
    value = {"id": rid} if deleted else {"id": rid, "n": offset, "text": f"row {offset}"}
    r = Record(TOPIC, partition, offset, _T0_MS + offset, None, value, size=len(rid) + 24)
    return r._replace(deleted=True) if deleted else r


def records(start: int, count: int, *, partition: int = 0) -> list[Record]:
    return [record(o, partition=partition) for o in range(start, start + count)]


def positions_of(batch: Iterable[Record]) -> dict[tuple[str, int], int]:
    """Next offset per source partition after ``batch``."""
    out: dict[tuple[str, int], int] = {}
    for r in batch:
        tp = (r.topic, r.partition)
        out[tp] = max(out.get(tp, 0), r.offset + 1)
    return out


def ids(batch: Iterable[Record]) -> Counter[str]:
    return Counter(r.record_id for r in batch)
