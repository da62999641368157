"""The compiled encoder on Debezium change events (the PostgreSQL sink's raw change-event path)
against the Python path: an event it takes must be one the Debezium decoder turns into a row
(never a dead letter) whose fields -- the record key's overlaid -- the plain encoder writes
byte for byte the same, or, with ``delete_in``, into a delete whose key is the one the row
holds; and it must take the ordinary events, or the path is never used. Pure: no database,
the wire format is compared as bytes.
"""

from __future__ import annotations

import random
import struct
from typing import Any

import orjson
import pytest
import twophase_native
from confluent_kafka import Message

from twophase.config import SourceConfig
from twophase.participants.decoding import DebeziumDecoder
from twophase.participants.sdk import RawShape, Record

HEADER = 19  # signature, flags, header extension length
COLUMNS = [("id", "int8", None), ("name", "text", None), ("amount", "numeric", None)]


def rows(payload: bytes) -> list[bytes]:
    """Each row of a binary COPY stream, as its bytes (field count included)."""
    if not payload:
        return []
    out = []
    i = HEADER
    while True:
        start = i
        (ncols,) = struct.unpack_from(">h", payload, i)
        i += 2
        if ncols == -1:
            return out
        for _ in range(ncols):
            (length,) = struct.unpack_from(">i", payload, i)
            i += 4 + max(length, 0)
        out.append(payload[start:i])


def without_seq(row: bytes) -> tuple[int, bool, bytes]:
    """(the row's index column, its delete flag, the row as the plain encoder writes it)."""
    (ncols,) = struct.unpack_from(">h", row, 0)
    (seq,) = struct.unpack_from(">q", row, 6)
    assert row[14:18] == b"\x00\x00\x00\x01" and row[18] in (0, 1)
    return seq, row[18] == 1, struct.pack(">h", ncols - 2) + row[19:]


NULL = b"\xff\xff\xff\xff"


#: The kinds of event() the encoder must take (the rest it may hand back), by whether the
#: record key's fields count.
TAKEN = {False: {6, 7, 8, 9, 10, 17, 18}, True: {9, 10, 17, 18}}


def event(rng: random.Random, key: int) -> tuple[bytes, bytes | None, int]:
    """A change event, its record key and its kind: mostly ordinary (kinds past 18), often
    one of the shapes that must take the Python path."""
    after: Any = {"id": key, "name": f"n-{key}", "amount": rng.choice([1, 2.5, -3, 12.25])}
    op: Any = rng.choice(["c", "r", "u"])
    ev: dict[str, Any] = {"before": None, "after": after, "op": op, "source": {"table": "t"}}
    k: Any = {"id": key}
    odd = rng.randrange(40)
    raw: bytes | None = None
    if odd == 0:
        ev["op"], ev["before"], ev["after"] = "d", {"id": key}, None
    elif odd == 1:
        ev["op"] = rng.choice(["t", "m", "x", 1, None, "C"])
    elif odd == 2:
        del ev["op"]
    elif odd == 3:
        ev["after"] = rng.choice([None, [1], "row", 5])
    elif odd == 4:
        del after[rng.choice(["id", "name", "amount"])]
    elif odd == 5:
        after[rng.choice(["name", "amount"])] = None
    elif odd == 6:
        k = {"id": key + 1}  # the key's value wins in the Python path
    elif odd == 7:
        k = {"schema": {"type": "struct"}, "payload": {"id": key + 1}}
    elif odd == 8:
        k = rng.choice([key, None, [key], "k", {"id": None}, {"id": str(key)}])
    elif odd == 9:
        k = {"id": key, "other": 1}  # a member that feeds no column
    elif odd == 10:
        after["name"] = 'tab\there \u00e9 \\ "quoted"'
    elif odd == 11:
        after["id"] = 2**63 + key  # wider than the encoder reads
    elif odd == 12:
        raw = orjson.dumps(ev)[:-1] + b',"after":{"id":1,"name":"x","amount":1}}'  # twice
    elif odd == 13:
        raw = orjson.dumps(ev)[:-1] + b',"op":"c"}'  # op twice
    elif odd == 14:
        raw = orjson.dumps(ev).replace(b'"after"', b'"af\\u0074er"', 1)  # an escaped name
    elif odd == 15:
        raw = orjson.dumps(ev) + b" x"
    elif odd == 16:
        raw = orjson.dumps({"schema": None, "payload": ev})  # the Connect envelope
    elif odd == 17:
        after["extra"] = {"nested": [1, {"deep": True}]}
    elif odd == 18:
        raw = orjson.dumps(ev).replace(b'"id":', b'"id":  ', 1)
    key_bytes = None if k is None else orjson.dumps(k)
    return (orjson.dumps(ev) if raw is None else raw), key_bytes, odd


#: The kinds of delete() the encoder must take, by whether the record key's fields count.
DELETES_TAKEN = {False: {100, 101, 102, 106, 110}, True: {100, 101, 102, 110}}


def delete(rng: random.Random, key: int) -> tuple[bytes, bytes | None, int]:
    """A delete event, its record key and its kind (100 and up): ordinary, or one of the
    shapes a delete comes in that the Python path must judge."""
    before: Any = {"id": key}
    ev: dict[str, Any] = {"before": before, "after": None, "op": "d", "source": {"table": "t"}}
    k: Any = {"id": key}
    kind = 100 + rng.randrange(14)
    raw: bytes | None = None
    if kind == 101:
        before.update(name=rng.choice([None, "x", 5, [1], {"a": 1}]), amount="not a number")
    elif kind == 102:
        ev = {"op": "d", "source": {}, "before": before, "after": None}  # op before the row
    elif kind == 103:
        ev["before"] = rng.choice([None, 5, "row", [key]])
    elif kind == 104:
        del before["id"]  # the key only in the record key (when it counts)
    elif kind == 105:
        before["id"] = rng.choice([None, "7", 2**63 + key, 1.5, [key]])
    elif kind == 106:
        k = {"id": key + 1}  # the key's value wins in the Python path
    elif kind == 107:
        ev["after"] = {"id": key, "name": "x", "amount": 1}  # a delete with a row after it
    elif kind == 108:
        raw = orjson.dumps(ev)[:-1] + b',"before":{"id":1}}'  # twice
    elif kind == 109:
        raw = orjson.dumps(ev).replace(b'"before"', b'"bef\\u006fre"', 1)  # an escaped name
    elif kind == 110:
        raw = orjson.dumps(ev).replace(b'"before":', b'"before" :  ', 1)
    elif kind == 111:
        del ev["before"]
    elif kind == 112:
        raw = orjson.dumps({"schema": None, "payload": ev})  # the Connect envelope
    elif kind == 113:
        before["id"] = {"nested": key}
    key_bytes = None if k is None else orjson.dumps(k)
    return (orjson.dumps(ev) if raw is None else raw), key_bytes, kind


@pytest.mark.parametrize("deletes", [False, True], ids=["rows", "rows-and-deletes"])
@pytest.mark.parametrize("keyed", [False, True], ids=["value-only", "key-fields"])
def test_the_encoder_takes_an_event_only_as_the_decoder_reads_it(
    keyed: bool, deletes: bool
) -> None:
    rng = random.Random(20261126 + keyed + 2 * deletes)
    source = SourceConfig(
        topic="pg.public.t", format="debezium", key_format="json" if keyed else "none"
    )
    decoder = DebeziumDecoder(source)
    assert decoder.raw_shape == RawShape("debezium", key_fields=keyed)
    events = [
        delete(rng, i) if deletes and rng.random() < 0.3 else event(rng, i) for i in range(6_000)
    ]
    values = [v for v, _, _ in events]
    keys = [k for _, k, _ in events]
    options: dict[str, Any] = {"row_in": "after", "ops": ["c", "r", "u"], "seq": True}
    if deletes:
        options.update(delete_in="before", key_columns=[True, False, False])
    compiled = twophase_native.CopyEncoder(COLUMNS, **options)
    plain = twophase_native.CopyEncoder(COLUMNS)
    payload, unsure = compiled.encode(values, keys if keyed else None)
    taken = [i for i in range(len(values)) if i not in set(unsure)]
    encoded = rows(payload)
    assert len(encoded) == len(taken)
    # The ordinary events are all taken: the fast path is the common one.
    must = [
        i
        for i, (_, _, kind) in enumerate(events)
        if (18 < kind < 100 or kind in TAKEN[keyed]) or (deletes and kind in DELETES_TAKEN[keyed])
    ]
    assert set(must) <= set(taken), [values[i] for i in sorted(set(must) - set(taken))][:3]
    assert not deletes or sum(events[i][2] >= 100 for i in taken) > 300
    for i, row in zip(taken, encoded, strict=True):
        seq, deleted, bare = without_seq(row)
        assert seq == i
        m = Message(topic="pg.public.t", partition=0, offset=i, key=keys[i], value=values[i])
        rec = decoder.record(m, "pg.public.t", 0, i, values[i])
        assert isinstance(rec, Record), (values[i], keys[i], rec)
        assert rec.deleted == deleted, (values[i], keys[i])
        if deleted:
            # The delete of the key the decoded record names, NULL in every other column.
            want, left = plain.encode([orjson.dumps({**rec.value, "name": "", "amount": 0})])
            assert not left, (values[i], keys[i], rec.value)
            (want_row,) = rows(want)
            key_field = want_row[2 : 2 + 4 + 8]  # the int8 id: length and value
            assert bare == want_row[:2] + key_field + NULL + NULL, (values[i], keys[i])
        else:
            want, left = plain.encode([orjson.dumps(rec.value)])
            assert not left and rows(want) == [bare], (values[i], keys[i])
    # What it hands back includes every delete it does not take and every event the decoder
    # refuses.
    for i in unsure:
        m = Message(topic="pg.public.t", partition=0, offset=i, key=keys[i], value=values[i])
        rec = decoder.record(m, "pg.public.t", 0, i, values[i])
        assert isinstance(rec, str) or rec.deleted or rec.value is not None


def test_an_encoder_for_events_needs_both_the_row_member_and_the_ops() -> None:
    with pytest.raises(ValueError, match="go together"):
        twophase_native.CopyEncoder(COLUMNS, row_in="after")
    with pytest.raises(ValueError, match="go together"):
        twophase_native.CopyEncoder(COLUMNS, row_in="after", ops=[])
    with pytest.raises(ValueError, match="delete_in needs key_columns"):
        twophase_native.CopyEncoder(COLUMNS, row_in="after", ops=["c"], seq=True, delete_in="b")
    with pytest.raises(ValueError, match="delete_in needs key_columns"):
        twophase_native.CopyEncoder(
            COLUMNS, row_in="after", ops=["c"], seq=True, delete_in="b", key_columns=[True]
        )
    with pytest.raises(ValueError, match="delete_in needs seq"):
        twophase_native.CopyEncoder(
            COLUMNS, row_in="after", ops=["c"], delete_in="b", key_columns=[True, False, False]
        )
    with pytest.raises(ValueError, match="go together"):
        twophase_native.CopyEncoder(COLUMNS, delete_in="b", key_columns=[True, False, False])
    with pytest.raises(ValueError, match="one key per value"):
        twophase_native.CopyEncoder(COLUMNS, row_in="after", ops=["c"]).encode([b"{}"], [])
