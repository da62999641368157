"""``read_flat`` (the compiled reader of objects of scalars into Arrow): whenever it answers, its
arrays are exactly what pyarrow's inference makes of the decoded objects -- the files sink's
decoded path, ``pa.array`` of the records' dicts -- field order, types, nulls and every value
(a float's sign and last bit included); it answers for every batch of objects of scalars whose
fields each hold one kind; and it refuses (None) what it must not read: anything orjson would
refuse or read otherwise, nested values, repeated keys, fields of two kinds Arrow does not
unify."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pyarrow as pa
import pytest

from twophase.participants.sdk.rawjson import read_flat

STRINGS = [
    "",
    "a",
    "é☃",
    "😀 日本",
    "2026-01-01T00:00:00Z",
    "line\nbreak",
    'q"uote\\',
    "\u0000\u001f",
]
FLOATS = [0.5, -0.0, 0.0, 1e300, -1e-300, 5e-324, 0.1, 2.0**53, 123456.789e-3]
INTS = [0, -1, 7, 2**53, -(2**53), 10**17, -(10**17), 999_999_999_999_999_999]


def expected(values: list[bytes]) -> tuple[dict[str, pa.Array], list[int]] | None:
    """What the decoded path infers: None when orjson refuses a value or pyarrow the batch."""
    try:
        objs = [orjson.loads(v) for v in values]
    except orjson.JSONDecodeError:
        return None
    if not all(isinstance(o, dict) for o in objs):
        return None
    try:
        batch = pa.RecordBatch.from_struct_array(pa.array(objs))
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        return None
    fields = dict(zip(batch.schema.names, batch.columns, strict=True))
    return fields, [i for i, o in enumerate(objs) if not o]


def exact(a: pa.Array) -> list[str]:
    return [repr(v) for v in a.to_pylist()]  # repr tells -0.0 from 0.0


def agrees(values: list[bytes]) -> bool:
    """Whether ``read_flat`` answered; asserts that an answer is the decoded path's."""
    got = read_flat(values)
    if got is None:
        return False
    want = expected(values)
    assert want is not None, f"read a batch the decoded path refuses: {values!r}"
    fields, empty = got
    want_fields, want_empty = want
    assert list(fields) == list(want_fields), values
    for name, array in fields.items():
        array.validate(full=True)
        assert array.type == want_fields[name].type, (name, values)
        assert exact(array) == exact(want_fields[name]), (name, values)
    assert empty == want_empty
    return True


def scalar(rng: random.Random, kind: str) -> Any:
    if rng.random() < 0.15:
        return None
    if kind == "int":
        return rng.choice(INTS + [rng.randrange(-(10**9), 10**9)])
    if kind == "float":
        return rng.choice(FLOATS + [rng.uniform(-1e6, 1e6)])
    if kind == "number":  # ints a double holds exactly, and floats: a double column
        return rng.choice([rng.randrange(-(2**53), 2**53 + 1), rng.choice(FLOATS)])
    if kind == "bool":
        return rng.random() < 0.5
    return rng.choice(STRINGS)


def spell(rng: random.Random, obj: dict[str, Any]) -> bytes:
    """``obj`` as JSON, sometimes with whitespace, escaped keys or ``\\u`` escapes."""
    if rng.random() < 0.5:
        return orjson.dumps(obj)
    ws = lambda: rng.choice(["", " ", "\t", "\r\n  "])  # noqa: E731
    parts = []
    for key, value in obj.items():
        k = orjson.dumps(key).decode()
        if rng.random() < 0.2 and key:
            k = '"' + "".join(f"\\u{ord(c):04x}" if ord(c) < 0x10000 else c for c in key) + '"'
        v = orjson.dumps(value).decode()
        if isinstance(value, str) and rng.random() < 0.3:
            v = orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode().replace("é", "\\u00e9")
        parts.append(f"{ws()}{k}{ws()}:{ws()}{v}{ws()}")
    return f"{ws()}{{{','.join(parts)}}}{ws()}".encode()


@pytest.mark.parametrize("seed", range(30))
def test_batches_of_one_kind_per_field_are_read_as_the_decoded_path_infers(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(40):
        kinds = {f"f{i}": rng.choice(["int", "float", "number", "bool", "str"]) for i in range(5)}
        kinds["k\u00e9y ☃"] = "str"
        values = []
        for _ in range(rng.randrange(1, 30)):
            names = [n for n in kinds if rng.random() < 0.8]
            rng.shuffle(names)
            values.append(spell(rng, {n: scalar(rng, kinds[n]) for n in names}))
        assert agrees(values), f"refused a batch it should read: {values!r}"


@pytest.mark.parametrize("seed", range(30))
def test_a_random_batch_is_read_exactly_or_refused(seed: int) -> None:
    """Kinds that change between records, nested values, odd spellings: an answer is always
    the decoded path's."""
    rng = random.Random(1000 + seed)
    answered = 0
    for _ in range(60):
        values = []
        for _ in range(rng.randrange(1, 8)):
            obj = {
                rng.choice("abcd"): rng.choice(
                    [scalar(rng, rng.choice(["int", "float", "bool", "str"])), [1], {"x": 1}]
                    if rng.random() < 0.1
                    else [scalar(rng, rng.choice(["int", "float", "number", "bool", "str"]))]
                )
                for _ in range(rng.randrange(0, 4))
            }
            values.append(spell(rng, obj))
        answered += agrees(values)
    assert answered, "never answered"


REFUSED = {
    "nested object": [b'{"a":{"b":1}}'],
    "list": [b'{"a":[1]}'],
    "repeated key": [b'{"a":1,"a":2}'],
    "int then string": [b'{"a":1}', b'{"a":"1"}'],
    "bool then int": [b'{"a":true}', b'{"a":1}'],
    "int past 2**53 then float": [b'{"a":9007199254740993}', b'{"a":0.5}'],
    "float then int past 2**53": [b'{"a":0.5}', b'{"a":-9007199254740993}'],
    "19 digits": [b'{"a":1000000000000000000}'],
    "not an object": [b"[1]"],
    "two objects": [b'{"a":1}{"a":2}'],
    "NaN": [b'{"a":NaN}'],
    "infinite": [b'{"a":1e400}'],
    "invalid UTF-8": [b'{"a":"\xff"}'],
    "lone surrogate": [b'{"a":"\\ud800"}'],
    "control character": [b'{"a":"\x01"}'],
    "trailing comma": [b'{"a":1,}'],
    "leading zero": [b'{"a":01}'],
    "not bytes": ['{"a":1}'],
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_it_cannot_vouch_for_is_refused(name: str) -> None:
    assert read_flat(REFUSED[name]) is None  # type: ignore[arg-type]


def test_ints_and_floats_make_a_double_column_when_every_int_is_exact() -> None:
    assert agrees([b'{"a":9007199254740992}', b'{"a":0.5}', b'{"a":-9007199254740992}'])
    fields, _ = read_flat([b'{"a":1}', b'{"a":2.5}']) or ({}, [])
    assert fields["a"].type == pa.float64()


def test_empty_objects_and_fields_only_null_are_told() -> None:
    values = [b"{}", b'{"a":null}', b" { } ", b'{"b":"x"}']
    assert agrees(values)
    fields, empty = read_flat(values) or ({}, [])
    assert empty == [0, 2]
    assert fields["a"].type == pa.null()
