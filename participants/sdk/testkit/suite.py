"""The conformance cases. Each one states a rule of :mod:`twophase.participants.sdk.sink` and checks it
against the real store through the author's ``committed_ids`` -- what a reader sees -- never
through the sink's own bookkeeping."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import ClassVar

import orjson
import pytest

from twophase.participants.sdk.errors import FatalSinkError, SinkError, UnknownPartError
from twophase.participants.sdk.records import RawBatch, Record
from twophase.participants.sdk.sink import Sink
from twophase.participants.sdk.testkit._records import (
    TOPIC,
    change,
    ids,
    positions_of,
    record,
    records,
)
from twophase.participants.sdk.testkit.kit import Kit

__all__ = ["CASES", "DeleteConformance", "SinkConformance"]

#: How long one thread of a concurrency case waits for the other; generous for slow stores.
THREAD_WAIT_S = 120.0
#: How far a store's commit time may be from the test's clock: the store may stamp it with its
#: own clock (a database server's), which runs a little apart. A local time passed off as UTC is
#: off by whole hours (unless the machine runs on UTC, where nothing can tell).
CLOCK_SKEW = timedelta(minutes=5)


def _overridden(sink: Sink, method: str) -> bool:
    return getattr(type(sink), method) is not getattr(Sink, method)


class _Thread(threading.Thread):
    """A thread whose exception is re-raised by :meth:`result` in the test's thread."""

    def __init__(self, target: Callable[[], None], name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._fn = target
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            self.error = exc

    def wait_for(self, event: threading.Event) -> None:
        """Wait until the thread sets ``event``; its error if it ends without doing so."""
        while not event.wait(0.05):
            if not self.is_alive():
                self.result()
                raise AssertionError(f"{self.name} ended before it got there")

    def result(self) -> None:
        self.join(THREAD_WAIT_S)
        assert not self.is_alive(), f"{self.name} did not finish in {THREAD_WAIT_S}s"
        if self.error is not None:
            raise self.error


class SinkConformance:
    """The generated suite: subclass it in a test module (``class TestMySink(SinkConformance)``)
    next to a ``twophase_sink_factory`` fixture, and every case runs against your sink.

    ``known_failures`` maps a case name to the bug that makes it fail; the plugin runs that case
    as a strict xfail, so fixing the bug turns it into a failure that asks to remove the entry.
    """

    known_failures: ClassVar[Mapping[str, str]] = {}

    # -- visibility ---------------------------------------------------------------------------

    def test_commit_publishes_the_part_exactly_once(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        sink, part = kit.sink(), kit.part(1)
        batch = records(0, 50) + records(0, 30, partition=1)
        sink.begin(part)
        sink.write(part, batch[:40])
        assert kit.visible() == Counter(), "records of an open part are visible"
        sink.write(part, batch[40:])
        sink.prepare(part, positions_of(batch))
        assert kit.visible() == Counter(), "records of a prepared part are visible before commit"
        sink.commit(part)
        assert kit.visible() == ids(batch)
        assert sink.in_doubt() == []

    def test_nothing_of_open_prepared_or_aborted_parts_is_visible(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        sink = kit.sink()
        committed = records(0, 10)
        kit.run(sink, kit.part(1), committed, commit=True)
        kit.run(sink, kit.part(2), records(100, 10))  # stays prepared
        kit.run(sink, kit.part(3), records(200, 10))
        sink.abort(kit.part(3))  # aborted after its prepare
        kit.run(sink, kit.part(4), records(300, 10), prepare=False)
        sink.abort(kit.part(4))  # aborted while open
        kit.run(sink, kit.part(5), records(400, 10), prepare=False)  # stays open
        assert kit.visible() == ids(committed)
        assert kit.sink("w2").in_doubt() == [kit.part(2)]

    # -- idempotence and refusals ---------------------------------------------------------------

    def test_commit_is_idempotent(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        sink, part, batch = kit.sink(), kit.part(1), records(0, 25)
        kit.run(sink, part, batch)
        sink.commit(part)
        sink.commit(part)
        kit.sink("w2").commit(part)  # a decision replayed by another participant
        assert kit.visible() == ids(batch)
        assert sink.in_doubt() == []

    def test_abort_is_idempotent(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        sink = kit.sink()
        kit.run(sink, kit.part(1), records(0, 25))
        sink.abort(kit.part(1))
        sink.abort(kit.part(1))
        kit.run(sink, kit.part(2), records(100, 5), prepare=False)
        sink.abort(kit.part(2))
        sink.abort(kit.part(2))
        other = kit.sink("w2")
        other.abort(kit.part(1))
        other.abort(kit.part(99))  # never existed
        assert kit.visible() == Counter()
        assert other.in_doubt() == []

    def test_prepare_repeated_with_same_positions_is_a_noop(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        sink, part, batch = kit.sink(), kit.part(1), records(0, 25)
        kit.run(sink, part, batch)
        sink.prepare(part, positions_of(batch))  # the runtime repeats a prepare it doubts
        assert sink.in_doubt() == [part]
        sink.commit(part)
        assert kit.visible() == ids(batch)

    def test_commit_of_an_unknown_or_aborted_part_raises(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        sink = kit.sink()
        with pytest.raises(UnknownPartError):
            sink.commit(kit.part(7))
        kit.run(sink, kit.part(1), records(0, 10))
        sink.abort(kit.part(1))
        with pytest.raises(UnknownPartError):
            sink.commit(kit.part(1))
        kit.run(sink, kit.part(2), records(100, 10), prepare=False)
        with pytest.raises(UnknownPartError):
            sink.commit(kit.part(2))  # open, never prepared
        sink.abort(kit.part(2))
        assert kit.visible() == Counter()

    def test_abort_of_a_committed_part_raises(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        sink, part, batch = kit.sink(), kit.part(1), records(0, 10)
        kit.run(sink, part, batch, commit=True)
        with pytest.raises(FatalSinkError):
            sink.abort(part)
        with pytest.raises(FatalSinkError):
            kit.sink("w2").abort(part)
        assert kit.visible() == ids(batch)

    def test_begin_while_another_part_is_open_raises(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        sink, part, batch = kit.sink(), kit.part(1), records(0, 10)
        sink.begin(part)
        with pytest.raises(FatalSinkError):
            sink.begin(kit.part(2))
        sink.write(part, batch)  # the open part is unharmed
        sink.prepare(part, positions_of(batch))
        sink.commit(part)
        assert kit.visible() == ids(batch)

    def test_replay_of_a_committed_part_changes_nothing(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        part, batch = kit.part(1), records(0, 30)
        kit.run(kit.sink(), part, batch, commit=True)
        restarted = kit.sink()  # same participant, new process
        assert restarted.in_doubt() == []
        restarted.commit(part)  # the decision log is replayed after a restart
        kit.sink("w2").commit(part)
        with pytest.raises(FatalSinkError):
            restarted.begin(part)  # a part id is never reused for other data
        assert kit.visible() == ids(batch)

    # -- restarts and crashes -----------------------------------------------------------------

    def test_commit_after_restart(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        first = kit.sink()
        a, b = records(0, 20), records(100, 20)
        kit.run(first, kit.part(1), a)
        kit.run(first, kit.part(2), b)
        first.close()  # close() keeps prepared parts
        restarted = kit.sink()
        assert restarted.in_doubt() == [kit.part(1), kit.part(2)]
        restarted.commit(kit.part(1))
        kit.sink("w2").commit(kit.part(2))  # another participant finishes the dead one's work
        assert kit.visible() == ids(a + b)
        assert restarted.in_doubt() == []

    def test_abort_after_restart(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        first = kit.sink()
        kit.run(first, kit.part(1), records(0, 20))
        kit.run(first, kit.part(2), records(100, 20))
        first.close()
        restarted = kit.sink()
        assert restarted.in_doubt() == [kit.part(1), kit.part(2)]
        restarted.abort(kit.part(1))
        kit.sink("w2").abort(kit.part(2))
        assert kit.visible() == Counter()
        assert restarted.in_doubt() == []

    @pytest.mark.parametrize("decision", ["commit", "abort"])
    def test_crash_between_prepare_and_decision(self, twophase_kit: Kit, decision: str) -> None:
        kit = twophase_kit
        prepared, dead_open = kit.part(1), kit.part(2)
        batch = records(0, 40)
        # A process prepares part 1, writes part 2 and is killed (SIGKILL, nothing closed).
        kit.crash_after("w1", prepared=(1, batch), open_=(2, 25))
        survivor = kit.sink("w2")
        assert survivor.in_doubt() == [prepared]
        assert kit.visible() == Counter()
        stale = survivor.stale_parts(3)
        assert stale in ([], [dead_open]), (
            f"stale_parts lists more than the dead open part: {stale}"
        )
        if decision == "commit":
            survivor.commit(prepared)
        else:
            survivor.abort(prepared)
        for part in stale:
            survivor.abort(part)
        # The crashed participant restarts and re-reads the part it had open, under the same id.
        restarted = kit.sink("w1")
        retry = [record(20_000 + i) for i in range(10)]
        kit.run(restarted, dead_open, retry, commit=True)
        expected = ids(retry) + (ids(batch) if decision == "commit" else Counter())
        assert kit.visible() == expected
        assert restarted.in_doubt() == []
        assert restarted.stale_parts(10**9) == []

    # -- in-doubt and stale parts ---------------------------------------------------------------

    def test_in_doubt_is_exact(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        w1, w2 = kit.sink("w1"), kit.sink("w2")
        # Pipelines whose names extend or cut this one's: prefix matching is a classic bug.
        longer, shorter = kit.pipeline + "-x", kit.pipeline[:-1]
        kit.run(kit.sink("w1", pipeline=longer), kit.part(3, pipeline=longer), records(0, 5))
        kit.run(kit.sink("w1", pipeline=shorter), kit.part(3, pipeline=shorter), records(0, 5))
        kit.run(w1, kit.part(4), records(100, 5), commit=True)
        kit.run(w1, kit.part(5), records(200, 5))
        w1.abort(kit.part(5))
        kit.run(w1, kit.part(1), records(300, 5))
        kit.run(w2, kit.part(2, "w2"), records(400, 5))
        kit.run(w1, kit.part(6), records(500, 5), prepare=False)  # open, not in doubt
        expected = [kit.part(1), kit.part(2, "w2")]
        assert w1.in_doubt() == expected
        assert w2.in_doubt() == expected
        assert kit.sink("w3").in_doubt() == expected
        assert kit.sink("w9", pipeline=longer).in_doubt() == [kit.part(3, pipeline=longer)]
        assert kit.sink("w9", pipeline=shorter).in_doubt() == [kit.part(3, pipeline=shorter)]

    def test_stale_parts_never_lists_a_live_part(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        sink = kit.sink("w1")
        kit.run(sink, kit.part(1), records(0, 5), commit=True)
        kit.run(sink, kit.part(2), records(100, 5))
        kit.run(sink, kit.part(3), records(200, 5), prepare=False)  # this process's open part
        assert sink.stale_parts(10**9) == []
        other = kit.sink("w2")
        assert kit.part(3) not in other.stale_parts(3), "a part no older than before_txn"
        assert set(other.stale_parts(10**9)) <= {kit.part(3)}
        sink.abort(kit.part(3))
        assert other.stale_parts(10**9) == []

    # -- concurrency ----------------------------------------------------------------------------

    def test_next_part_is_written_while_the_previous_is_decided(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        sink = kit.sink()
        first, dropped = records(0, 200), records(1_000, 200)
        kit.run(sink, kit.part(1), first)
        kit.run(sink, kit.part(2), dropped)
        nxt = kit.part(3)
        batches = [records(10_000 + 50 * i, 50) for i in range(40)]
        first_written = threading.Event()

        def data_thread() -> None:
            sink.begin(nxt)
            for i, batch in enumerate(batches):
                sink.write(nxt, batch)
                if i == 0:
                    first_written.set()
            sink.prepare(nxt, positions_of(r for b in batches for r in b))

        writer = _Thread(data_thread, "kit-data-thread")
        writer.start()
        writer.wait_for(first_written)
        # The control thread decides parts 1 and 2 while part 3's writes go on.
        sink.commit(kit.part(1))
        sink.abort(kit.part(2))
        assert kit.visible() == ids(first), "part 3 is visible while it is being written"
        writer.result()
        sink.commit(nxt)
        assert kit.visible() == ids(first) + ids(r for b in batches for r in b)

    def test_begin_after_abort_of_the_open_part_reuses_its_id(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        sink, part = kit.sink(), kit.part(1)
        sink.begin(part)
        sink.write(part, records(0, 20))
        aborter = _Thread(lambda: sink.abort(part), "kit-control-thread")
        aborter.start()
        aborter.result()
        # A rewind re-reads the same transaction's records: same id, again.
        sink.begin(part)
        first_written = threading.Event()

        def data_thread() -> None:
            for i in range(200):
                try:
                    sink.write(part, records(20 * i, 20))
                except SinkError:
                    return  # the part was aborted under it: expected
                first_written.set()

        writer = _Thread(data_thread, "kit-data-thread")
        writer.start()
        writer.wait_for(first_written)
        sink.abort(part)  # meets writes in flight
        writer.result()
        final = records(0, 30)
        kit.run(sink, part, final, commit=True)
        assert kit.visible() == ids(final)

    # -- size and refusals ----------------------------------------------------------------------

    def test_large_batch(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        batch = records(0, kit.factory.large_batch)
        kit.run(kit.sink(), kit.part(1), batch, commit=True)
        assert kit.visible() == ids(batch)

    def test_refused_record_comes_back_rejected_and_the_rest_commit(
        self, twophase_kit: Kit
    ) -> None:
        kit = twophase_kit
        if kit.factory.bad_value is None:
            pytest.skip("the factory declares no bad_value this store refuses")
        sink, part = kit.sink(), kit.part(1)
        good = records(0, 10) + records(11, 10)
        good_record = record(10)
        bad = Record(TOPIC, 0, 10, good_record.timestamp_ms, None, dict(kit.factory.bad_value))
        sink.begin(part)
        rejected = list(sink.write(part, good[:10] + [bad] + good[10:]))
        assert [r.record.record_id for r in rejected] == [bad.record_id]
        assert rejected[0].reason, "a rejection says why"
        assert all(isinstance(v, str) for v in rejected[0].extra.values())
        more = records(100, 5)
        assert list(sink.write(part, more)) == []  # the part goes on
        sink.prepare(part, positions_of(good + [bad] + more))
        sink.commit(part)
        assert kit.visible() == ids(good + more)

    def test_check_refuses_only_what_write_refuses_and_writes_nothing(
        self, twophase_kit: Kit
    ) -> None:
        """``check`` is asked before any sink writes, so that a record any sink refuses reaches
        no sink: it is pure (writes nothing, needs no open part), judges each record on its own
        (the same refusals whatever the order or company of the batch), and never refuses a
        record that ``write`` stores. Runs the default (refuses nothing) for sinks without it."""
        kit = twophase_kit
        batch = records(0, 20)
        if kit.factory.bad_value is not None:
            bad = Record(
                TOPIC, 0, 1000, record(1000).timestamp_ms, None, dict(kit.factory.bad_value)
            )
            batch.insert(7, bad)
        sink = kit.sink()

        def refused(rs: list[Record]) -> set[str]:
            return {r.record.record_id for r in sink.check(rs)}

        checked = refused(batch)  # no part open
        assert refused(batch[::-1]) == checked, "check depends on the order of the batch"
        alone = set().union(*(refused([r]) for r in batch))
        assert alone == checked, "check of a record depends on the records around it"
        part = kit.part(1)
        sink.begin(part)
        assert refused(batch) == checked
        written = {r.record.record_id for r in sink.write(part, batch)}
        assert checked <= written, f"check refused records that write stores: {checked - written}"
        sink.prepare(part, positions_of(batch))
        sink.commit(part)
        assert kit.visible() == ids([r for r in batch if r.record_id not in written])

    def test_write_raw_stores_what_write_stores(self, twophase_kit: Kit) -> None:
        """When every sink of a pipeline accepts raw values the runtime hands them JSON bytes
        (``write_raw``): exactly what ``write`` would store must be stored -- every object,
        a refused one rejected -- and every value that is not a JSON object asked for through
        ``RawBatch.record`` (that is how the runtime learns what to dead-letter). Runs the
        default ``write_raw`` (decode, then ``write``) for sinks that do not override it."""
        kit = twophase_kit
        good = records(0, 30) + records(31, 30)
        refused = []
        if kit.factory.bad_value is not None:
            bad_value = dict(kit.factory.bad_value)
            refused = [Record(TOPIC, 0, 30, record(30).timestamp_ms, None, bad_value)]
        objects = good[:30] + refused + good[30:]
        values = [orjson.dumps(r.value) for r in objects] + [b"{not json", b"[1, 2]"]
        by_index: dict[int, Record | str] = dict(enumerate(objects))

        def decode(i: int) -> Record | str:
            return by_index.get(i, f"undecodable value {i}")

        batch = RawBatch(values, decode)
        sink, part = kit.sink(), kit.part(1)
        sink.begin(part)
        rejected = list(sink.write_raw(part, batch))
        assert [r.record.record_id for r in rejected] == [r.record_id for r in refused]
        n = len(objects)
        assert batch.undecodable() == {
            n: f"undecodable value {n}",
            n + 1: f"undecodable value {n + 1}",
        }, "values that are not JSON objects must be asked for (RawBatch.record)"
        sink.prepare(part, positions_of(objects))
        sink.commit(part)
        assert kit.visible() == ids(good)

    # -- housekeeping (run only when the sink implements them) ------------------------------------

    def test_committed_positions(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        sink = kit.sink()
        if not _overridden(sink, "committed_positions"):
            pytest.skip("the sink does not implement committed_positions()")
        tp0, tp1 = (TOPIC, 0), (TOPIC, 1)
        run = kit.run
        run(sink, kit.part(1), records(0, 10), commit=True)
        run(sink, kit.part(2), records(10, 10) + records(0, 5, partition=1))
        run(sink, kit.part(3), records(20, 10))
        sink.abort(kit.part(3))
        assert sink.committed_positions() == {tp0: 10}, "positions of undecided/aborted parts"
        sink.commit(kit.part(2))
        assert sink.committed_positions() == {tp0: 20, tp1: 5}
        run(sink, kit.part(4), records(30, 10))
        run(sink, kit.part(5), records(40, 10))
        sink.commit(kit.part(5))
        sink.commit(kit.part(4))  # decisions applied out of order: positions never move back
        assert sink.committed_positions() == {tp0: 50, tp1: 5}
        assert kit.sink("w2").committed_positions() == {tp0: 50, tp1: 5}

    def test_forget_keeps_what_is_still_needed(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        sink = kit.sink()
        if not _overridden(sink, "forget"):
            pytest.skip("the sink does not implement forget()")
        kit.run(sink, kit.part(1), records(0, 10), commit=True)
        kit.run(sink, kit.part(2), records(10, 10))
        sink.abort(kit.part(2))
        kit.run(sink, kit.part(3), records(20, 10))
        last = records(30, 10)
        kit.run(sink, kit.part(4), last, commit=True)
        seen, positions = kit.visible(), sink.committed_positions()
        assert sink.forget(4) >= 1, "the marker of committed part 1 was not forgotten"
        assert sink.forget(4) == 0
        assert sink.in_doubt() == [kit.part(3)]
        assert kit.visible() == seen
        assert sink.committed_positions() == positions
        sink.commit(kit.part(3))
        sink.commit(kit.part(4))  # newer than before_txn: still idempotent
        assert kit.visible() == seen + ids(records(20, 10))

    def test_last_committed(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        sink = kit.sink()
        if not _overridden(sink, "last_committed"):
            pytest.skip("the sink does not implement last_committed()")
        assert sink.last_committed() is None, "a pipeline that committed nothing"
        started = datetime.now(UTC)
        kit.run(sink, kit.part(1), records(0, 10), commit=True)
        first = sink.last_committed()
        assert first is not None and first.part == kit.part(1)
        w2 = kit.sink("w2")
        kit.run(sink, kit.part(2), records(10, 10))
        # No positions: forget() must keep its marker for being the newest commit, not for
        # holding some partition's highest offset.
        kit.run(w2, kit.part(3, "w2"), records(0, 10, partition=1), positions={})
        w2.commit(kit.part(3, "w2"))
        # Commit times are often stamped to the millisecond: apply the older part measurably
        # later, or a sink reporting the last *applied* part could pass on a tie.
        time.sleep(0.01)
        sink.commit(kit.part(2))  # decisions applied out of order: the highest txn still wins
        kit.run(sink, kit.part(4), records(20, 10))  # stays prepared
        kit.run(sink, kit.part(5), records(30, 10))
        sink.abort(kit.part(5))  # aborted after its prepare
        kit.run(sink, kit.part(6), records(40, 10), prepare=False)  # stays open
        other = kit.pipeline + "-x"  # another pipeline's newer commit never counts
        kit.run(kit.sink(pipeline=other), kit.part(9, pipeline=other), records(0, 5), commit=True)
        last = sink.last_committed()
        assert last is not None and last.part == kit.part(3, "w2"), (
            f"newest committed part is {kit.part(3, 'w2')}, the sink says {last}"
        )
        for info in (first, last):
            if info.committed_at is not None:
                at = info.committed_at
                assert at.utcoffset() is not None
                assert started - CLOCK_SKEW <= at <= datetime.now(UTC) + CLOCK_SKEW, (
                    f"committed_at {at.isoformat()} is not the time of the commit"
                )
        if first.committed_at is not None and last.committed_at is not None:
            assert first.committed_at <= last.committed_at
        assert kit.sink("w9").last_committed() == last, "a restarted process reads it back"
        if _overridden(sink, "forget"):
            sink.forget(10**9)
            assert kit.sink("w9").last_committed() == last, "forget() dropped the newest commit"
            sink.commit(kit.part(4))
            after = sink.last_committed()
            assert after is not None and after.part == kit.part(4)


#: Every case's name, for ``known_failures`` checks.
class DeleteConformance:
    """The delete cases (change data capture, ``docs/cdc.md``): subclass it next to a
    ``twophase_sink_factory`` whose ``config`` makes the sink apply deletes keyed on the record
    value's ``id`` field (e.g. upsert mode with that key), and whose ``committed_ids`` reads the
    current state (a sink that writes change rows replays them). Keys written, changed and
    deleted in every order must leave exactly what applying the changes one by one leaves.
    """

    known_failures: ClassVar[Mapping[str, str]] = {}

    def test_the_sink_as_configured_applies_deletes(self, twophase_kit: Kit) -> None:
        assert twophase_kit.sink().supports_deletes, (
            "supports_deletes is False: the factory's config must apply deletes"
        )

    def test_a_delete_is_applied_at_commit_and_not_before(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        sink = kit.sink()
        kit.run(sink, kit.part(1), records(0, 3), commit=True)
        batch = [change(10, 0, deleted=True), change(11, 2)]
        kit.run(sink, kit.part(2), batch)
        assert kit.visible() == ids(records(0, 3)), "a prepared delete is visible"
        sink.commit(kit.part(2))
        assert kit.visible() == ids(records(1, 2))
        sink.commit(kit.part(2))  # repeated: nothing more happens
        assert kit.visible() == ids(records(1, 2))

    def test_the_last_change_of_a_key_wins_within_a_part(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        sink = kit.sink()
        kit.run(sink, kit.part(1), records(0, 4), commit=True)
        batch = [
            change(10, 0),
            change(11, 0, deleted=True),  # written then deleted: gone
            change(12, 1, deleted=True),
            change(13, 1),  # deleted then written: there
            change(14, 2, deleted=True),
            change(15, 2, deleted=True),  # deleted twice: gone
            change(16, 9),
            change(17, 9, deleted=True),
            change(18, 9),  # new, deleted, new again: there once
        ]
        part = kit.part(2)
        sink.begin(part)
        sink.write(part, batch[:4])  # the changes of a key may span writes
        sink.write(part, batch[4:])
        sink.prepare(part, positions_of(batch))
        sink.commit(part)
        assert kit.visible() == ids([records(1, 1)[0], records(3, 1)[0], records(9, 1)[0]])

    def test_a_delete_written_while_the_part_that_wrote_the_key_is_undecided(
        self, twophase_kit: Kit
    ) -> None:
        """Records keep flowing while a part is decided: the next part may delete a key the
        previous part wrote (a new row) before that part commits. The delete must hold once
        both commit -- a store that applies changes at write time must wait for the earlier
        part, or it deletes a row it cannot see yet."""
        kit = twophase_kit
        sink = kit.sink()
        kit.run(sink, kit.part(1), records(0, 2), commit=True)
        kit.run(sink, kit.part(2), [change(10, 5), change(11, 0)])  # prepared, undecided
        nxt = kit.part(3)
        started = threading.Event()

        def data_thread() -> None:
            sink.begin(nxt)
            started.set()
            sink.write(nxt, [change(12, 5, deleted=True), change(13, 0, deleted=True)])
            sink.prepare(nxt, {(TOPIC, 0): 14})

        writer = _Thread(data_thread, "kit-data-thread")
        writer.start()
        writer.wait_for(started)
        time.sleep(0.2)  # the write is under way, or waiting for part 2's decision
        sink.commit(kit.part(2))
        writer.result()
        sink.commit(nxt)
        assert kit.visible() == ids(records(1, 1)), "a delete of the previous part's key was lost"

    def test_a_delete_then_a_write_in_a_later_part_leaves_the_key(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        sink = kit.sink()
        kit.run(sink, kit.part(1), records(0, 1), commit=True)
        kit.run(sink, kit.part(2), [change(1, 0, deleted=True)], commit=True)
        assert kit.visible() == ids([])
        kit.run(sink, kit.part(3), [change(2, 0)], commit=True)
        assert kit.visible() == ids(records(0, 1))

    def test_an_aborted_delete_leaves_the_key(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        sink = kit.sink()
        kit.run(sink, kit.part(1), records(0, 2), commit=True)
        kit.run(sink, kit.part(2), [change(5, 0, deleted=True)])
        sink.abort(kit.part(2))
        kit.run(sink, kit.part(3), [change(6, 1, deleted=True)], prepare=False)
        sink.abort(kit.part(3))  # aborted while open
        assert kit.visible() == ids(records(0, 2))

    def test_a_prepared_delete_is_committed_by_a_new_instance(self, twophase_kit: Kit) -> None:
        kit = twophase_kit
        first = kit.sink()
        kit.run(first, kit.part(1), records(0, 2), commit=True)
        kit.run(first, kit.part(2), [change(5, 0, deleted=True)])
        later = kit.sink("w2")  # the process that prepared it is gone; another one decides
        assert later.in_doubt() == [kit.part(2)]
        later.commit(kit.part(2))
        assert kit.visible() == ids(records(1, 1))


CASES = frozenset(
    name
    for cls in (SinkConformance, DeleteConformance)
    for name in vars(cls)
    if name.startswith("test_")
)
