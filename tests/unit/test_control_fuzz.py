"""Property-based fuzzing of the control-topic reader (issue #14), inside the normal test run.

(a) Any value bytes and any header list: the codec raises nothing but a counted DecodeError, and
    whatever it does decode the machines take without raising.
(b) Schema-shaped messages whose fields hold random values (wrong types, out of range, floats
    and strings for integers, bools, huge numbers), signed with the pipeline's key: a field the
    schema forbids is ``malformed``; decoded fields have their schema types; and slipped into a
    valid commit run, nothing raises, no reader's last decided transaction passes a prepared
    one, and the run still commits every cycle.
(c) The same messages through the writer's schema check (``codec.validate``, compiled): it
    refuses exactly what Python's ``jsonschema`` refuses over the same schema files.

Reproducible by construction: ``derandomize=True`` draws the same examples on every run and
machine, and no example database is read or written. A failure prints the falsifying example;
replay it with ``.venv/bin/python -m pytest tests/unit/test_control_fuzz.py -k <test>`` (the
same examples come back), or pin it with ``@example(...)`` above the test. Budget: a few
seconds in all.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import cache
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

import twophase.coordinator.machine as cm
import twophase.participants.machine as pm
from tests.unit.control_run import KEY, PIPELINE, recover, valid_run
from twophase.errors import ProtocolError
from twophase.protocol.codec import (
    _SCHEMA_FILES,
    AUTH_HEADER,
    DecodeError,
    _mac,
    decode,
    schema_dir,
    validate,
)
from twophase.protocol.messages import (
    INT_MAX,
    Checkpoint,
    Envelope,
)

#: Every kind a reader counts; anything else escaping decode is a crash of the process.
KINDS = {"malformed", "unknown_type", "future_version", "bad_auth", "foreign_pipeline"}

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- (a) any bytes, any headers ---------------------------------------------------------------

header_names = st.sampled_from([AUTH_HEADER, AUTH_HEADER.encode(), "x", "", None, 7])
header_values = st.one_of(
    st.binary(max_size=80), st.none(), st.text(max_size=20), st.integers(), st.just(b"\xff\xfe\x00")
)
headers = st.one_of(
    st.none(),
    st.lists(
        st.one_of(
            st.tuples(header_names, header_values),
            st.tuples(header_names, header_values, header_values),
            st.none(),
            st.integers(),
            st.binary(max_size=8),
        ),
        max_size=5,
    ),
)


def _decode(value: Any, hdrs: Any, key: bytes | None) -> Envelope | None:
    try:
        return decode(value, hdrs, key=key, pipeline=PIPELINE)
    except DecodeError as exc:
        assert exc.kind in KINDS, exc
        return None


def _feed_everyone(env: Envelope) -> None:
    """Hand a decoded message to a participant mid-run and to a coordinator, live and
    recovering: none may raise."""
    run = valid_run(2)
    for replay in (False, True):
        run.part.handle(pm.Received(env, replay=replay))
    run.coord.handle(cm.Received(env, run.now))
    recover([*run.log, env])


@FUZZ
@given(value=st.one_of(st.binary(max_size=300), st.none()), hdrs=headers)
def test_any_bytes_and_any_headers_raise_only_counted_kinds(value: Any, hdrs: Any) -> None:
    for key in (KEY, None):
        env = _decode(value, hdrs, key)
        if env is not None:
            _feed_everyone(env)


@FUZZ
@given(hdrs=headers, tail=st.binary(max_size=40))
def test_any_headers_around_a_signed_message_raise_only_counted_kinds(
    hdrs: Any, tail: bytes
) -> None:
    value = json.dumps({"id": "a", "type": 1, "version": 1, "ts": 0, "pipeline": PIPELINE,
                        "sender": "s", "payload": {"txn": 1, "deadline_ms": 0}}).encode()  # fmt: skip
    tag = _mac(KEY, value).encode()
    as_list = list(hdrs) if isinstance(hdrs, list) else []
    for candidate in ([*as_list, (AUTH_HEADER, tag)], [(AUTH_HEADER, tag + tail), *as_list]):
        _decode(value, candidate, KEY)


# -- (b) schema-shaped messages, random field values ------------------------------------------

weird = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, INT_MAX, INT_MAX + 1, 2**64, True, False, 3.7, 3.0, 1e300, -0.0]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=10),
    st.sampled_from(["1", "commit", "abort", "prepared", "p", "src", PIPELINE]),
    st.none(),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _maybe(value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field's own kind of value; ``messages`` then makes one or more fields anything at all."""
    return value


txns = _maybe(st.integers(min_value=1, max_value=40))
ints = _maybe(st.integers(min_value=-1, max_value=50))
names = _maybe(st.sampled_from(["p", "q", "src", "pg"]))
position = st.fixed_dictionaries({"topic": names, "partition": ints, "offset": ints})
part = st.fixed_dictionaries(
    {"participant": names, "generation": ints, "sinks": _maybe(st.lists(names, max_size=2))}
)
payloads: dict[int, st.SearchStrategy[dict[str, Any]]] = {
    1: st.fixed_dictionaries({"txn": txns, "deadline_ms": ints}),
    2: st.fixed_dictionaries(
        {
            "txn": txns,
            "participant": names,
            "generation": ints,
            "member_id": names,
            "vote": _maybe(st.sampled_from(["prepared", "abort"])),
            "partitions": _maybe(
                st.lists(
                    st.fixed_dictionaries(
                        {"topic": names, "partition": ints, "start": ints, "end": ints},
                        optional={"records": ints, "dead_lettered": ints},
                    ),
                    max_size=2,
                )
            ),
            "sinks": _maybe(st.lists(names, max_size=2)),
        }
    ),
    3: st.fixed_dictionaries(
        {
            "txn": txns,
            "outcome": _maybe(st.sampled_from(["commit", "abort"])),
            "parts": _maybe(st.lists(part, max_size=2)),
            "positions": _maybe(st.lists(position, max_size=2)),
        },
        optional={"reason": names},
    ),
    4: st.fixed_dictionaries({"txn": txns, "part": names, "applied_by": names}),
    5: st.fixed_dictionaries({"txn": txns}),
    6: st.fixed_dictionaries(
        {
            "last_txn": txns,
            "positions": _maybe(st.lists(position, max_size=2)),
            "pending": _maybe(
                st.lists(
                    st.fixed_dictionaries(
                        {"txn": txns, "parts": st.lists(part, max_size=1), "acked": st.just([])}
                    ),
                    max_size=1,
                )
            ),
        }
    ),
}


def _paths(obj: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON document a value sits: fields, list items, nested ones."""
    found: list[tuple[Any, ...]] = [at] if at else []
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    )
    for k, v in items:
        found += _paths(v, (*at, k))
    return found


@st.composite
def messages(draw: st.DrawFn) -> dict[str, Any]:
    """A valid message with a few of its values (a field, a list, an item) made anything at
    all: mostly one, so the reader meets each wrong value on its own too."""
    mtype = draw(st.sampled_from(sorted(payloads)))
    msg: dict[str, Any] = {
        "id": "m1",
        "type": mtype,
        "version": 1,
        "ts": draw(st.integers(min_value=0, max_value=10**12)),
        "pipeline": PIPELINE,
        "sender": "coordinator:fuzz",
        "payload": draw(payloads[mtype]),
    }
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 1, 2, 3]))):
        paths = [p for p in _paths(msg) if p != ("pipeline",)]
        *parent, last = draw(st.sampled_from(paths))
        holder: Any = msg
        for key in parent:
            holder = holder[key]
        holder[last] = draw(weird)
    return msg


def _signed_decode(raw: dict[str, Any]) -> Envelope | None:
    value = json.dumps(raw).encode()  # json writes integers past 64 bits; orjson refuses them
    return _decode(value, [(AUTH_HEADER, _mac(KEY, value).encode())], KEY)


def _as_written(raw: Any, read: Any, where: str = "payload") -> None:
    """Every value the reader kept is exactly the value written: same type, same value (3.7 is
    not read as 3, "5" not as 5, True not as 1), and every integer within 64 bits."""
    if isinstance(read, dict):
        assert isinstance(raw, dict), where
        for k, v in read.items():
            if k in raw:  # absent: the reader's default
                _as_written(raw[k], v, f"{where}.{k}")
    elif isinstance(read, list):
        assert isinstance(raw, list) and len(raw) == len(read), where
        for i, (a, b) in enumerate(zip(raw, read, strict=True)):
            _as_written(a, b, f"{where}[{i}]")
    else:
        assert type(raw) is type(read) and raw == read, (where, raw, read)
        if type(read) is int:
            assert -1 <= read <= INT_MAX, (where, read)


@FUZZ
@given(raw=messages())
def test_a_decoded_message_holds_only_values_its_schema_allows(raw: dict[str, Any]) -> None:
    env = _signed_decode(raw)
    if env is None:
        return
    assert type(raw["version"]) is int and type(raw["type"]) is int
    _as_written(raw["payload"], env.payload.to_json())
    _as_written({k: raw[k] for k in ("id", "ts", "sender")}, {"id": env.id, "ts": env.ts_ms,
                "sender": env.sender}, "envelope")  # fmt: skip
    _feed_everyone(env)


def _ahead(payload: Any, by: int) -> Any:
    """The same message numbered ``by`` transactions further: never prepared, never next."""
    if isinstance(payload, Checkpoint):
        return replace(payload, last_txn=payload.last_txn + by)
    return replace(payload, txn=payload.txn + by)


@FUZZ
@given(st.lists(messages(), min_size=1, max_size=12), st.integers(min_value=0, max_value=2**32))
def test_fuzzed_messages_in_a_valid_run_move_nothing_out_of_sequence(
    raws: list[dict[str, Any]], salt: int
) -> None:
    """Every fuzzed message is slipped into a valid run: those that decode are numbered far
    past anything prepared first (a DECISION, PREPARE or CHECKPOINT from nowhere; a VOTE,
    APPLIED or COMPLETE for a transaction nobody runs). ``valid_run`` checks after every
    message that no reader's last decided transaction passes the highest prepared one; the run
    must still commit every cycle, and a coordinator recovering from the whole log must number
    on from the real transactions."""
    by = 1000 + salt % 1000
    forged: list[Envelope] = []
    for raw in raws:
        value = json.dumps(raw).encode()
        env = _decode(value, [(AUTH_HEADER, _mac(KEY, value).encode())], KEY)
        if env is not None:
            forged.append(replace(env, payload=_ahead(env.payload, by)))

    def inject() -> list[Envelope]:
        return [forged.pop(0)] if forged else []

    run = valid_run(8, inject)
    assert run.coord.committed == 8 and run.part.log.last_decided == 8
    assert set(run.skipped) <= {"out_of_sequence"}
    coord, _refused = recover(run.log)
    assert coord.log.last_decided == 8 and coord.log.last_txn == 8


# -- (c) the writer's compiled schema check against the reference one --------------------------


@cache
def _reference() -> tuple[Draft202012Validator, dict[int, Draft202012Validator]]:
    """Python's ``jsonschema`` over the same schema files: the reference implementation the
    writer's compiled check (``jsonschema-rs``, ``codec.validate``) must agree with."""
    docs = {p.name: json.loads(p.read_text()) for p in schema_dir().glob("*.json")}
    registry: Registry[Any] = Registry().with_resources(
        (doc["$id"], Resource.from_contents(doc)) for doc in docs.values()
    )
    payloads = {
        int(t): Draft202012Validator(docs[name], registry=registry)
        for t, name in _SCHEMA_FILES.items()
    }
    return Draft202012Validator(docs["envelope.json"], registry=registry), payloads


def _ends_in_a_newline(value: Any) -> bool:
    """Whether a string in ``value`` ends in a newline, which Python's ``re`` lets a pattern's
    ``$`` match before and ECMA-262's (JSON Schema's) does not."""
    if isinstance(value, str):
        return value.endswith("\n")
    if isinstance(value, dict):
        return any(_ends_in_a_newline(v) for v in value.values())
    if isinstance(value, list):
        return any(_ends_in_a_newline(v) for v in value)
    return False


@FUZZ
@given(raw=messages())
def test_the_writers_schema_check_refuses_exactly_what_the_reference_refuses(
    raw: dict[str, Any],
) -> None:
    """Strict on write: every message the reference validator finds outside its schema is
    refused before it is produced, and nothing it accepts is -- big and negative integers,
    floats that are integers, bools, the name pattern, missing and extra fields alike. (Values
    no writer produces, which JSON cannot hold -- tuples, keys that are not strings -- and a
    name ending in a newline, which Python's ``re`` lets ``$`` match, are where the two differ;
    the compiled one follows the JSON Schema specification.)"""
    assume(not _ends_in_a_newline(raw))  # where Python's re and JSON Schema's regex differ
    envelope, payloads = _reference()
    try:  # the payload's schema is chosen as the writer's check chooses it
        payload = payloads.get(int(raw["type"]))
    except (TypeError, ValueError, OverflowError):
        payload = None
    ok = payload is not None and envelope.is_valid(raw) and payload.is_valid(raw["payload"])
    if ok:
        validate(raw)
    else:
        with pytest.raises(ProtocolError):
            validate(raw)
