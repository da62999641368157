"""Every case of the conformance kit can fail: each one is run against sinks with a known bug.

The mutants below are the example SQLite sink with one realistic mistake each. A case passes
here when it *fails* against its mutant -- with an assertion or a sink error, not a crash of the
test code -- and the clean sink passes every case (``examples/twophase-sqlite-sink/tests``).
A kit case that no mutant breaks is a case that cannot fail, and fails the last test here.
"""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import closing, suppress
from pathlib import Path

import orjson
import pytest

from twophase.participants.sdk import (
    AbortTransactionError,
    CommittedInfo,
    FatalSinkError,
    PartId,
    PartMarker,
    PartState,
    Positions,
    RawBatch,
    Record,
    Rejected,
    RetriableSinkError,
    SinkError,
    UnknownPartError,
)
from twophase.participants.sdk.testkit import (
    CASES,
    DeleteConformance,
    Kit,
    SinkConformance,
    SinkFactory,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "twophase-sqlite-sink"
if str(EXAMPLE) not in sys.path:  # also in the kit's crashing child, which re-imports this module
    sys.path.insert(0, str(EXAMPLE))

from twophase_sqlite import SqliteSink  # noqa: E402 - needs the path above

# -- the mutants ----------------------------------------------------------------------------------


class VisibleBeforeCommit(SqliteSink):
    """Writes straight into the target: no staging."""

    def stage(self, part: PartId, records: Sequence[Record]) -> list[Rejected]:
        rejected = super().stage(part, records)
        with self._tx("write", AbortTransactionError) as db:
            db.execute(
                f"INSERT INTO {self._target} ({self._cols}) SELECT {self._cols} FROM {self._stage}"
                " WHERE _part = ?",
                (part.token,),
            )
            db.execute(f"DELETE FROM {self._stage} WHERE _part = ?", (part.token,))
        return rejected


class PublishIgnoresTheMarker(SqliteSink):
    """publish() moves the staged rows whatever the marker says and keeps them staged."""

    def publish(self, part: PartId) -> None:
        with self._tx("commit", RetriableSinkError) as db:
            found = db.execute(
                "SELECT 1 FROM twophase_parts WHERE sink = ? AND token = ?"
                " AND state IN ('prepared', 'committed')",
                (self.name, part.token),
            ).fetchone()
            if found is None:
                return
            db.execute(
                f"INSERT INTO {self._target} ({self._cols}) SELECT {self._cols} FROM {self._stage}"
                " WHERE _part = ?",
                (part.token,),
            )
            db.execute(
                "UPDATE twophase_parts SET state = 'committed' WHERE sink = ? AND token = ?",
                (self.name, part.token),
            )


class AbortKeepsStagedRows(SqliteSink):
    """discard() flips the marker but leaves the staged rows: a reused id publishes them."""

    def discard(self, part: PartId) -> None:
        with self._tx("abort", RetriableSinkError) as db:
            db.execute(
                "UPDATE twophase_parts SET state = 'aborted' WHERE sink = ? AND token = ?"
                " AND state != 'committed'",
                (self.name, part.token),
            )


class StagingNotKeyedByPart(SqliteSink):
    """publish() moves every staged row, the open part's too."""

    def publish(self, part: PartId) -> None:
        with self._tx("commit", RetriableSinkError) as db:
            found = db.execute(
                "SELECT 1 FROM twophase_parts WHERE sink = ? AND token = ? AND state = 'prepared'",
                (self.name, part.token),
            ).fetchone()
            if found is None:
                return
            db.execute(
                f"INSERT INTO {self._target} ({self._cols}) SELECT {self._cols} FROM {self._stage}"
            )
            db.execute(f"DELETE FROM {self._stage}")
            db.execute(
                "UPDATE twophase_parts SET state = 'committed' WHERE sink = ? AND token = ?",
                (self.name, part.token),
            )


class StagedInMemory(SqliteSink):
    """Keeps the batches in the process: a prepare that does not survive it."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._memory: dict[str, list[Record]] = {}

    def stage(self, part: PartId, records: Sequence[Record]) -> list[Rejected]:
        self._memory.setdefault(part.token, []).extend(records)
        return []

    def discard(self, part: PartId) -> None:
        self._memory.pop(part.token, None)
        super().discard(part)

    def publish(self, part: PartId) -> None:
        super().stage(part, self._memory.pop(part.token, []))
        super().publish(part)


class InDoubtOwnParticipantOnly(SqliteSink):
    """in_doubt() lists this participant's parts only: nobody finishes a dead one's work."""

    def in_doubt(self) -> list[PartId]:
        return [p for p in super().in_doubt() if p.participant == self.context.participant]


class InDoubtEveryPipeline(SqliteSink):
    """in_doubt() matches the pipeline by prefix: it finishes other pipelines' parts."""

    def in_doubt(self) -> list[PartId]:
        rows = self._query(
            "SELECT token FROM twophase_parts WHERE sink = ? AND state = 'prepared'", self.name
        )
        pipeline = self.context.pipeline
        return sorted(
            PartId.parse(t)
            for (t,) in rows
            if pipeline.startswith(PartId.parse(t).pipeline) or t.startswith(pipeline)
        )


class CommitOfUnknownIsSilent(SqliteSink):
    def commit(self, part: PartId) -> None:
        with suppress(UnknownPartError):
            super().commit(part)


class AbortOfCommittedIsSilent(SqliteSink):
    def abort(self, part: PartId) -> None:
        with suppress(FatalSinkError):
            super().abort(part)


class AbortOnlyWhatItPrepared(SqliteSink):
    """abort() ignores parts this instance did not prepare: recovery cannot abort them."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._mine: set[PartId] = set()

    def begin(self, part: PartId) -> None:
        super().begin(part)
        self._mine.add(part)

    def abort(self, part: PartId) -> None:
        if part in self._mine:
            super().abort(part)


class BeginAbortsTheOpenPart(SqliteSink):
    """begin() while a part is open silently drops that part."""

    def begin(self, part: PartId) -> None:
        with self._guard:
            current = self._open
        if current is not None:
            self.abort(current.part)
        super().begin(part)


class BeginOfCommittedIsSilent(SqliteSink):
    """begin() of a committed part does nothing, and the writes that follow go nowhere."""

    def begin(self, part: PartId) -> None:
        marker = self.load_marker(part)
        if marker is None or marker.state != "committed":
            super().begin(part)


class PrepareIsNotRepeatable(SqliteSink):
    def prepare(self, part: PartId, positions: Positions) -> None:
        with self._guard:
            is_open = self._open is not None and self._open.part == part
        if not is_open:
            raise AbortTransactionError(f"prepare: {part.token} is not open", sink=self.name)
        super().prepare(part, positions)


class OneStatementPerBatch(SqliteSink):
    """One multi-row INSERT per batch: past 32766 values (SQLite's default limit; this build's
    may be higher) SQLite refuses it, and one refused row takes the whole batch with it."""

    def stage(self, part: PartId, records: Sequence[Record]) -> list[Rejected]:
        if not records:
            return []
        if self._db is not None:
            self._db.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 32766)
        width = len(self.cfg.columns) + 1
        values = ", ".join(["(" + ", ".join("?" * width) + ")"] * len(records))
        params = [
            v for r in records for v in (part.token, *(r.value.get(c) for c in self.cfg.columns))
        ]
        with self._tx("write", AbortTransactionError) as db:
            db.execute(f"INSERT INTO {self._stage} (_part, {self._cols}) VALUES {values}", params)
        return []


class StopsAtTheFirstRefusal(SqliteSink):
    """Rejects the refused record and silently drops the rest of its batch."""

    def stage(self, part: PartId, records: Sequence[Record]) -> list[Rejected]:
        kept: list[Record] = []
        for r in records:
            rejected = super().stage(part, [r])
            if rejected:
                return list(rejected)
            kept.append(r)
        return []


class StaleListsLiveParts(SqliteSink):
    def stale_parts(self, before_txn: int) -> list[PartId]:
        return sorted(self.list_parts("open"))


class PositionsMoveBack(SqliteSink):
    """Stores the last committed part's positions, not the highest."""

    def publish(self, part: PartId) -> None:
        marker = self.load_marker(part)
        super().publish(part)
        if marker is not None and marker.state == "prepared":
            with self._tx("commit", RetriableSinkError) as db:
                for (topic, partition), offset in marker.positions.items():
                    db.execute(
                        "UPDATE twophase_positions SET next = ? WHERE sink = ? AND pipeline = ?"
                        " AND topic = ? AND partition = ?",
                        (offset, self.name, part.pipeline, topic, partition),
                    )


class ForgetsPreparedParts(SqliteSink):
    def forget(self, before_txn: int) -> int:
        with self._tx("forget", RetriableSinkError) as db:
            return db.execute(
                "DELETE FROM twophase_parts WHERE sink = ? AND pipeline = ? AND txn < ?",
                (self.name, self.context.pipeline, before_txn),
            ).rowcount


class LastCommittedIsTheLastApplied(SqliteSink):
    """Reports the part committed most recently, not the highest transaction."""

    def last_committed(self) -> CommittedInfo | None:
        rows = self._query(
            "SELECT token FROM twophase_parts WHERE sink = ? AND pipeline = ?"
            " AND state = 'committed' ORDER BY committed_at DESC, rowid DESC LIMIT 1",
            self.name,
            self.context.pipeline,
        )
        return CommittedInfo(PartId.parse(rows[0][0])) if rows else None


class LastCommittedCountsEveryMarker(SqliteSink):
    """Takes the highest marker whatever its state: prepared and aborted parts count."""

    def last_committed(self) -> CommittedInfo | None:
        rows = self._query(
            "SELECT token FROM twophase_parts WHERE sink = ? AND pipeline = ?"
            " ORDER BY txn DESC LIMIT 1",
            self.name,
            self.context.pipeline,
        )
        return CommittedInfo(PartId.parse(rows[0][0])) if rows else None


class LastCommittedFromMemory(SqliteSink):
    """Remembers what this instance committed: a restarted process knows nothing."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._newest: CommittedInfo | None = None

    def commit(self, part: PartId) -> None:
        super().commit(part)
        if self._newest is None or part.txn > self._newest.txn:
            self._newest = CommittedInfo(part)

    def last_committed(self) -> CommittedInfo | None:
        return self._newest


class ForgetDropsTheLastCommitted(SqliteSink):
    """forget() deletes every decided marker below before_txn, the newest committed one too."""

    def forget(self, before_txn: int) -> int:
        with self._tx("forget", RetriableSinkError) as db:
            return db.execute(
                "DELETE FROM twophase_parts WHERE sink = ? AND pipeline = ? AND txn < ?"
                " AND state IN ('committed', 'aborted')",
                (self.name, self.context.pipeline, before_txn),
            ).rowcount


class SaveMarkerIgnoresExpect(SqliteSink):
    """save_marker() without the compare-and-set: a part aborted by another process as stale
    is prepared anyway, with its staged rows gone."""

    def save_marker(self, marker: PartMarker, *, expect: Collection[PartState | None]) -> bool:
        return super().save_marker(
            marker, expect=(None, "open", "prepared", "aborted", "committed")
        )


class RawSkipsWhatItCannotRead(SqliteSink):
    """write_raw that decodes the values itself and silently drops those it cannot read,
    never asking RawBatch.record -- the runtime would never dead-letter them."""

    def accepts_raw(self) -> bool:
        return True

    def write_raw(self, part: PartId, batch: RawBatch) -> Sequence[Rejected]:
        records = []
        for i, value in enumerate(batch.values):
            with suppress(orjson.JSONDecodeError):
                if isinstance(orjson.loads(value), dict):
                    record = batch.record(i)
                    assert record is not None
                    records.append(record)
        return self.write(part, records)


class RawForgetsRejections(SqliteSink):
    """write_raw that stores what the batch decodes but returns no rejection: the records the
    store refused would vanish instead of reaching the dead-letter topic."""

    def accepts_raw(self) -> bool:
        return True

    def write_raw(self, part: PartId, batch: RawBatch) -> Sequence[Rejected]:
        self.write(part, batch.records())
        return []


class CheckRefusesByCompany(SqliteSink):
    """A check with its own copy of the rules, judging a record by the batch around it: after
    the first record it sees, anything with a different text prefix is "not like the others"
    (the files sink's old schema inference did this)."""

    def check(self, records: Sequence[Record]) -> Sequence[Rejected]:
        first = records[0].value.get("text", "")[:3] if records else ""
        return [Rejected(r, "unlike the first") for r in records if r.value["text"][:3] != first]


class CheckRefusesWhatWriteStores(SqliteSink):
    """A check stricter than write (a second, drifted copy of the rules)."""

    def check(self, records: Sequence[Record]) -> Sequence[Rejected]:
        return [Rejected(r, "odd") for r in records if r.value.get("n", 0) % 2]


class CheckStages(SqliteSink):
    """A check that writes: it stages what it accepts into the open part."""

    def check(self, records: Sequence[Record]) -> Sequence[Rejected]:
        if self._open_part is not None:
            self.stage(self._open_part, records)
        return []

    _open_part: PartId | None = None

    def begin(self, part: PartId) -> None:
        super().begin(part)
        self._open_part = part


# -- mutants of the sink with ``key`` (deletes) ------------------------------------------------


class SaysItCannotDelete(SqliteSink):
    @property
    def supports_deletes(self) -> bool:
        return False


class DeletesRightAway(SqliteSink):
    """A delete removes the row when it is written, not at commit."""

    def stage(self, part: PartId, records: Sequence[Record]) -> list[Rejected]:
        with self._tx("write", AbortTransactionError) as db:
            for r in records:
                if r.deleted:
                    db.execute(f'DELETE FROM {self._target} WHERE "id" = ?', (r.value["id"],))
        return super().stage(part, [r for r in records if not r.deleted])


class DeletesAfterWrites(SqliteSink):
    """The commit applies the part's writes, then its deletes: the order within a part is lost."""

    def _apply(self, db: sqlite3.Connection, part: PartId) -> None:
        t = (part.token,)
        db.execute(f'DELETE FROM {self._target} WHERE "id" IN (SELECT "id" FROM {self._stage}'
                   " WHERE _part = ?)", t)  # fmt: skip
        db.execute(f"INSERT INTO {self._target} ({self._cols}) SELECT {self._cols}"
                   f" FROM {self._stage} s WHERE _part = ?1 AND _seq = (SELECT max(_seq)"
                   f' FROM {self._stage} WHERE _part = ?1 AND "id" = s."id")', t)  # fmt: skip
        db.execute(f'DELETE FROM {self._target} WHERE "id" IN (SELECT _key FROM {self._deletes}'
                   " WHERE _part = ?)", t)  # fmt: skip


class DeletedKeysStayDeleted(SqliteSink):
    """A delete leaves a tombstone that nothing ever clears: the key can never come back."""

    def _apply(self, db: sqlite3.Connection, part: PartId) -> None:
        db.execute("CREATE TABLE IF NOT EXISTS gone (_key PRIMARY KEY)")
        super()._apply(db, part)
        db.execute('DELETE FROM "orders" WHERE "id" IN (SELECT _key FROM gone)')
        db.execute(f"INSERT OR IGNORE INTO gone SELECT _key FROM {self._deletes} WHERE _part = ?",
                   (part.token,))  # fmt: skip


class DeletesInMemory(SqliteSink):
    """Deletes are kept by the process until the commit: a new instance never applies them."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._held: dict[str, list[Record]] = {}

    def stage(self, part: PartId, records: Sequence[Record]) -> list[Rejected]:
        self._held.setdefault(part.token, []).extend(r for r in records if r.deleted)
        return super().stage(part, [r for r in records if not r.deleted])

    def _apply(self, db: sqlite3.Connection, part: PartId) -> None:
        super()._apply(db, part)
        for r in self._held.pop(part.token, []):
            db.execute(f'DELETE FROM {self._target} WHERE "id" = ?', (r.value["id"],))


#: mutant -> the cases it must fail ("name[param]" for one parameter of a parametrized case).
MUTANTS: dict[type[SqliteSink], set[str]] = {
    VisibleBeforeCommit: {
        "test_commit_publishes_the_part_exactly_once",
        "test_nothing_of_open_prepared_or_aborted_parts_is_visible",
        "test_abort_is_idempotent",
        "test_abort_after_restart",
    },
    PublishIgnoresTheMarker: {
        "test_commit_is_idempotent",
        "test_replay_of_a_committed_part_changes_nothing",
        "test_forget_keeps_what_is_still_needed",
    },
    AbortKeepsStagedRows: {
        "test_begin_after_abort_of_the_open_part_reuses_its_id",
        "test_crash_between_prepare_and_decision[commit]",
        "test_crash_between_prepare_and_decision[abort]",
    },
    StagingNotKeyedByPart: {"test_next_part_is_written_while_the_previous_is_decided"},
    StagedInMemory: {
        "test_commit_after_restart",
        "test_crash_between_prepare_and_decision[commit]",
        "test_refused_record_comes_back_rejected_and_the_rest_commit",
    },
    InDoubtOwnParticipantOnly: {
        "test_in_doubt_is_exact",
        "test_crash_between_prepare_and_decision[abort]",
    },
    InDoubtEveryPipeline: {"test_in_doubt_is_exact"},
    CommitOfUnknownIsSilent: {"test_commit_of_an_unknown_or_aborted_part_raises"},
    AbortOfCommittedIsSilent: {"test_abort_of_a_committed_part_raises"},
    AbortOnlyWhatItPrepared: {
        "test_abort_after_restart",
        "test_crash_between_prepare_and_decision[abort]",
    },
    BeginAbortsTheOpenPart: {"test_begin_while_another_part_is_open_raises"},
    BeginOfCommittedIsSilent: {"test_replay_of_a_committed_part_changes_nothing"},
    PrepareIsNotRepeatable: {"test_prepare_repeated_with_same_positions_is_a_noop"},
    OneStatementPerBatch: {
        "test_large_batch",
        "test_refused_record_comes_back_rejected_and_the_rest_commit",
    },
    StopsAtTheFirstRefusal: {"test_refused_record_comes_back_rejected_and_the_rest_commit"},
    StaleListsLiveParts: {"test_stale_parts_never_lists_a_live_part"},
    PositionsMoveBack: {"test_committed_positions"},
    ForgetsPreparedParts: {"test_forget_keeps_what_is_still_needed"},
    LastCommittedIsTheLastApplied: {"test_last_committed"},
    LastCommittedCountsEveryMarker: {"test_last_committed"},
    LastCommittedFromMemory: {"test_last_committed"},
    ForgetDropsTheLastCommitted: {"test_last_committed"},
    RawSkipsWhatItCannotRead: {"test_write_raw_stores_what_write_stores"},
    RawForgetsRejections: {"test_write_raw_stores_what_write_stores"},
    CheckRefusesByCompany: {"test_check_refuses_only_what_write_refuses_and_writes_nothing"},
    CheckRefusesWhatWriteStores: {"test_check_refuses_only_what_write_refuses_and_writes_nothing"},
    CheckStages: {"test_check_refuses_only_what_write_refuses_and_writes_nothing"},
}
#: The mutants of DeleteConformance's cases: the sink configured with ``key: id``.
DELETE_MUTANTS: dict[type[SqliteSink], set[str]] = {
    SaysItCannotDelete: {"test_the_sink_as_configured_applies_deletes"},
    DeletesRightAway: {
        "test_a_delete_is_applied_at_commit_and_not_before",
        "test_an_aborted_delete_leaves_the_key",
        "test_a_delete_written_while_the_part_that_wrote_the_key_is_undecided",
    },
    DeletesAfterWrites: {"test_the_last_change_of_a_key_wins_within_a_part"},
    DeletedKeysStayDeleted: {"test_a_delete_then_a_write_in_a_later_part_leaves_the_key"},
    DeletesInMemory: {"test_a_prepared_delete_is_committed_by_a_new_instance"},
}
MUTANTS.update(DELETE_MUTANTS)


def _factory(path: Path, sink_class: type[SqliteSink]) -> SinkFactory:
    def committed_ids() -> list[str]:
        with closing(sqlite3.connect(path)) as db:
            return [row[0] for row in db.execute('SELECT id FROM "orders"')]

    return SinkFactory(
        sink_class=sink_class,
        config={
            "name": "orders-db",
            "type": "sqlite",
            "path": str(path),
            "table": "orders",
            "columns": {"id": "TEXT NOT NULL", "n": "INTEGER CHECK (n >= 0)", "text": "TEXT"},
            "key": "id" if sink_class in DELETE_MUTANTS else None,
        },
        committed_ids=committed_ids,
        bad_value={"id": "refused", "n": -1, "text": "x"},
    )


def _case(name: str) -> tuple[str, tuple[str, ...]]:
    base, _, param = name.partition("[")
    return base, (param.rstrip("]"),) if param else ()


@pytest.fixture
def run_case(tmp_path: Path) -> Iterator[Callable[[type[SqliteSink], str], None]]:
    kits: list[Kit] = []

    def run(sink_class: type[SqliteSink], name: str) -> None:
        kit = Kit(_factory(tmp_path / f"{sink_class.__name__}.db", sink_class))
        kits.append(kit)
        base, args = _case(name)
        suite = DeleteConformance() if sink_class in DELETE_MUTANTS else SinkConformance()
        getattr(suite, base)(kit, *args)

    yield run
    for kit in kits:
        kit.cleanup()


@pytest.mark.parametrize(
    ("mutant", "case"),
    [(m, c) for m, cases in MUTANTS.items() for c in sorted(cases)],
    ids=[f"{m.__name__}-{c}" for m, cases in MUTANTS.items() for c in sorted(cases)],
)
def test_case_fails_against_a_broken_sink(
    run_case: Callable[[type[SqliteSink], str], None], mutant: type[SqliteSink], case: str
) -> None:
    # pytest.fail.Exception: a pytest.raises inside the case that saw nothing raised.
    with pytest.raises((AssertionError, SinkError, pytest.fail.Exception)):
        run_case(mutant, case)


def test_prepare_racing_a_stale_part_abort_is_caught(tmp_path: Path) -> None:
    """Not a kit case (it needs a hook between two calls), but the reason save_marker is a
    compare-and-set: a stale-part abort by another process must win over a late prepare."""
    for sink_class, should_hold in ((SqliteSink, True), (SaveMarkerIgnoresExpect, False)):
        kit = Kit(_factory(tmp_path / f"{sink_class.__name__}.db", sink_class))
        try:
            slow, sweeper = kit.sink("w1"), kit.sink("w2")
            part = kit.part(1)
            slow.begin(part)
            slow.write(part, [Record("t", 0, 0, 0, None, {"id": "a", "n": 1, "text": ""})])
            assert sweeper.stale_parts(2) == [part]
            sweeper.abort(part)  # the writer looked dead to the runtime
            try:
                slow.prepare(part, {("t", 0): 1})
                prepared = True
            except AbortTransactionError:
                prepared = False
            assert prepared is not should_hold
        finally:
            kit.cleanup()


def test_every_case_has_a_mutant_that_fails_it() -> None:
    covered = {_case(c)[0] for cases in MUTANTS.values() for c in cases}
    assert covered == CASES, f"cases no mutant breaks: {sorted(CASES - covered)}"
