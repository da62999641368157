"""The control-topic reader rules (PROTOCOL.md "Reader rules", issue #14), case by case:
a tag of any bytes is a bad_auth skip, a field outside its schema is malformed, and a DECISION
nothing led to is an out_of_sequence skip for participants and a recovering coordinator alike.
``test_control_fuzz.py`` checks the same rules over generated input."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

import twophase.coordinator.machine as cm
import twophase.participants.machine as pm
from tests.unit.control_run import KEY, PIPELINE, fold, recover, valid_run, wire
from twophase.protocol.codec import AUTH_HEADER, DecodeError, _mac, decode, encode, new_envelope
from twophase.protocol.logview import LogView
from twophase.protocol.messages import (
    Checkpoint,
    Decision,
    Envelope,
    Outcome,
    Part,
    Prepare,
)


def _signed(raw: dict[str, Any]) -> tuple[bytes, list[tuple[str, bytes]]]:
    value = json.dumps(raw).encode()  # json, not orjson: it writes integers past 64 bits too
    return value, [(AUTH_HEADER, _mac(KEY, value).encode())]


def _raw(payload: Prepare | Decision) -> dict[str, Any]:
    value, _ = encode(new_envelope(PIPELINE, "coordinator:x", payload), KEY)
    return dict(orjson.loads(value))


def _kind(value: Any, headers: Any) -> str:
    with pytest.raises(DecodeError) as caught:
        decode(value, headers, key=KEY, pipeline=PIPELINE)
    return caught.value.kind


# -- bad_auth ---------------------------------------------------------------------------------

VALUE, HEADERS = encode(new_envelope(PIPELINE, "coordinator:x", Prepare(1, 0)), KEY)
TAG = HEADERS[0][1]


@pytest.mark.parametrize(
    "headers",
    [
        [(AUTH_HEADER, b"\xff\xfe\x00")],  # made compare_digest raise TypeError
        [(AUTH_HEADER, TAG.decode().upper().encode())],
        [(AUTH_HEADER, None)],
        [(AUTH_HEADER, b"")],
        [(AUTH_HEADER, b"\x00" * 100_000)],
        [(AUTH_HEADER, TAG.decode())],  # text, not bytes
        [(AUTH_HEADER, TAG), (AUTH_HEADER, TAG)],  # a writer sends exactly one
        [(AUTH_HEADER, TAG, b"extra")],
        [AUTH_HEADER],
        [None, 3, b"x"],
        [],
        None,
        "not a list",
    ],
)
def test_any_tag_or_header_list_is_a_bad_auth_skip(headers: Any) -> None:
    assert _kind(VALUE, headers) == "bad_auth"


def test_the_right_tag_among_other_headers_passes_and_bytes_keys_count_too() -> None:
    for headers in ([("x", None), (AUTH_HEADER, TAG)], [(AUTH_HEADER.encode(), TAG)]):
        assert decode(VALUE, headers, key=KEY, pipeline=PIPELINE).payload == Prepare(1, 0)


# -- malformed: types and ranges --------------------------------------------------------------


PREPARE = _raw(Prepare(5, 0))
DECISION = _raw(Decision(5, Outcome.COMMIT, (Part("p", 1, ("pg",)),)))


def _with(base: dict[str, Any], **payload: Any) -> dict[str, Any]:
    return {**base, "payload": {**base["payload"], **payload}}


@pytest.mark.parametrize(
    "raw",
    [
        _with(PREPARE, txn=3.7),  # was read as 3
        _with(PREPARE, txn=1e300),  # was read as a 301-digit integer
        _with(PREPARE, txn=3.0),
        _with(PREPARE, txn=True),
        _with(PREPARE, txn="3"),
        _with(PREPARE, txn=None),
        _with(PREPARE, txn=0),  # txn >= 1
        _with(PREPARE, txn=2**63),  # beyond 64 bits
        _with(PREPARE, txn=2**70),
        _with(PREPARE, deadline_ms=-1),
        {**PREPARE, "version": "1"},  # was read as 1
        {**PREPARE, "version": 1.0},
        {**PREPARE, "version": True},
        {**PREPARE, "type": "1"},
        {**PREPARE, "id": 7},
        {**PREPARE, "id": ""},
        {**PREPARE, "ts": -5},
        {**PREPARE, "ts": 1.5},
        {**PREPARE, "sender": ["x"]},
        {**PREPARE, "payload": [1]},
        _with(DECISION, outcome=["commit"]),
        _with(DECISION, outcome="maybe"),
        _with(DECISION, parts={"p": 1}),
        _with(DECISION, parts=[7]),
        _with(DECISION, parts=[{"participant": "p", "generation": 1.5, "sinks": []}]),
        _with(DECISION, parts=[{"participant": "p", "generation": -2, "sinks": []}]),
        _with(DECISION, parts=[{"participant": "p", "generation": 1, "sinks": "pg"}]),
        _with(DECISION, parts=[{"participant": "p", "generation": 1, "sinks": [1]}]),
        _with(DECISION, parts=[{"participant": 5, "generation": 1, "sinks": []}]),
        _with(DECISION, positions=[{"topic": "t", "partition": 0, "offset": -1}]),
        _with(DECISION, positions=[{"topic": "", "partition": 0, "offset": 1}]),
        _with(DECISION, positions=[{"topic": "t", "partition": False, "offset": 1}]),
        _with(DECISION, reason=7),
    ],
)
def test_a_signed_value_the_schema_forbids_is_malformed(raw: dict[str, Any]) -> None:
    assert _kind(*_signed(raw)) == "malformed"


def test_unknown_fields_are_still_ignored_and_future_versions_still_counted_as_such() -> None:
    raw = {**_with(PREPARE, extra={"any": [1.5, None]}), "new_field": 2**70}
    assert decode(*_signed(raw), key=KEY, pipeline=PIPELINE).payload == Prepare(5, 0)
    assert _kind(*_signed({**PREPARE, "version": 2})) == "future_version"
    assert _kind(*_signed({**PREPARE, "type": 99})) == "unknown_type"


# -- out_of_sequence --------------------------------------------------------------------------


def _env(payload: Prepare | Decision | Checkpoint) -> Envelope:
    return Envelope("id", PIPELINE, "test", 0, payload)


def test_a_decision_never_prepared_and_not_next_is_out_of_sequence() -> None:
    view = LogView()
    for msg in (Prepare(1, 0), Decision(1, Outcome.ABORT), Prepare(2, 0)):
        assert view.apply(_env(msg))
    assert view.out_of_sequence(Decision(566, Outcome.ABORT))
    assert not view.apply(_env(Decision(566, Outcome.ABORT)))
    assert (view.last_txn, view.last_decided, view.undecided) == (2, 1, {2})
    assert not view.out_of_sequence(Decision(2, Outcome.COMMIT))  # prepared
    assert not view.out_of_sequence(Decision(3, Outcome.ABORT))  # its PREPARE failed to land
    assert not view.out_of_sequence(Decision(1, Outcome.COMMIT))  # a replay: ignored anyway


def test_after_a_checkpoint_the_next_decision_is_in_sequence_without_its_prepare() -> None:
    view = LogView()
    assert view.apply(_env(Checkpoint(40)))
    assert view.apply(_env(Decision(41, Outcome.COMMIT, (Part("p", 1),))))
    assert view.last_decided == 41
    assert not view.apply(_env(Decision(43, Outcome.ABORT)))


def test_the_participant_skips_it_counts_it_and_keeps_voting() -> None:
    run = valid_run(3)
    part = run.part
    acts = part.handle(pm.Received(wire(Decision(566, Outcome.ABORT), "coordinator:forged")))
    assert [type(a) for a in acts] == [pm.Skipped] and acts[0].kind == "out_of_sequence"
    assert part.log.last_decided == 3
    part.handle(pm.WillWrite())
    asked = part.handle(pm.Received(wire(Prepare(4, 0), "coordinator:c")))
    assert asked == [pm.PreparePart(4)]


def test_a_prepare_at_or_below_the_last_decided_is_said_not_silent() -> None:
    run = valid_run(3)
    acts = run.part.handle(pm.Received(wire(Prepare(2, 0), "coordinator:c")))
    assert [(type(a), a.level) for a in acts] == [(pm.Log, "warning")]  # type: ignore[union-attr]
    assert "decided" in acts[0].message  # type: ignore[union-attr]


def test_a_recovering_coordinator_skips_it_and_numbers_on_from_the_real_log() -> None:
    run = valid_run(3)
    forged = wire(Decision(566, Outcome.ABORT), "coordinator:forged")
    coord, refused = recover([*run.log, forged])
    assert refused == ["out_of_sequence"]
    assert coord.log.last_decided == 3
    acts = coord.handle(cm.Tick(10))
    assert [a.payload for a in acts if isinstance(a, cm.Publish)] == [Prepare(4, 10_010)]


def test_every_reader_of_a_valid_run_refuses_nothing() -> None:
    run = valid_run(12)
    assert run.skipped == [] and run.coord.committed == 12
    assert recover(run.log)[1] == []
    assert fold(run.log).last_decided == 12


def test_a_checkpoint_or_prepare_from_nowhere_is_out_of_sequence_too() -> None:
    view = LogView(prepare_in_sequence=True)
    for msg in (Prepare(1, 0), Decision(1, Outcome.ABORT)):
        assert view.apply(_env(msg))
    assert not view.apply(_env(Checkpoint(566)))  # claims decisions this reader never saw
    assert not view.apply(_env(Prepare(566, 0)))
    assert (view.last_txn, view.last_decided) == (1, 1)
    assert view.apply(_env(Checkpoint(1)))  # what a coordinator writes after decision 1
    assert view.apply(_env(Prepare(2, 0)))
    # The first message a reader folds is where it starts: any number is fine there.
    assert LogView(prepare_in_sequence=True).apply(_env(Checkpoint(40)))
    assert LogView(prepare_in_sequence=True).apply(_env(Decision(41, Outcome.ABORT)))
    # A Spark driver numbers by batch id (a direct call may pass any): no PREPARE check there.
    spark = LogView()
    assert spark.apply(_env(Prepare(1, 0))) and spark.apply(_env(Decision(1, Outcome.ABORT)))
    assert spark.apply(_env(Prepare(9, 0))) and spark.apply(_env(Decision(9, Outcome.ABORT)))


def test_a_participant_does_not_cut_a_prepare_from_nowhere_and_votes_on_the_real_one() -> None:
    run = valid_run(3)
    part = run.part
    part.handle(pm.WillWrite())
    acts = part.handle(pm.Received(wire(Prepare(566, 0), "coordinator:forged")))
    assert [type(a) for a in acts] == [pm.Skipped] and acts[0].kind == "out_of_sequence"
    assert part.handle(pm.Received(wire(Prepare(4, 0), "coordinator:c"))) == [pm.PreparePart(4)]
