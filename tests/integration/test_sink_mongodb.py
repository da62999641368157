"""MongoSink against the real MongoDB-protocol server of the local stack (SecantusDB).

Every test works in its own database and drops it at the end.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import bson
import pytest
from pydantic import ValidationError
from pymongo import MongoClient
from pymongo.collection import Collection
from pymongo.database import Database
from pymongo.errors import AutoReconnect

from twophase.participants.sdk import (
    AbortTransactionError,
    BackpressureError,
    FatalSinkError,
    PartId,
    Record,
    RetriableSinkError,
    SinkContext,
    UnknownPartError,
)
from twophase.participants.sinks.mongodb import MongoSink, MongoSinkConfig

pytestmark = pytest.mark.stack

REPO = Path(__file__).resolve().parents[2]
TOPIC = "orders"
Doc = dict[str, Any]
MakeSink = Callable[..., MongoSink]


def _db_name(unique_name: Any) -> str:
    raw = unique_name("mongo") if callable(unique_name) else f"{unique_name}_mongo"
    clean = re.sub(r"[^A-Za-z0-9_]", "_", str(raw))
    if len(clean) > 40:  # MongoDB database names stop at 63 bytes
        clean = clean[:30] + hashlib.sha1(clean.encode()).hexdigest()[:10]
    return clean


@pytest.fixture
def db(mongo_uri: str, unique_name: Any) -> Iterator[Database[Doc]]:
    name = _db_name(unique_name)
    client: MongoClient[Doc] = MongoClient(mongo_uri)
    try:
        yield client[name]
    finally:
        client.drop_database(name)
        client.close()


@pytest.fixture
def make_sink(mongo_uri: str, db: Database[Doc]) -> Iterator[MakeSink]:
    """Builds and sets up sinks; each one is a separate MongoClient, like a separate process."""
    made: list[MongoSink] = []

    def make(
        *, pipeline: str = "p1", participant: str = "w1", sink_name: str = "mongo", **cfg: Any
    ) -> MongoSink:
        raw: Doc = {
            "name": sink_name,
            "type": "mongodb",
            "uri": mongo_uri,
            "database": db.name,
            "collection": "target",
            **cfg,
        }
        ctx = SinkContext(pipeline, participant, sink_name, logging.getLogger(f"test.{sink_name}"))
        sink = MongoSink.from_mapping(raw, ctx)
        assert isinstance(sink, MongoSink)
        sink.setup()
        made.append(sink)
        return sink

    yield make
    for sink in made:
        sink.close()


def staged_entries(staging: Collection[Doc], query: Doc | None = None) -> int:
    """Records staged in ``staging``: the entries of its chunk documents."""
    return sum(int(d["n"]) for d in staging.find(query or {}, {"n": 1}))


def rec(offset: int, value: Any, *, partition: int = 0, topic: str = TOPIC) -> Record:
    return Record(topic, partition, offset, 1_700_000_000_000 + offset, None, value)


def run_part(
    sink: MongoSink, part: PartId, records: list[Record], *, commit: bool = True
) -> list[Any]:
    sink.begin(part)
    rejected = list(sink.write(part, records))
    positions: dict[tuple[str, int], int] = {}
    for r in records:
        tp = (r.topic, r.partition)
        positions[tp] = max(positions.get(tp, 0), r.offset + 1)
    sink.prepare(part, positions)
    if commit:
        sink.commit(part)
    return rejected


def ids(coll: Any, query: Doc | None = None) -> list[Any]:
    return sorted(d["_id"] for d in coll.find(query or {}, {"_id": 1}))


# -- insert mode --------------------------------------------------------------------------------


def test_insert_mode_end_to_end(make_sink: MakeSink, db: Database[Doc]) -> None:
    sink = make_sink()
    part = PartId("p1", 1, "w1")
    records = [rec(i, {"n": i, "nested": {"a": [1, {"b": i}]}}) for i in range(10)]
    records += [rec(i, {"n": 100 + i}, partition=3) for i in range(5)]
    run_part(sink, part, records, commit=False)

    # Prepared: durable in staging, invisible in the target.
    assert db.target.count_documents({}) == 0
    assert staged_entries(db["target__twophase_staging"]) == 15
    marker = db.twophase_parts.find_one({"_id": "mongo:" + part.token})
    assert marker is not None
    assert (marker["state"], marker["records"], marker["txn"]) == ("prepared", 15, 1)

    sink.commit(part)
    assert ids(db.target) == sorted(r.record_id for r in records)
    assert db.target.find_one({"_id": f"{TOPIC}:0:7"}) == {
        "_id": f"{TOPIC}:0:7",
        "n": 7,
        "nested": {"a": [1, {"b": 7}]},
    }
    assert db["target__twophase_staging"].count_documents({}) == 0
    marker = db.twophase_parts.find_one({"_id": "mongo:" + part.token})
    assert marker is not None and marker["state"] == "committed"
    assert sink.committed_positions() == {(TOPIC, 0): 10, (TOPIC, 3): 5}
    assert sink.in_doubt() == []


@pytest.mark.parametrize(
    "options",
    [
        "readPreference=secondary",
        "readPreference=secondaryPreferred&readPreferenceTags=dc:east&maxStalenessSeconds=120",
        "w=0",
    ],
)
def test_the_uris_read_and_write_options_change_nothing_the_sink_does(
    make_sink: MakeSink, db: Database[Doc], mongo_uri: str, options: str
) -> None:
    """Where reads go and how writes are acknowledged are the application's choices in its URI;
    the sink's own reads -- its markers, staged parts, positions -- go to the primary, and its
    writes and transactions (the probe of a target that can refuse a document too) keep their
    own concerns, whatever the URI says: a secondary can be behind a write the sink has just had
    acknowledged, and positions read behind it would have records applied twice; a transaction
    refuses ``w: 0`` (mongod also refuses the read concerns "available" and "linearizable" in
    one; this test server takes them). On this one-member replica set a read sent to a
    secondary finds no server at all."""
    uri = mongo_uri + ("&" if "?" in mongo_uri else "?") + options
    db.target.create_index("u", unique=True)  # each write probes the target in a transaction
    db.target.insert_one({"_id": "other", "u": 2})
    sink = make_sink(uri=uri, server_selection_timeout_s=2)
    records = [rec(i, {"u": i}) for i in range(5)]
    rejected = run_part(sink, PartId("p1", 1, "w1"), records, commit=False)
    assert [r.record.offset for r in rejected] == [2]  # u=2 is taken
    restarted = make_sink(uri=uri, server_selection_timeout_s=2)
    assert restarted.in_doubt() == [PartId("p1", 1, "w1")]
    restarted.commit(PartId("p1", 1, "w1"))
    assert ids(db.target) == sorted(["other", *(r.record_id for r in records if r.offset != 2)])
    assert restarted.committed_positions() == {(TOPIC, 0): 5}


def test_staging_packs_records_into_chunk_documents_the_commit_applies_whole(
    make_sink: MakeSink, db: Database[Doc]
) -> None:
    """A write's records are staged as chunk documents of at most ``commit_chunk_size``
    entries (one server write per chunk, not per record), and a commit transaction applies
    whole chunk documents: with 2 writes of 25 and chunks of 10 -- 3 + 3 staged documents, the
    part committed in 6 transactions, every record once."""
    sink = make_sink(commit_chunk_size=10)
    part = PartId("p1", 1, "w1")
    sink.begin(part)
    first = [rec(i, {"n": i}) for i in range(25)]
    second = [rec(i, {"n": i}) for i in range(25, 50)]
    assert not sink.write(part, first) and not sink.write(part, second)
    sink.prepare(part, {(TOPIC, 0): 50})
    staging = db["target__twophase_staging"]
    assert [d["n"] for d in staging.find({}, {"n": 1}).sort("seq", 1)] == [10, 10, 5, 10, 10, 5]
    steps = 1
    while not sink._commits.step(part):
        steps += 1
    assert steps == 6
    assert ids(db.target) == sorted(r.record_id for r in first + second)
    assert staging.count_documents({}) == 0


def test_a_part_staged_one_document_per_record_still_commits(
    make_sink: MakeSink, db: Database[Doc]
) -> None:
    """Parts prepared by a version before chunk documents (one staged document per record, as
    an upgrade finds them in doubt) commit and abort the same: each is a chunk of one."""
    staging = db["target__twophase_staging"]
    parts = [PartId("p1", txn, "w1") for txn in (1, 2)]
    for n, part in enumerate(parts):
        run_part(make_sink(), part, [rec(100 * n + i, {"n": i}) for i in range(7)], commit=False)
    for chunk in list(staging.find({})):  # back to the old layout
        staging.insert_many(chunk["entries"])
        staging.delete_one({"_id": chunk["_id"]})
    assert staging.count_documents({}) == 14
    sink = make_sink()
    sink.commit(parts[0])
    sink.abort(parts[1])
    assert ids(db.target) == sorted(f"{TOPIC}:0:{i}" for i in range(7))
    assert staging.count_documents({}) == 0


def test_insert_mode_commit_meeting_its_documents_in_the_target_replaces_them(
    make_sink: MakeSink, db: Database[Doc]
) -> None:
    """Insert mode applies with ``insert_many``; a document already in the target (a part
    applied again after its positions were reset, another pipeline's) ends that transaction,
    and the commit applies the chunk again by ``_id``, in the same call: each document once,
    the part's version."""
    part = PartId("p1", 1, "w1")
    records = [rec(i, {"n": i}) for i in range(30)]
    run_part(make_sink(commit_chunk_size=10), part, records, commit=False)
    db.target.insert_one({"_id": f"{TOPIC}:0:15", "n": -1, "stale": True})
    make_sink(commit_chunk_size=10).commit(part)
    assert ids(db.target) == sorted(r.record_id for r in records)
    assert db.target.find_one({"_id": f"{TOPIC}:0:15"}) == {"_id": f"{TOPIC}:0:15", "n": 15}
    marker = db.twophase_parts.find_one({"_id": "mongo:" + part.token})
    assert marker is not None and (marker["state"], marker["applied"]) == ("committed", 30)


def test_a_record_too_large_to_stage_is_rejected_and_the_rest_commit(
    make_sink: MakeSink, db: Database[Doc]
) -> None:
    """A document that would fit MongoDB's 16 MiB limit alone but not inside its staging chunk
    is rejected at write (to the dead-letter topic), never a chunk the server refuses."""
    sink = make_sink()
    big = rec(1, {"blob": "x" * (16 * 1024 * 1024 - 4096)})
    rejected = run_part(sink, PartId("p1", 1, "w1"), [rec(0, {"n": 0}), big, rec(2, {"n": 2})])
    assert [(r.record.offset, "for the staging chunk" in r.reason) for r in rejected] == [(1, True)]
    assert ids(db.target) == [f"{TOPIC}:0:0", f"{TOPIC}:0:2"]


def test_new_instance_finds_and_commits_prepared_part(
    make_sink: MakeSink, db: Database[Doc]
) -> None:
    first = make_sink(participant="w1")
    part = PartId("p1", 7, "w1")
    run_part(first, part, [rec(i, {"v": i}) for i in range(20)], commit=False)
    first.close()  # the process "dies" after its PREPARED vote

    other = make_sink(participant="w2")  # another participant, new connections
    assert other.in_doubt() == [part]
    assert db.target.count_documents({}) == 0
    other.commit(part)
    assert db.target.count_documents({}) == 20
    assert other.in_doubt() == []
    other.commit(part)  # a repeated decision is a no-op
    assert db.target.count_documents({}) == 20


def test_abort_leaves_nothing_and_is_idempotent(make_sink: MakeSink, db: Database[Doc]) -> None:
    sink = make_sink()
    prepared = PartId("p1", 1, "w1")
    run_part(sink, prepared, [rec(i, {"v": i}) for i in range(12)], commit=False)
    sink.abort(prepared)
    sink.abort(prepared)

    still_open = PartId("p1", 2, "w1")
    sink.begin(still_open)
    sink.write(still_open, [rec(100 + i, {"v": i}) for i in range(5)])
    sink.abort(still_open)

    assert db.target.count_documents({}) == 0
    assert db["target__twophase_staging"].count_documents({}) == 0
    assert sink.in_doubt() == []
    with pytest.raises(UnknownPartError):
        sink.commit(prepared)
    # The slot is free again for the next part after an abort of the open one.
    run_part(sink, PartId("p1", 3, "w1"), [rec(200, {"v": 1})])
    assert ids(db.target) == [f"{TOPIC}:0:200"]


def test_commit_twice_unknown_part_and_abort_after_commit(make_sink: MakeSink) -> None:
    sink = make_sink()
    part = PartId("p1", 1, "w1")
    run_part(sink, part, [rec(0, {"v": 0})])
    sink.commit(part)
    with pytest.raises(FatalSinkError, match="already committed"):
        sink.abort(part)
    with pytest.raises(UnknownPartError):
        sink.commit(PartId("p1", 99, "w1"))


def test_rewind_reopens_an_aborted_open_part(make_sink: MakeSink, db: Database[Doc]) -> None:
    sink = make_sink()
    part = PartId("p1", 5, "w1")
    sink.begin(part)
    sink.write(part, [rec(i, {"v": "first try"}) for i in range(5)])
    sink.abort(part)  # T-1 aborted: rewind, then the same transaction number opens again
    sink.begin(part)
    sink.write(part, [rec(i, {"v": "second try"}) for i in range(3)])
    sink.prepare(part, {(TOPIC, 0): 3})
    sink.commit(part)
    assert sorted((d["_id"], d["v"]) for d in db.target.find()) == [
        (f"{TOPIC}:0:{i}", "second try") for i in range(3)
    ]
    with pytest.raises(FatalSinkError):
        sink.begin(part)  # committed parts never reopen


def test_abort_unknown_part_is_noop_and_aborted_writer_cannot_prepare(
    make_sink: MakeSink, db: Database[Doc]
) -> None:
    recovering = make_sink(participant="w2")
    zombie = make_sink(participant="w1")
    recovering.abort(PartId("p1", 5, "w1"))
    recovering.abort(PartId("p1", 5, "w1"))
    assert db.twophase_parts.count_documents({}) == 0

    late = PartId("p1", 6, "w1")
    zombie.begin(late)
    zombie.write(late, [rec(0, {"v": 0})])
    recovering.abort(late)  # presumed abort while the old owner still writes
    with pytest.raises(AbortTransactionError):
        zombie.prepare(late, {(TOPIC, 0): 1})
    assert recovering.in_doubt() == []
    assert db["target__twophase_staging"].count_documents({}) == 0


# -- upsert mode --------------------------------------------------------------------------------


def test_upsert_last_wins_within_and_across_parts(make_sink: MakeSink, db: Database[Doc]) -> None:
    sink = make_sink(mode="upsert", key=["sku"])
    t1 = PartId("p1", 1, "w1")
    run_part(
        sink,
        t1,
        [
            rec(0, {"sku": "a", "qty": 1}),
            rec(1, {"sku": "b", "qty": 1}),
            rec(2, {"sku": "a", "qty": 2}),
            rec(3, {"sku": 7, "qty": 1}),
            rec(4, {"sku": "a", "qty": 3}),
        ],
    )
    t2 = PartId("p1", 2, "w1")
    run_part(sink, t2, [rec(5, {"sku": "b", "qty": 9}), rec(6, {"sku": "c", "qty": 1})])

    got = {d["_id"]: d for d in db.target.find()}
    assert {k: d["qty"] for k, d in got.items()} == {"a": 3, "b": 9, 7: 1, "c": 1}
    assert got["a"]["sku"] == "a"
    assert got["b"]["_twophase"] == {"pipeline": "p1", "txn": 2}


def test_upsert_composite_key(make_sink: MakeSink, db: Database[Doc]) -> None:
    sink = make_sink(mode="upsert", key=["region", "id"], version_field=None)
    run_part(
        sink,
        PartId("p1", 1, "w1"),
        [
            rec(0, {"region": "eu", "id": 1, "v": "x"}),
            rec(1, {"id": 1, "region": "us", "v": "y"}),
            rec(2, {"id": 1, "region": "eu", "v": "z"}),  # field order differs, same key
        ],
    )
    got = {(d["_id"]["region"], d["_id"]["id"]): d for d in db.target.find()}
    assert {k: d["v"] for k, d in got.items()} == {("eu", 1): "z", ("us", 1): "y"}
    assert list(got[("eu", 1)]["_id"]) == ["region", "id"]  # key order, as configured
    assert "_twophase" not in got[("eu", 1)]


def test_upsert_older_part_applied_late_does_not_overwrite(
    make_sink: MakeSink, db: Database[Doc]
) -> None:
    sink = make_sink(mode="upsert", key=["sku"])
    old, new = PartId("p1", 10, "w1"), PartId("p1", 11, "w2")
    run_part(
        sink, old, [rec(0, {"sku": "a", "qty": 1}), rec(1, {"sku": "z", "qty": 1})], commit=False
    )
    run_part(sink, new, [rec(2, {"sku": "a", "qty": 2})], commit=False)
    sink.commit(new)
    sink.commit(old)  # a recovered part of an earlier transaction, applied after the later one
    got = {d["_id"]: d["qty"] for d in db.target.find()}
    assert got == {"a": 2, "z": 1}


# -- chunked commit -----------------------------------------------------------------------------


def test_commit_interrupted_between_chunks_completes_exactly_once(
    make_sink: MakeSink, db: Database[Doc]
) -> None:
    first = make_sink(commit_chunk_size=7)
    part = PartId("p1", 3, "w1")
    records = [rec(i, {"v": i}) for i in range(30)]
    run_part(first, part, records, commit=False)

    assert first._commits.step(part) is False
    assert first._commits.step(part) is False
    # The process dies here: 14 documents are visible, the part is still in doubt.
    assert db.target.count_documents({}) == 14
    assert staged_entries(db["target__twophase_staging"]) == 16
    marker = db.twophase_parts.find_one({"_id": "mongo:" + part.token})
    assert marker is not None
    assert (marker["state"], marker["applied"]) == ("prepared", 14)
    assert marker["lease_owner"].startswith("w1@")
    with pytest.raises(FatalSinkError, match="being committed"):
        first.abort(part)  # half-applied: only commit may finish it
    first.close()  # a clean shutdown hands the lease back: nobody waits for it to expire
    marker = db.twophase_parts.find_one({"_id": "mongo:" + part.token})
    assert marker is not None and "lease_owner" not in marker and "lease_until" not in marker

    second = make_sink(commit_chunk_size=7, participant="w2")
    assert second.in_doubt() == [part]
    second.commit(part)
    assert ids(db.target) == sorted(r.record_id for r in records)
    assert sorted(d["v"] for d in db.target.find()) == list(range(30))
    assert db["target__twophase_staging"].count_documents({}) == 0
    marker = db.twophase_parts.find_one({"_id": "mongo:" + part.token})
    assert marker is not None
    assert (marker["state"], marker["applied"]) == ("committed", 30)


def test_upsert_last_wins_across_chunks(make_sink: MakeSink, db: Database[Doc]) -> None:
    sink = make_sink(mode="upsert", key=["k"], commit_chunk_size=3)
    records = [rec(i, {"k": i % 4, "v": i}) for i in range(17)]
    run_part(sink, PartId("p1", 1, "w1"), records)
    got = {d["_id"]: d["v"] for d in db.target.find()}
    assert got == {0: 16, 1: 13, 2: 14, 3: 15}


# -- concurrency --------------------------------------------------------------------------------


def test_commit_on_another_thread_while_next_part_is_written(
    make_sink: MakeSink, db: Database[Doc]
) -> None:
    sink = make_sink(commit_chunk_size=50)
    t1, t2 = PartId("p1", 1, "w1"), PartId("p1", 2, "w1")
    run_part(sink, t1, [rec(i, {"v": i}) for i in range(300)], commit=False)

    errors: list[Exception] = []

    def decide() -> None:
        try:
            sink.commit(t1)
        except Exception as exc:  # noqa: BLE001 - handed to the test thread below
            errors.append(exc)

    committer = threading.Thread(target=decide)
    sink.begin(t2)
    committer.start()
    for batch in range(10):
        sink.write(t2, [rec(300 + batch * 20 + i, {"v": i}) for i in range(20)])
    committer.join(timeout=120)
    assert not committer.is_alive()
    assert errors == []
    assert db.target.count_documents({}) == 300  # T committed, T+1 still invisible
    sink.prepare(t2, {(TOPIC, 0): 500})
    sink.commit(t2)
    assert db.target.count_documents({}) == 500
    assert sink.committed_positions() == {(TOPIC, 0): 500}


# -- concurrent committers of one part ----------------------------------------------------------

#: A race of committers finishes in seconds; a livelock runs into this generous bound instead of
#: hanging the suite.
RACE_BUDGET_S = 120.0
#: Short commit lease for the takeover tests, so they wait seconds instead of the default minute;
#: long enough that a slow machine still asks before it expires.
SHORT_LEASE_S = 5.0
RACE_DOCS, RACE_CHUNK = 3000, 200


def drive(call: Callable[[], None], budget_s: float = RACE_BUDGET_S) -> dict[str, int]:
    """Retry ``call`` as the participant runtime does (``BackpressureError`` after its
    ``retry_after_s``, other retriable errors with jittered exponential back-off) and count both."""
    deadline = time.monotonic() + budget_s
    delay = 0.05
    stats = {"backpressure": 0, "retriable": 0}
    while True:
        try:
            call()
            return stats
        except BackpressureError as exc:
            stats["backpressure"] += 1
            wait = exc.retry_after_s
        except RetriableSinkError:
            stats["retriable"] += 1
            wait = delay * random.uniform(0.5, 1.5)
            delay = min(delay * 2, 2.0)
        if time.monotonic() + wait > deadline:
            raise AssertionError(f"still not done after {budget_s:.0f}s: {stats}")
        time.sleep(wait)


def prepare_race(make_sink: MakeSink) -> PartId:
    """A prepared part of ``RACE_DOCS`` documents whose writer has gone away."""
    part = PartId("p1", 1, "w1")
    # Staged in chunks of RACE_CHUNK: the staging fixes the commit's transactions.
    writer = make_sink(participant="w1", commit_chunk_size=RACE_CHUNK)
    run_part(
        writer, part, [rec(i, {"v": i, "pad": "x" * 64}) for i in range(RACE_DOCS)], commit=False
    )
    writer.close()
    return part


def assert_committed_once(db: Database[Doc], sink: MongoSink, part: PartId, n: int) -> None:
    assert db.target.count_documents({}) == n
    assert {d["_id"]: d["v"] for d in db.target.find({}, {"v": 1})} == {
        f"{TOPIC}:0:{i}": i for i in range(n)
    }
    assert db["target__twophase_staging"].count_documents({}) == 0
    marker = db.twophase_parts.find_one({"_id": "mongo:" + part.token})
    assert marker is not None
    assert (marker["state"], marker["applied"], marker["records"]) == ("committed", n, n)
    assert "lease_owner" not in marker and "lease_until" not in marker
    assert sink.committed_positions() == {(TOPIC, 0): n}
    assert sink.in_doubt() == []


@pytest.mark.timeout(RACE_BUDGET_S + 60)
def test_threads_committing_one_part_take_turns(make_sink: MakeSink, db: Database[Doc]) -> None:
    part = prepare_race(make_sink)
    a = make_sink(participant="w1", commit_chunk_size=RACE_CHUNK)
    b = make_sink(participant="w2", commit_chunk_size=RACE_CHUNK)
    committers = [a, b, a]  # two instances (separate clients), and one of them on two threads
    start = threading.Barrier(len(committers))
    results: list[dict[str, int]] = []
    errors: list[BaseException] = []

    def run(sink: MongoSink) -> None:
        start.wait()
        try:
            results.append(drive(partial(sink.commit, part)))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in committers]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(RACE_BUDGET_S + 10)
    elapsed = time.perf_counter() - t0
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert_committed_once(db, a, part, RACE_DOCS)
    # The losers waited for the lease instead of colliding: no write conflict, no livelock.
    assert sum(r["retriable"] for r in results) == 0, results
    assert sum(r["backpressure"] for r in results) >= 1, results
    print(f"\n3 threads committing {RACE_DOCS} docs: {elapsed:.1f}s, {results}")


_COMMITTER = """
import json, logging, random, sys, time
from twophase.participants.sdk import BackpressureError, PartId, RetriableSinkError, SinkContext
from twophase.participants.sinks.mongodb import MongoSink

raw, participant, token, mode = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
part = PartId.parse(token)
sink = MongoSink.from_mapping(
    raw, SinkContext(part.pipeline, participant, raw["name"], logging.getLogger("child"))
)
sink.setup()
if mode.startswith("park:"):
    # Apply some chunks, then hang on to the lease until the parent kills this process.
    for _ in range(int(mode[5:])):
        assert not sink._commits.step(part)
    print("PARKED", flush=True)
    time.sleep(3600)
if mode.startswith("intxn:"):
    # Apply some chunks, then die inside the next chunk's transaction: its writes done, its
    # commit never sent (the parent kills this process), so the server keeps it open.
    for _ in range(int(mode[6:])):
        assert not sink._commits.step(part)
    def parked(part, session, apply=sink._commits._commit_chunk):
        apply(part, session)
        print("PARKED", flush=True)
        time.sleep(3600)
    sink._commits._commit_chunk = parked
    sink._commits.step(part)
print("READY", flush=True)
sys.stdin.readline()  # all committers start together
t0 = time.monotonic()
deadline, delay = t0 + float(mode), 0.05
stats = {"backpressure": 0, "retriable": 0}
while True:  # the participant runtime's retry loop
    try:
        sink.commit(part)
        break
    except BackpressureError as exc:
        stats["backpressure"] += 1
        wait = exc.retry_after_s
    except RetriableSinkError:
        stats["retriable"] += 1
        wait = delay * random.uniform(0.5, 1.5)
        delay = min(delay * 2, 2.0)
    if time.monotonic() + wait > deadline:
        sys.exit(f"still not done: {stats}")
    time.sleep(wait)
stats["elapsed_s"] = round(time.monotonic() - t0, 2)
print(json.dumps(stats), flush=True)
"""


def spawn_committer(
    mongo_uri: str, db: Database[Doc], participant: str, part: PartId, mode: str, **cfg: Any
) -> subprocess.Popen[str]:
    raw: Doc = {"name": "mongo", "type": "mongodb", "uri": mongo_uri, "database": db.name}
    raw |= {"collection": "target", "commit_chunk_size": RACE_CHUNK, **cfg}
    return subprocess.Popen(
        [sys.executable, "-c", _COMMITTER, json.dumps(raw), participant, part.token, mode],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def expect_line(proc: subprocess.Popen[str], word: str) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line == word, f"child said {line!r} (exit {proc.poll()}), expected {word}"


def kill_parked(mongo_uri: str, db: Database[Doc], part: PartId, mode: str, **cfg: Any) -> float:
    """A committer of ``part`` as participant w1 that parks in ``mode`` (``park:N``,
    ``intxn:N``), SIGKILLed once parked; when it was killed (``time.perf_counter``)."""
    holder = spawn_committer(mongo_uri, db, "w1", part, mode, **cfg)
    try:
        expect_line(holder, "PARKED")
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
    return time.perf_counter()


@pytest.mark.timeout(RACE_BUDGET_S + 60)
def test_processes_committing_one_part_take_turns(
    make_sink: MakeSink, db: Database[Doc], mongo_uri: str
) -> None:
    part = prepare_race(make_sink)
    procs = [
        spawn_committer(mongo_uri, db, w, part, str(RACE_BUDGET_S)) for w in ("w1", "w2", "w3")
    ]
    try:
        for proc in procs:
            expect_line(proc, "READY")
        t0 = time.perf_counter()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outputs = [proc.communicate(timeout=RACE_BUDGET_S + 10)[0] for proc in procs]
        elapsed = time.perf_counter() - t0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert [proc.returncode for proc in procs] == [0, 0, 0], outputs
    results = [json.loads(out) for out in outputs]
    assert_committed_once(db, make_sink(), part, RACE_DOCS)
    assert sum(r["retriable"] for r in results) == 0, results
    assert sum(r["backpressure"] for r in results) >= 1, results
    print(f"\n3 processes committing {RACE_DOCS} docs: {elapsed:.1f}s, {results}")


@pytest.mark.timeout(RACE_BUDGET_S + 60)
def test_killed_lease_holder_is_taken_over_after_its_lease_expires(
    make_sink: MakeSink, db: Database[Doc], mongo_uri: str
) -> None:
    part = prepare_race(make_sink)
    # Ready before the kill, so it asks while the dead holder's short lease is surely still live.
    survivor = make_sink(
        participant="w2", commit_chunk_size=RACE_CHUNK, commit_lease_s=SHORT_LEASE_S
    )
    killed = kill_parked(mongo_uri, db, part, "park:3", commit_lease_s=SHORT_LEASE_S)
    with pytest.raises(BackpressureError, match=r"being committed by w1@.* 600 of 3000 applied"):
        survivor.commit(part)  # the dead holder's lease is still live: wait, do not collide
    marker = db.twophase_parts.find_one({"_id": "mongo:" + part.token})
    assert marker is not None
    assert (marker["state"], marker["applied"]) == ("prepared", 3 * RACE_CHUNK)
    assert marker["lease_owner"].startswith("w1@")
    assert db.target.count_documents({}) == 3 * RACE_CHUNK
    assert survivor.in_doubt() == [part]

    stats = drive(partial(survivor.commit, part))
    waited = time.perf_counter() - killed
    assert stats["retriable"] == 0 and stats["backpressure"] >= 1, stats
    assert waited < SHORT_LEASE_S + 30
    assert_committed_once(db, survivor, part, RACE_DOCS)
    print(f"\ntakeover after SIGKILL: done {waited:.1f}s after the kill, {stats}")


@pytest.mark.timeout(RACE_BUDGET_S + 60)
def test_a_restarted_participant_takes_over_its_own_lease_at_once(
    make_sink: MakeSink, db: Database[Doc], mongo_uri: str
) -> None:
    """The killed holder's next incarnation (same participant id) does not wait out the lease
    -- the whole pipeline used to stall for it at every restart (chaos/README item 5)."""
    part = prepare_race(make_sink)
    kill_parked(mongo_uri, db, part, "park:3")  # the default 60 s lease
    marker = db.twophase_parts.find_one({"_id": "mongo:" + part.token})
    assert marker is not None and marker["lease_owner"].startswith("w1@")
    assert marker["lease_holder"] == "w1"
    restarted = make_sink(participant="w1", commit_chunk_size=RACE_CHUNK)
    t0 = time.perf_counter()
    restarted.commit(part)  # no BackpressureError: it is its own predecessor's lease
    took = time.perf_counter() - t0
    assert took < 30, took
    assert_committed_once(db, restarted, part, RACE_DOCS)
    # Another participant still respects a live lease (the test above waits it out).
    print(f"\nrestarted owner took over its own lease: committed in {took:.1f}s")


@pytest.mark.timeout(RACE_BUDGET_S + 120)
@pytest.mark.parametrize("successor", ["restarted", "other"])
def test_a_committer_killed_inside_a_chunk_transaction_is_not_waited_out(
    make_sink: MakeSink, db: Database[Doc], mongo_uri: str, successor: str
) -> None:
    """A committer killed between a chunk transaction's writes and its commit leaves the
    transaction open on the server, holding the marker, for the server's transaction lifetime
    (60 s, the stack's as mongod's). Its successor -- its own next incarnation, or another
    participant once the lease expired -- ends that session (``killSessions`` of the session the
    claim recorded) instead of waiting the minute out behind it, and commits exactly once."""
    part = prepare_race(make_sink)
    lease = {"commit_lease_s": SHORT_LEASE_S} if successor == "other" else {}
    killed = kill_parked(mongo_uri, db, part, "intxn:2", **lease)
    marker = db.twophase_parts.find_one({"_id": "mongo:" + part.token})
    assert marker is not None and marker["applied"] == 2 * RACE_CHUNK  # the third is open
    assert marker["lease_lsid"]["id"].subtype == 4
    after = make_sink(
        participant="w1" if successor == "restarted" else "w2", commit_chunk_size=RACE_CHUNK
    )
    drive(partial(after.commit, part))
    took = time.perf_counter() - killed
    assert_committed_once(db, after, part, RACE_DOCS)
    # Without ending the session this waits for the server's 60 s lifetime (plus its reaper).
    bound = (SHORT_LEASE_S if successor == "other" else 0) + 30
    assert took < bound, took
    print(f"\n{successor} successor of a committer killed in a transaction: {took:.1f}s")


def test_abort_waits_for_a_live_commit_lease(make_sink: MakeSink, db: Database[Doc]) -> None:
    holder = make_sink(participant="w1", commit_lease_s=SHORT_LEASE_S)
    other = make_sink(participant="w2", commit_lease_s=SHORT_LEASE_S)

    # The holder commits to the end: the waiting abort then learns the part is committed.
    finished = PartId("p1", 1, "w1")
    run_part(holder, finished, [rec(i, {"v": i}) for i in range(10)], commit=False)
    assert holder._commits.claim(finished)  # committing, nothing applied yet
    with pytest.raises(BackpressureError, match="being committed by w1@") as err:
        other.abort(finished)
    assert 0 < err.value.retry_after_s <= SHORT_LEASE_S
    holder.commit(finished)
    with pytest.raises(FatalSinkError, match="already committed"):
        other.abort(finished)

    # The holder dies before applying anything: once its lease expires the abort goes through.
    dead = PartId("p1", 2, "w1")
    run_part(holder, dead, [rec(100 + i, {"v": i}) for i in range(10)], commit=False)
    assert holder._commits.claim(dead)
    with pytest.raises(BackpressureError, match="being committed by w1@"):
        other.abort(dead)
    t0 = time.perf_counter()
    stats = drive(partial(other.abort, dead))
    assert stats["backpressure"] >= 1 and stats["retriable"] == 0, stats
    assert time.perf_counter() - t0 < SHORT_LEASE_S + 30
    marker = db.twophase_parts.find_one({"_id": "mongo:" + dead.token})
    assert marker is not None and marker["state"] == "aborted" and "lease_owner" not in marker
    assert db["target__twophase_staging"].count_documents({}) == 0
    assert ids(db.target) == [f"{TOPIC}:0:{i}" for i in range(10)]  # only the committed part
    with pytest.raises(UnknownPartError):
        holder.commit(dead)  # the old holder cannot commit it any more


def test_commit_of_a_committed_part_opens_no_transaction(
    make_sink: MakeSink, monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = make_sink()
    part = PartId("p1", 1, "w1")
    run_part(sink, part, [rec(i, {"v": i}) for i in range(5)])
    other = make_sink(participant="w2")

    def no_session(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("commit of a committed part opened a session")

    for s in (sink, other):
        monkeypatch.setattr(s.client, "start_session", no_session)
        s.commit(part)


def test_retried_write_does_not_duplicate(make_sink: MakeSink, db: Database[Doc]) -> None:
    sink = make_sink()
    part = PartId("p1", 1, "w1")
    batch = [rec(i, {"v": i}) for i in range(5)]
    sink.begin(part)
    sink.write(part, batch)
    sink.write(part, batch)  # the runtime re-sent the same records
    sink.prepare(part, {(TOPIC, 0): 5})
    sink.commit(part)
    assert db.target.count_documents({}) == 5


def write_losing_its_reply(
    monkeypatch: pytest.MonkeyPatch,
    sink: MongoSink,
    part: PartId,
    batch: list[Record],
    landed: Callable[[list[Any]], list[Any]],
) -> None:
    """``sink.write`` whose staging insert reaches the server with the documents ``landed``
    picks, then loses its connection: the write fails retriably, as the runtime sees it."""
    real_insert = Collection.insert_many

    def lossy(self: Collection[Doc], docs: list[Any], **kw: Any) -> Any:
        real_insert(self, landed(docs), **kw)
        raise AutoReconnect("connection reset by peer (injected)")

    with monkeypatch.context() as patched:
        patched.setattr(Collection, "insert_many", lossy)
        with pytest.raises(RetriableSinkError):
            sink.write(part, batch)


def test_write_retried_after_connection_loss_stages_each_record_once(
    make_sink: MakeSink, db: Database[Doc], monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = make_sink(mode="upsert", key=["k"], commit_chunk_size=4)
    part = PartId("p1", 1, "w1")
    batch = [rec(i, {"k": i % 3, "v": i}) for i in range(10)]
    sink.begin(part)
    write_losing_its_reply(monkeypatch, sink, part, batch, lambda docs: docs[: len(docs) // 2])
    assert sink.write(part, batch) == []  # the runtime retries the same call
    sink.prepare(part, {(TOPIC, 0): 10})  # the staged count matches: nothing lost or doubled
    sink.commit(part)
    assert {d["_id"]: d["v"] for d in db.target.find()} == {0: 9, 1: 7, 2: 8}


def test_a_retried_write_the_target_judges_differently_aborts_the_part_at_prepare(
    make_sink: MakeSink, db: Database[Doc], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The class: a write whose reply was lost is retried, and the retry stages a different set
    of the same records (the target refused one on the first try and takes it on the second).
    Its chunk is not taken for the first try's duplicate: the staged count no longer matches,
    and the prepare aborts the part (re-read later) instead of counting a record as staged in
    a chunk that lacks it."""
    db.target.create_index("u", unique=True)
    db.target.insert_one({"_id": "other", "u": 2})  # refuses the record with u=2, for now
    sink = make_sink()
    part = PartId("p1", 1, "w1")
    batch = [rec(i, {"u": i}) for i in range(5)]
    sink.begin(part)
    write_losing_its_reply(monkeypatch, sink, part, batch, lambda docs: docs)
    db.target.delete_one({"_id": "other"})
    assert sink.write(part, batch) == []  # the same call again: now nothing is refused
    with pytest.raises(AbortTransactionError, match="staged entries"):
        sink.prepare(part, {(TOPIC, 0): 5})
    sink.abort(part)
    assert db.target.count_documents({}) == 0
    assert db["target__twophase_staging"].count_documents({}) == 0


# -- bad input ----------------------------------------------------------------------------------


def test_rejected_records_are_reported_and_the_rest_commit(
    make_sink: MakeSink, db: Database[Doc]
) -> None:
    sink = make_sink(mode="upsert", key=["id"])
    bad = {
        1: {"id": 1, "$set": {"x": 1}},
        2: {"id": 2, "a": {"b.c": 1}},
        3: {"id": None, "v": 1},
        4: {"v": 1},
        5: {"id": [1, 2]},
        6: {"id": 6, "big": 10**40},  # 41 digits: no exact BSON form
        7: {"id": 7, "list": [{"$oid": "x"}]},
        8: {"id": 8, "blob": "x" * (17 * 1024 * 1024)},
    }
    good = {
        10: {"id": 10, "v": "ok"},
        11: {"id": 11, "v": "ok", "": "empty names are fine"},
        12: {"id": 12, "big": 2**70},  # past int64: an exact Decimal128 (docs/types.md)
    }
    records = [rec(off, value) for off, value in sorted({**bad, **good}.items())]
    rejected = run_part(sink, PartId("p1", 1, "w1"), records)

    reasons = {r.record.offset: r.reason for r in rejected}
    assert sorted(reasons) == sorted(bad)
    assert "'$set'" in reasons[1]
    assert "'a.b.c'" in reasons[2] and "'.'" in reasons[2]
    assert "'id' is null" in reasons[3]
    assert "'id' is missing" in reasons[4]
    assert "array" in reasons[5]
    assert "BSON" in reasons[6] and "41 digits" in reasons[6]
    assert "list[0].$oid" in reasons[7]
    assert "bytes" in reasons[8]
    assert ids(db.target) == [10, 11, 12]
    assert db.target.find_one({"id": 12})["big"] == bson.Decimal128(str(2**70))  # type: ignore[index]
    # check() refuses the same records for the same reasons, writing nothing.
    assert {r.record.offset: r.reason for r in sink.check(records)} == reasons


@pytest.mark.parametrize("mode", ["insert", "upsert"])
def test_documents_the_target_refuses_are_rejected_at_write_and_the_rest_commit(
    make_sink: MakeSink, db: Database[Doc], mode: str
) -> None:
    """A unique index besides _id and a validator: what the target would refuse at commit is
    found at write and rejected, one by one, instead of failing the commit forever."""
    db.create_collection(
        "target",
        validator={"$jsonSchema": {"properties": {"v": {"bsonType": ["int", "long"]}}}},
    )
    db.target.create_index("email", unique=True)
    db.target.insert_one({"_id": "old", "id": -1, "email": "taken@x", "v": 0})
    options: dict[str, Any] = {"mode": mode}
    if mode == "upsert":
        options["key"] = ["id"]
    sink = make_sink(**options)
    values = [{"id": i, "email": f"{i}@x", "v": i} for i in range(30)]
    values[3] = {"id": 3, "email": "taken@x", "v": 3}  # unique index vs a committed document
    values[11] = {"id": 11, "email": "2@x", "v": 11}  # unique index vs an earlier record
    values[20] = {"id": 20, "email": "20@x", "v": "twenty"}  # the validator
    records = [rec(i, v) for i, v in enumerate(values)]
    rejected = run_part(sink, PartId("p1", 1, "w1"), records)
    reasons = {r.record.offset: r.reason for r in rejected}
    assert sorted(reasons) == [3, 11, 20], reasons
    assert "11000" in reasons[3] and "11000" in reasons[11], reasons
    assert "121" in reasons[20], reasons
    stored = sorted(d["id"] for d in db.target.find({}, {"id": 1}))
    assert stored == [-1] + [i for i in range(30) if i not in reasons]


def test_insert_mode_rejects_own_id_and_non_objects(make_sink: MakeSink, db: Database[Doc]) -> None:
    sink = make_sink()
    records = [rec(0, {"_id": "mine", "v": 1}), rec(1, ["not", "an", "object"]), rec(2, {"v": 2})]
    rejected = run_part(sink, PartId("p1", 1, "w1"), records)
    assert [r.record.offset for r in rejected] == [0, 1]
    assert "_id" in rejected[0].reason and "not a JSON object" in rejected[1].reason
    assert ids(db.target) == [f"{TOPIC}:0:2"]


# -- recovery scope -----------------------------------------------------------------------------


def test_in_doubt_is_per_pipeline_and_sink(make_sink: MakeSink) -> None:
    a = make_sink(pipeline="p1")
    b = make_sink(pipeline="p2")
    c = make_sink(pipeline="p1", sink_name="other", collection="elsewhere")
    pa, pb, pc = PartId("p1", 1, "w1"), PartId("p2", 1, "w1"), PartId("p1", 2, "w1")
    run_part(a, pa, [rec(0, {"v": 1})], commit=False)
    run_part(b, pb, [rec(0, {"v": 1})], commit=False)
    run_part(c, pc, [rec(0, {"v": 1})], commit=False)
    assert a.in_doubt() == [pa]
    assert b.in_doubt() == [pb]
    assert c.in_doubt() == [pc]
    b.commit(pb)
    assert b.in_doubt() == [] and a.in_doubt() == [pa]


def test_stale_open_parts_are_found_and_cleaned(make_sink: MakeSink, db: Database[Doc]) -> None:
    dead = make_sink(participant="w1")
    part = PartId("p1", 4, "w1")
    dead.begin(part)
    dead.write(part, [rec(i, {"v": i}) for i in range(6)])
    dead.close()  # died while writing: never prepared

    live = make_sink(participant="w2")
    mine = PartId("p1", 5, "w2")
    live.begin(mine)
    live.write(mine, [rec(100, {"v": 1})])
    assert live.in_doubt() == []
    with pytest.raises(UnknownPartError):
        live.commit(part)  # never prepared: there is nothing to commit
    assert live.stale_parts(before_txn=4) == []  # could still be live: leave it alone
    assert live.stale_parts(before_txn=6) == [part]  # never its own open part
    live.abort(part)
    assert live.stale_parts(before_txn=6) == []
    assert db["target__twophase_staging"].count_documents({"part": "mongo:" + part.token}) == 0

    live.prepare(mine, {(TOPIC, 0): 101})
    live.commit(mine)
    assert ids(db.target) == [f"{TOPIC}:0:100"]
    # The aborted stale part's marker goes; the newest committed one stays (last_committed).
    assert live.forget_decided(before_txn=100) == 1
    last = live.last_committed()
    assert last is not None and last.part == mine
    live.commit(mine)  # still known: a no-op
    assert ids(db.target) == [f"{TOPIC}:0:100"]


# -- config -------------------------------------------------------------------------------------


def test_config_errors_name_the_field_and_hide_the_uri() -> None:
    base: Doc = {
        "name": "m",
        "type": "mongodb",
        "uri": "mongodb://user:hunter2@db:27017",
        "database": "d",
        "collection": "c",
    }
    with pytest.raises(ValidationError) as err:
        MongoSinkConfig.model_validate({**base, "key": ["id"]})  # insert mode keys by record id
    assert err.value.errors()[0]["loc"] == ("key",)
    with pytest.raises(ValidationError) as err:
        MongoSinkConfig.model_validate({**base, "database": "a.b"})
    assert err.value.errors()[0]["loc"] == ("database",)
    with pytest.raises(ValidationError) as err:
        MongoSinkConfig.model_validate({**base, "commit_chunk_size": 0})
    assert err.value.errors()[0]["loc"] == ("commit_chunk_size",)
    cfg = MongoSinkConfig.model_validate(base)
    assert "hunter2" not in repr(cfg) and "hunter2" not in cfg.model_dump_json()
    assert cfg.staging == "c__twophase_staging"


# -- volume -------------------------------------------------------------------------------------


def test_5k_document_part_timed(make_sink: MakeSink, db: Database[Doc]) -> None:
    sink = make_sink()
    part = PartId("p1", 1, "w1")
    n = 5000
    records = [
        rec(i, {"n": i, "name": f"item-{i}", "tags": ["a", "b"], "price": i * 0.5})
        for i in range(n)
    ]
    t0 = time.perf_counter()
    sink.begin(part)
    for i in range(0, n, 500):
        sink.write(part, records[i : i + 500])
    sink.prepare(part, {(TOPIC, 0): n})
    t1 = time.perf_counter()
    sink.commit(part)
    t2 = time.perf_counter()
    assert db.target.count_documents({}) == n
    assert db["target__twophase_staging"].count_documents({}) == 0
    print(
        f"\nmongodb sink, {n} docs: stage+prepare {n / (t1 - t0):.0f} docs/s, "
        f"commit {n / (t2 - t1):.0f} docs/s, end to end {n / (t2 - t0):.0f} docs/s"
    )


def test_a_server_internal_error_while_applying_a_decision_is_retried(make_sink: MakeSink) -> None:
    """Applying a decided part is idempotent: an InternalError (code 1, no retry label, which
    SecantusDB returns for write conflicts) must not end the process; elsewhere it still does."""
    from pymongo.errors import OperationFailure

    from twophase.participants.sdk import FatalSinkError, RetriableSinkError

    sink = make_sink()
    failure = OperationFailure("internal server error", code=1)
    for what in ("commit", "abort"):
        with pytest.raises(RetriableSinkError), sink._store.errors(what, "t", FatalSinkError):
            raise failure
    with pytest.raises(FatalSinkError), sink._store.errors("prepare", "t", FatalSinkError):
        raise failure


# -- deletes (change data capture, docs/cdc.md) -------------------------------------------------


def delete(offset: int, value: Doc) -> Record:
    return rec(offset, value)._replace(deleted=True)


def test_a_delete_is_applied_at_commit_and_the_last_change_of_a_key_wins(
    make_sink: MakeSink, db: Database[Doc]
) -> None:
    sink = make_sink(mode="upsert", key=["sku"])
    assert sink.supports_deletes and not make_sink(sink_name="ins").supports_deletes
    run_part(sink, PartId("p1", 1, "w1"), [rec(0, {"sku": "a", "q": 1}), rec(1, {"sku": "b"})])
    p2 = PartId("p1", 2, "w1")
    run_part(
        sink,
        p2,
        [
            delete(2, {"sku": "a"}),
            rec(3, {"sku": "c", "q": 1}),
            delete(4, {"sku": "c"}),  # written and deleted in one part: gone
            delete(5, {"sku": "b"}),
            rec(6, {"sku": "b", "q": 9}),  # deleted, then written again: the new document
        ],
        commit=False,
    )
    assert ids(db.target) == ["a", "b"]  # prepared: nothing of the part visible
    sink.commit(p2)
    assert {d["_id"]: d.get("q") for d in db.target.find()} == {"b": 9}
    sink.commit(p2)  # repeated: nothing more happens
    assert ids(db.target) == ["b"]


def test_an_older_part_applied_late_does_not_bring_a_deleted_document_back(
    make_sink: MakeSink, db: Database[Doc]
) -> None:
    sink = make_sink(mode="upsert", key=["sku"])
    old, new = PartId("p1", 10, "w1"), PartId("p1", 11, "w2")
    run_part(sink, old, [rec(0, {"sku": "a", "q": 1}), rec(1, {"sku": "z"})], commit=False)
    run_part(sink, new, [delete(2, {"sku": "a"})], commit=False)
    sink.commit(new)
    sink.commit(old)  # a recovered part of an earlier transaction, applied after the later one
    assert ids(db.target) == ["z"]
    # Retention forgets the tombstone once no older part can still be applied.
    assert db.twophase_parts.count_documents({"kind": "tombstone"}) == 1
    sink.forget_decided(12)
    assert db.twophase_parts.count_documents({"kind": "tombstone"}) == 0


def test_a_delete_without_its_key_is_rejected(make_sink: MakeSink, db: Database[Doc]) -> None:
    sink = make_sink(mode="upsert", key=["sku"])
    rejected = run_part(sink, PartId("p1", 1, "w1"), [delete(0, {"q": 1}), rec(1, {"sku": "k"})])
    assert [r.reason for r in rejected] == ["a delete needs its key: key field 'sku' is missing"]
    assert ids(db.target) == ["k"]


def test_a_wide_integer_key_is_deleted_where_its_upsert_put_it(
    make_sink: MakeSink, db: Database[Doc]
) -> None:
    """A key past int64 is stored as its exact Decimal128 (docs/types.md); its delete must
    stage and find the same _id -- it used to end the participant (bson's OverflowError)."""
    sink = make_sink(mode="upsert", key=["sku"])
    wide, wider = 2**64 + 1, 10**40
    run_part(sink, PartId("p1", 1, "w1"), [rec(0, {"sku": wide, "q": 1}), rec(1, {"sku": 7})])
    assert {str(d["_id"]) for d in db.target.find({})} == {"7", str(wide)}
    rejected = run_part(
        sink, PartId("p1", 2, "w1"), [delete(2, {"sku": wide}), delete(3, {"sku": wider})]
    )
    assert [(r.record.offset, "no exact BSON form" in r.reason) for r in rejected] == [(3, True)]
    assert ids(db.target) == [7]


@pytest.mark.parametrize("versioned", [False, True])
@pytest.mark.parametrize(
    ("mode", "partial", "chunk"),
    [
        ("upsert", False, 1000),
        ("upsert", True, 3),
        ("upsert", True, 1000),
        ("update", False, 3),
        ("update", True, 1000),
    ],
)
def test_the_last_change_of_a_key_wins_in_every_mode(
    make_sink: MakeSink, db: Database[Doc], mode: str, partial: bool, chunk: int, versioned: bool
) -> None:
    """Random writes of some fields and deletes over a few keys, in random parts and chunks: the
    collection equals applying the changes one by one -- a write replaces the document (or,
    ``partial``, sets its fields), ``update`` mode never creates one, a delete removes it."""
    db.target.insert_many([{"_id": k, "sku": k, "seed": True} for k in ("a", "b")])
    model: dict[str, Doc] = {k: {"sku": k, "seed": True} for k in ("a", "b")}
    sink = make_sink(
        mode=mode,
        key=["sku"],
        partial=partial,
        commit_chunk_size=chunk,
        version_field="_v" if versioned else None,
    )
    rnd = random.Random(f"{mode}{partial}")
    offset = 0
    for txn in range(1, 5):
        batch = []
        for _ in range(rnd.randint(1, 30)):
            sku = rnd.choice("abcd")
            if rnd.random() < 0.3:
                batch.append(delete(offset, {"sku": sku}))
                model.pop(sku, None)
            else:
                fields = {f: offset for f in rnd.sample(["x", "y", "z"], rnd.randint(1, 3))}
                batch.append(rec(offset, {"sku": sku, **fields}))
                if sku in model or mode == "upsert":
                    base = model.get(sku, {}) if partial else {}
                    model[sku] = {**base, "sku": sku, **fields}
            offset += 1
        assert run_part(sink, PartId("p1", txn, "w1"), batch) == []
        got = {d.pop("_id"): d for d in db.target.find({}, {"_v": 0})}
        assert got == model, f"{mode} partial={partial} txn {txn}"


def test_a_collection_template_writes_each_topic_into_its_collection(
    make_sink: MakeSink, db: Database[Doc]
) -> None:
    """One part across collections made on their first record: invisible until the commit,
    committed by a new instance from its staging, deletes applied in their own collection
    (with tombstones of their own), an abort leaving every collection as it was, and a record
    without the field its collection is named by rejected with the reason."""

    def change(topic: str, offset: int, value: Doc, *, deleted: bool = False) -> Record:
        r = rec(offset, value, topic=topic)
        return r._replace(deleted=True) if deleted else r

    options = {
        "collection": "${topic}",
        "topic_replace": [r"^cdc\.", "c_"],
        "mode": "upsert",
        "key": ["id"],
    }
    first = make_sink(**options)
    run_part(first, PartId("p1", 1, "w1"), [change("cdc.b", 0, {"id": 1, "v": "b1"})])
    part = PartId("p1", 2, "w1")
    batch = [
        change("cdc.a", 0, {"id": 1, "v": "a1"}),
        change("cdc.b", 1, {"id": 2, "v": "b2"}),
        change("cdc.a", 1, {"id": 2, "v": "a2"}),
        change("cdc.b", 2, {"id": 1}, deleted=True),  # b's 1, committed by part 1: gone
        change("cdc.a", 2, {"id": 1, "v": "a1 again"}),
    ]
    assert run_part(first, part, batch, commit=False) == []
    assert "c_a" in db.list_collection_names()  # made on its first record, outside any txn
    assert ids(db["c_a"]) == [] and ids(db["c_b"]) == [1]
    later = make_sink(participant="w2", **options)  # the writer is gone; another commits
    assert later.in_doubt() == [part]
    later.commit(part)
    assert [(d["_id"], d["v"]) for d in db["c_a"].find().sort("_id")] == [
        (1, "a1 again"),
        (2, "a2"),
    ]
    assert [(d["_id"], d["v"]) for d in db["c_b"].find().sort("_id")] == [(2, "b2")]
    tombstones = list(db["twophase_parts"].find({"kind": "tombstone"}))
    assert [(t["_id"]["tombstone"], t["_id"].get("coll")) for t in tombstones] == [(1, "c_b")]

    aborted = PartId("p1", 3, "w2")
    run_part(later, aborted, [change("cdc.a", 3, {"id": 2}, deleted=True)], commit=False)
    later.abort(aborted)
    assert ids(db["c_a"]) == [1, 2]

    by_field = make_sink(sink_name="mongo2", collection="${value.kind}", mode="upsert", key=["id"])
    rejected = run_part(
        by_field, PartId("p1", 4, "w1"), [rec(0, {"kind": "k_x", "id": 7}), rec(1, {"id": 8})]
    )
    assert [(r.record.offset, r.reason) for r in rejected] == [
        (1, "target ${value.kind}: no value for ${value.kind}")
    ]
    assert ids(db["k_x"]) == [7]
