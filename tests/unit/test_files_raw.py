"""The files sink's raw path (:mod:`twophase.participants.sinks.files._raw`): the same batches
through the runtime's ``write_batch``, once decoded by the runtime and once read raw by the
sink, must commit byte-identical files and dead-letter the same values for the same reasons."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any, cast

import orjson
import pyarrow.parquet as pq
import pytest
from confluent_kafka import Message

from twophase.observability import Metrics
from twophase.participants.decoding import JsonDecoder
from twophase.participants.runtime.batch import reads_raw, write_batch
from twophase.participants.runtime.deadletter import DeadLetters
from twophase.participants.sdk import (
    PartId,
    RawBatch,
    Rejected,
    Sink,
    SinkConfig,
    SinkContext,
)
from twophase.participants.sinks.files import FileSink
from twophase.participants.sinks.files import _raw as raw_module
from twophase.participants.sinks.files._raw import RawRead

JSON = JsonDecoder()
DAY = 86_400_000
T0 = 1_700_000_000_000


def msg(offset: int, value: Any, *, topic: str = "orders", ts: int | None = None) -> Message:
    if isinstance(value, bytes):
        raw = value
    else:
        try:
            raw = orjson.dumps(value)
        except TypeError:  # an integer past 64 bits
            raw = json.dumps(value).encode()
    return Message(
        topic=topic,
        partition=offset % 2,
        offset=offset,
        key=str(offset).encode(),
        value=raw,
        timestamp=(1, T0 + offset if ts is None else ts),
    )


class _Dlq:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, **kw: Any) -> None:
        self.sent.append(kw)


class _First:
    """A sink before the files sink that reads raw values (as the PostgreSQL sink does):
    ``decodes`` -- it asks ``batch.record`` for every value, so the files sink finds the bad
    ones known; otherwise it asks for none."""

    def __init__(self, decodes: bool) -> None:
        self.name = "first"
        self.config = SinkConfig(name="first", type="test")
        self.decodes = decodes

    def accepts_raw_shape(self, shape: Any) -> bool:
        return True

    def accepts_raw(self) -> bool:
        return True

    def write_raw(self, part: PartId, batch: RawBatch) -> Sequence[Rejected]:
        if self.decodes:
            batch.records()
        return []

    def write(self, part: PartId, records: Sequence[Any]) -> Sequence[Rejected]:
        return []


def files_sink(path: Path, raw: bool, **options: Any) -> FileSink:
    sink = FileSink.from_mapping(
        {"name": "files", "type": "files", "path": str(path), **options},
        SinkContext("p", "w1", "files", logging.getLogger("test.files")),
    )
    assert isinstance(sink, FileSink)
    sink.setup()
    if not raw:
        sink._raw = None  # the runtime then decodes for it
    return sink


def run(
    path: Path,
    batches: list[list[Message]],
    *,
    raw: bool,
    first: str = "",
    **options: Any,
) -> tuple[dict[str, bytes], list[tuple[int, str]], list[bool]]:
    """The committed files (path -> bytes), the dead letters (offset, reason) and, per
    reading of the raw path, whether it read the batch (False: it was decoded)."""
    sink = files_sink(path, raw, **options)
    reads: list[bool] = []
    if sink._raw is not None:
        reader = sink._raw
        plain = reader.read

        def spy(values: Sequence[bytes], stream: Hashable = None) -> RawRead | None:
            got = plain(values, stream)
            reads.append(got is not None)
            return got

        reader.read = spy  # type: ignore[method-assign]
    sinks: list[Any] = [sink] if not first else [_First(first == "decodes"), sink]
    assert reads_raw(cast(list[Sink], sinks), JSON) == raw
    part = PartId("p", 1, "w1")
    sink.begin(part)
    dlq = _Dlq()
    for batch in batches:
        write_batch(
            batch,
            part,
            cast(list[Sink], sinks),
            dlq=cast(DeadLetters, dlq),
            metrics=Metrics("p", "participant"),
            decoder=JSON,
            max_record_bytes=1_000_000,
            retry=lambda fn, what: fn(),
        )
    sink.prepare(part, {("orders", 0): 1})
    sink.commit(part)
    files = {
        str(f.relative_to(path)): f.read_bytes()
        for f in sorted(path.rglob("*.parquet"))
        if "_twophase" not in f.parts
    }
    letters = sorted((s["offset"], s["reason"]) for s in dlq.sent)
    return files, letters, reads


def same_both_ways(tmp_path: Path, batches: list[list[Message]], **options: Any) -> list[bool]:
    raw_files, raw_letters, reads = run(tmp_path / "raw", batches, raw=True, **options)
    files, letters, _ = run(tmp_path / "decoded", batches, raw=False, **options)
    assert files, "nothing was written"
    assert raw_files.keys() == files.keys()
    for name, data in files.items():
        assert raw_files[name] == data, f"{name} differs"
    assert raw_letters == letters
    return reads


AWKWARD: dict[str, list[Any]] = {
    "flat": [{"id": i, "name": f"n{i}", "amount": i * 1.25, "ok": i % 2 == 0} for i in range(20)],
    "nested": [{"id": i, "a": {"b": {"c": i, "d": [i, i + 1]}, "e": None}} for i in range(10)],
    "nulls and missing fields": [
        {"id": 1, "a": None},
        {"id": 2},
        {"id": 3, "b": "x", "a": None},
        {"b": None, "id": 4, "c": {"x": None}},
    ],
    "unicode": [{"id": 1, "s": "héllo ☃ 😀", "k\u00e9y": '\u0000\t"\\'}, {"id": 2, "s": "日本"}],
    "escaped text": [b'{"id":1,"s":"\\u00e9\\n\\ud83d\\ude00","\\u0061":2}', {"id": 2, "a": 3}],
    "timestamps as text": [
        {"id": 1, "ts": "2026-11-21T12:00:00Z", "d": "2026-11-21"},
        {"id": 2, "ts": "2026-11-21 12:00:00", "d": None},
    ],
    "ints then floats": [{"x": 1}, {"x": 2.5}, {"x": -0.0}, {"x": 1e-7}],
    "lists with nulls": [{"l": [None, 1]}, {"l": []}, {"l": None}, {"m": [[None], [2]]}],
    "nested list of nulls only": [{"a": {"c": [None]}}, {"a": {"c": None}}],
    "empty nested object": [{"id": 1, "o": {}}, {"id": 2, "o": {}}],
    "field order changes": [{"b": 1, "a": {"y": 1}}, {"a": {"x": 2, "y": 3}, "c": True}],
    "objects in lists": [{"l": [{"x": 1}, {"y": "z"}]}, {"l": [{"x": None}]}],
    "int64 edges": [{"x": 2**63 - 1}, {"x": -(2**63)}, {"x": 0}],
    "whitespace": [b'{ "id" : 1 , "a" : [ 1 , 2 ] }  ', b'{"id":2,"a":[3]}\r'],
}
#: Batches the raw path must give to the decoded one (Arrow would not read them as the
#: decoded path does): the files must still be the same.
DECODED: dict[str, list[Any]] = {
    "big ints": [{"x": 2**64 + 1}, {"x": 1}],
    "uint64": [{"x": 2**63}],
    "int past 2**53 with a float": [{"x": 2**53 + 1}, {"x": 0.5}],
    "type changes between records": [{"x": 1}, {"x": "1"}, {"x": {"y": 1}}],
    "nested type change": [{"a": {"x": 1}}, {"a": {"x": "s"}}],
    "mixed list": [{"l": [1, "a"]}],
    "duplicate keys": [b'{"a":1,"a":2}', {"a": 3}],
    # Arrow reads a list of nulls only into an array it then cannot write.
    "list of nulls only": [{"l": [None, None]}, {"l": [None]}],
}


@pytest.mark.parametrize("name", list(AWKWARD))
@pytest.mark.parametrize("source_columns", [False, True])
def test_raw_path_writes_the_files_the_decoded_path_writes(
    tmp_path: Path, name: str, source_columns: bool
) -> None:
    values = AWKWARD[name]
    batches = [[msg(i, v) for i, v in enumerate(values)]]
    reads = same_both_ways(tmp_path, batches, source_columns=source_columns)
    assert reads and all(reads), "the raw path gave a batch it should read to the decoded path"


@pytest.mark.parametrize("name", list(DECODED))
def test_batches_arrow_cannot_read_alike_are_decoded_with_the_same_files(
    tmp_path: Path, name: str
) -> None:
    batches = [[msg(i, v) for i, v in enumerate(DECODED[name])]]
    reads = same_both_ways(tmp_path, batches)
    assert reads == [False]


def test_each_output_file_is_typed_by_its_own_records(tmp_path: Path) -> None:
    """Records of two days (two files) and two topics in one batch: each file's types come from
    its records alone, as the decoded path infers per file; a batch of one day at a time reads
    the remembered timestamp fields as strings in one pass."""
    batches = [
        [msg(0, {"x": 1, "ts": "2026-01-01T00:00:00"}, ts=T0)]
        + [msg(1, {"x": 1.5, "ts": None}, ts=T0 + DAY)]
        + [msg(2, {"y": "a"}, topic="refunds", ts=T0)],
        [msg(3 + i, {"x": i, "ts": "2026-01-01T00:00:00"}) for i in range(5)],
        [msg(8 + i, {"ts": "2026-01-02T00:00:00", "x": i}) for i in range(5)],  # order changes
    ]
    for options in ({}, {"partition_by": "topic"}, {"partition_by": "none"}):
        sub = tmp_path / str(options.get("partition_by", "date"))
        reads = same_both_ways(sub, batches, **options)
        assert all(reads)


def test_bad_values_are_dead_lettered_and_reach_no_file(tmp_path: Path) -> None:
    """Values that are no record (not JSON, not an object, NaN, invalid UTF-8, a lone
    surrogate, nested past what orjson reads) and records the sink refuses (an empty object,
    nesting past its limit) are dead-lettered with the same reasons either way, and the good
    ones around them are written."""
    deep = b'{"a":' + b"[" * 300 + b"]" * 300 + b"}"
    too_deep = b'{"a":' + b"[" * 1100 + b"]" * 1100 + b"}"
    bad = [
        b"{not json",
        b"[1, 2]",
        b'{"a": NaN}',
        b'{"a": "\xff"}',
        b'{"a": "\\ud800"}',
        b'{"a":1} {"a":2}',
        b"{}",
        b"{ }",
        deep,
        too_deep,
    ]
    good = [{"id": i, "s": "x"} for i in range(6)]
    values: list[Any] = [v for pair in zip(good, bad, strict=False) for v in pair]
    values += bad[len(good) :]
    batches = [[msg(i, v) for i, v in enumerate(values)]]
    for first in ("", "decodes", "reads"):
        raw_files, raw_letters, _ = run(tmp_path / f"raw{first}", batches, raw=True, first=first)
        files, letters, _ = run(tmp_path / f"dec{first}", batches, raw=False, first=first)
        assert raw_files == {k.replace(f"dec{first}", f"raw{first}"): v for k, v in files.items()}
        assert raw_letters == letters
        assert [o for o, _ in letters] == [i for i, v in enumerate(values) if v in bad]
        reasons = dict(letters)
        assert "empty object" in reasons[values.index(b"{}")]
        assert "nested deeper" in reasons[values.index(deep)]
        assert reasons[values.index(b"{not json")].startswith("undecodable")
    # Only the good records are in the files.
    rows = [
        r
        for f in sorted((tmp_path / "raw").rglob("*.parquet"))
        for r in pq.read_table(f).to_pylist()
    ]
    assert sorted(r["id"] for r in rows) == list(range(6))


def test_good_batches_after_bad_ones_are_read_raw(tmp_path: Path) -> None:
    """A bad value sends its own batch down the decoded path, not the ones after it."""
    batches = [
        [msg(0, {"id": 0}), msg(1, b"{nope")],
        [msg(2 + i, {"id": i, "t": "2026-01-01T00:00:00"}) for i in range(4)],
        [msg(6 + i, {"id": i, "t": "2026-01-01T00:00:00"}) for i in range(4)],
    ]
    reads = same_both_ways(tmp_path, batches)
    assert reads == [False, True, True]


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(11 if depth < 3 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.randrange(-(10**6), 10**6)
    if kind == 3:
        return rng.choice([0.5, -1.25, 1e300, 3.0])
    if kind == 4:
        return rng.choice(["", "a", "é☃", "2026-01-01", "2026-01-01T00:00:00Z", "\n\t"])
    if kind == 5:
        return rng.choice([2**53 + 1, 2**63 - 1, -(2**63)])
    if kind == 6:
        return rng.choice(["x", 1])
    if kind in (7, 8):
        return {rng.choice("abc"): _random_value(rng, depth + 1) for _ in range(rng.randrange(3))}
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(3))]


@pytest.mark.parametrize("seed", range(40))
def test_random_batches_write_the_same_files(tmp_path: Path, seed: int) -> None:
    """Random records over a few fields (types that agree, change, nest, hold nulls): whatever
    the raw path reads itself and whatever it leaves to the decoded one, the files are equal."""
    rng = random.Random(seed)
    fields = ["id", "a", "b", "c"]
    batches = []
    offset = 0
    for _ in range(3):
        batch = []
        for _ in range(rng.randrange(1, 8)):
            value = {f: _random_value(rng) for f in fields if rng.random() < 0.7}
            if not value:
                value = {"id": offset}
            batch.append(msg(offset, value, ts=T0 + rng.choice([0, DAY])))
            offset += 1
        batches.append(batch)
    same_both_ways(tmp_path, batches, source_columns=seed % 2 == 0)


@pytest.mark.parametrize("seed", range(6))
def test_runs_of_nested_and_flat_batches_write_the_same_files(tmp_path: Path, seed: int) -> None:
    """The compiled reading of flat batches steps aside for a while after it refuses a batch
    (nested values), longer while it keeps refusing, and comes back: over long random runs of
    flat and nested batches, each batch is written exactly as the decoded path writes it."""
    rng = random.Random(seed)
    batches, offset = [], 0
    nested = False
    for _ in range(40):
        if rng.random() < 0.3:
            nested = not nested  # runs of either kind, of random length
        batch = []
        for _ in range(rng.randrange(1, 6)):
            value: dict[str, Any] = {"id": offset, "n": f"r{offset}", "x": rng.random()}
            if nested and rng.random() < 0.5:
                value["tags"] = {"k": [offset, None]}
            batch.append(msg(offset, value))
            offset += 1
        batches.append(batch)
    reads = same_both_ways(tmp_path, batches)
    assert all(reads)


def test_the_compiled_reading_steps_aside_per_stream_and_comes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Refusals in a row of one stream skip the compiled reading for 1, 2, 4 ... of its next
    readings; another stream is tried as usual; a reading it takes resets the stream."""
    tried: list[str] = []
    real = raw_module.read_flat

    def counting(values: Sequence[bytes]) -> Any:
        tried.append(values[0].decode())
        return real(values)

    monkeypatch.setattr(raw_module, "read_flat", counting)
    reader = raw_module.RawReader(False)
    nested = [b'{"id":1,"tags":{"a":1}}']
    for _ in range(12):
        assert reader.read(nested, "a") is not None  # Arrow's reader takes it either way
    assert len(tried) == 5  # readings 1, 2, 4, 7 and 12: skipped 0, 1, 2, 4 between them
    assert reader.read([b'{"id":2}'], "b") is not None
    assert len(tried) == 6  # stream b is not held back by stream a
    for _ in range(9):
        assert reader.read([b'{"id":3}'], "a") is not None  # 8 skipped, then read compiled
    assert len(tried) == 7
    reader.read(nested, "a")
    reader.read(nested, "a")
    assert len(tried) == 9  # after a reading it took, the next refusal skips none


def test_only_inferred_parquet_reads_raw(tmp_path: Path) -> None:
    """A configured schema, JSON Lines or an op_column: the sink takes decoded records."""
    assert files_sink(tmp_path / "a", True).accepts_raw()
    assert not files_sink(tmp_path / "b", True, schema={"id": "int64"}).accepts_raw()
    assert not files_sink(tmp_path / "c", True, format="jsonl").accepts_raw()
    sink = files_sink(tmp_path / "d", True, source_columns=True, op_column="op")
    assert not sink.accepts_raw()
