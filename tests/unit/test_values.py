"""The SDK's value rules refuse with :class:`BadValue` and nothing else, whatever a record holds:
any other exception would escape a sink's write and end the participant (a record must never
stop a pipeline). Property-based, derandomized: a failure replays by running the test again."""

from __future__ import annotations

import contextlib
import pickle
import re
import uuid
from datetime import date
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from twophase.participants.sdk import values

INT64 = (values.INT64_MIN, values.INT64_MAX)

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(),
    # Integers spelled as strings, past int()'s 4,300-digit limit too.
    st.integers(min_value=1, max_value=9_000).map(lambda n: "9" * n),
    st.text(alphabet="+-0123456789.eE ", max_size=60),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


def _refused_or_kept(fn: Any, value: Any) -> None:
    with contextlib.suppress(values.BadValue):
        fn(value)


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(json_values)
@example("1" * 5_000)
@example("-" + "7" * 4_301)
def test_the_value_rules_refuse_only_with_bad_value(value: Any) -> None:
    _refused_or_kept(lambda v: values.to_integer(v, *INT64, "bigint"), value)
    _refused_or_kept(values.to_float, value)
    _refused_or_kept(values.to_float32, value)
    _refused_or_kept(values.to_bool, value)
    _refused_or_kept(values.json_text, value)
    _refused_or_kept(values.to_decimal, value)
    _refused_or_kept(lambda v: values.fit_decimal(values.to_decimal(v), 10, 2), value)
    _refused_or_kept(values.to_instant, value)
    _refused_or_kept(lambda v: values.to_instant(v, local=True), value)
    _refused_or_kept(values.to_date, value)
    _refused_or_kept(values.to_time, value)
    _refused_or_kept(values.from_base64, value)
    _refused_or_kept(values.to_uuid, value)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(json_values)
def test_an_array_converter_names_the_item_it_refuses(value: Any) -> None:
    """An array of arrays of bigints: a value is converted item by item (nulls kept), or
    refused with BadValue (not an array) or Nested whose ``where`` leads to the item the inner
    rule refuses, for the reason that rule gives."""

    def bigint(v: Any) -> int:
        return values.to_integer(v, *INT64, "bigint")

    convert = values.array_of(values.array_of(bigint))
    try:
        got = convert(value)
    except values.Nested as exc:
        indexes = [int(i) for i in re.findall(r"\[(\d+)\]", exc.where)]
        assert exc.where == "".join(f"[{i}]" for i in indexes)
        item = value
        for i in indexes:
            item = item[i]
        with pytest.raises(values.BadValue) as refused:
            (bigint if len(indexes) == 2 else values.array_of(bigint))(item)
        assert str(refused.value) == exc.reason
        assert str(exc) == f"{exc.where}: {exc.reason}"
        again = pickle.loads(pickle.dumps(exc))  # an exception crosses processes intact
        assert (type(again), again.where, again.reason) == (values.Nested, exc.where, exc.reason)
        return
    except values.BadValue:
        assert not isinstance(value, list)
        return
    assert got == [
        None if a is None else [None if x is None else bigint(x) for x in a] for a in value
    ]


def test_an_integer_string_too_long_for_int_is_out_of_range() -> None:
    try:
        values.to_integer("1" * 5_000, *INT64, "bigint")
    except values.BadValue as exc:
        assert "out of range for bigint" in str(exc)
        assert len(str(exc)) < 200
    else:
        raise AssertionError("a 5,000-digit integer was taken")


# -- the rules of schema-typed values -----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "precision", "scale", "kept"),
    [
        ("12.50", 10, 2, "12.50"),
        ("1.5", 10, 2, "1.50"),  # the scale's zeros appended: the same number
        ("1.2E+3", 6, 0, "1200"),
        ("1200", 3, -2, "1.2E+3"),  # a negative scale: zeros before the point
        ("-0.000", 5, 2, "-0.00"),
        ("9" * 38, 38, 0, "9" * 38),
        ("0.0012", 2, 4, "0.0012"),  # scale over precision: all digits after the point
        ("00012.00", 3, 0, "12"),
        ("0E+5", 5, 2, "0.00"),  # zero however spelled: every decimal type holds it
        ("-0e10", 1, 0, "-0"),
        ("0.000", None, None, "0.000"),  # no scale to fit: the zero keeps its own
    ],
)
def test_fit_decimal_keeps_the_number(text: str, precision: int, scale: int, kept: str) -> None:
    got = values.fit_decimal(values.to_decimal(text), precision, scale)
    assert str(got) == kept
    assert got == Decimal(text)


@pytest.mark.parametrize(
    ("text", "precision", "scale", "reason"),
    [
        ("1.234", 10, 2, "more than 2 digits after the point"),
        ("123.4", 4, 2, "more than 4 digits"),
        ("1250", 2, -2, "not a multiple of 1E+2"),
        ("9" * 39, 38, 0, "more than 38 digits"),
        ("1" * 1_001, None, 0, "a number of 1001 digits has more than 1000 digits"),
    ],
)
def test_fit_decimal_refuses_rather_than_round(
    text: str, precision: int | None, scale: int, reason: str
) -> None:
    with pytest.raises(values.BadValue, match=re.escape(reason)):
        values.fit_decimal(values.to_decimal(text), precision, scale)


@pytest.mark.timeout(10)
def test_fit_decimal_refuses_a_huge_exponent_before_making_its_zeros() -> None:
    """Appending 999,999,999 zeros to count them would take a minute and gigabytes."""
    with pytest.raises(values.BadValue, match="more than 38 digits"):
        values.fit_decimal(values.to_decimal("1E+999999999"), 38, 2)
    with pytest.raises(values.BadValue, match="more than 1000 digits"):
        values.fit_decimal(values.to_decimal("1E+999999999"), None, 0)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-inf", " 1", "1_000", "", True, None, [1]])
def test_to_decimal_refuses_what_no_decimal_type_holds(value: Any) -> None:
    with pytest.raises(values.BadValue):
        values.to_decimal(value)


def test_to_decimal_takes_numbers_exactly() -> None:
    assert values.to_decimal(0.1) == Decimal("0.1")  # the shortest spelling, not the binary
    assert values.to_decimal(2**70) == Decimal(2**70)


def test_instants_are_counted_in_utc_to_the_microsecond() -> None:
    micros = 1_714_571_100_123_456
    assert values.to_instant("2024-05-01T13:45:00.123456Z") == micros
    assert values.to_instant("2024-05-01T15:45:00.123456+02:00") == micros
    assert values.to_instant("2024-05-01T13:45:00.123456") == micros  # no offset: UTC
    assert values.to_instant("2024-05-01T13:45:00.123456000Z") == micros  # zeros below us
    assert values.to_instant("2024-05-01T13:45:00.123456", local=True) == micros
    assert values.to_instant("0001-01-01T00:00:00+01:00") == -62_135_600_400_000_000


@pytest.mark.parametrize(
    ("value", "local", "reason"),
    [
        ("2024-05-01T13:45:00.1234567Z", False, "digits below the microsecond"),
        ("2024-05-01T13:45:00.123456789Z", False, "digits below the microsecond"),
        ("20240501T134500.1234567Z", False, "digits below the microsecond"),  # basic format
        ("2024-05-01T13:45:00Z", True, "has an offset"),
        ("yesterday", False, "expected an ISO-8601 timestamp"),
        (1714571100123, False, "expected an ISO-8601 date-time"),
    ],
)
def test_instants_never_lose_digits(value: Any, local: bool, reason: str) -> None:
    with pytest.raises(values.BadValue, match=reason):
        values.to_instant(value, local=local)


def test_times_dates_bytes_and_uuids() -> None:
    assert values.to_time("13:45:00.000001") == 49_500_000_001
    assert values.to_time("00:00:00") == 0
    with pytest.raises(values.BadValue, match="below the microsecond"):
        values.to_time("13:45:00.0000001")
    with pytest.raises(values.BadValue, match="offset"):
        values.to_time("13:45:00+01:00")
    assert values.to_date("2024-02-29") == date(2024, 2, 29)
    with pytest.raises(values.BadValue):
        values.to_date("2023-02-29")
    assert values.from_base64("AAH/") == b"\x00\x01\xff"
    with pytest.raises(values.BadValue):
        values.from_base64("AAH")  # padding missing
    with pytest.raises(values.BadValue):
        values.from_base64("AA-/")  # not the standard alphabet
    text = "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"
    assert values.to_uuid(text.upper()) == uuid.UUID(text)
    with pytest.raises(values.BadValue):
        values.to_uuid("a0eebc99")


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("1e400", "out of range for double precision"),  # never Infinity
        ("-1E+999", "out of range for double precision"),
        ("1e-400", "underflows"),  # never 0
        (".5e-330", "underflows"),
        ("\u0661\u0662", "expected a number"),  # Arabic-Indic digits: float() reads them
        ("1_000", "expected a number"),
    ],
)
def test_a_float_is_read_as_json_spells_it_or_refused(value: str, reason: str) -> None:
    with pytest.raises(values.BadValue, match=reason):
        values.to_float(value)


def test_float_spellings_that_are_kept() -> None:
    assert values.to_float("Infinity") == float("inf") and values.to_float("-inf") < 0
    assert values.to_float("0e-999") == 0.0 and str(values.to_float("-0")) == "-0.0"
    assert values.to_float("1.5e300") == 1.5e300 and values.to_float(" 1.5") == 1.5


@pytest.mark.parametrize("value", [1e-50, "1e-46", 3.5e38, -1e39])
def test_a_four_byte_float_refuses_what_it_cannot_hold_or_would_round_to_0(value: Any) -> None:
    with pytest.raises(values.BadValue, match="4-byte float"):
        values.to_float32(value)


def test_a_four_byte_float_keeps_its_smallest_values_and_zero() -> None:
    assert values.to_float32(1.5e-45) == 1.5e-45  # rounds to the smallest subnormal, not to 0
    assert values.to_float32(0.0) == 0.0 and values.to_float32("NaN") != values.to_float32("NaN")
