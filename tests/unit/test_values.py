"""The SDK's value rules refuse with :class:`BadValue` and nothing else, whatever a record holds:
any other exception would escape a sink's write and end the participant (a record must never
stop a pipeline). Property-based, derandomized: a failure replays by running the test again."""

from __future__ import annotations

import contextlib
from typing import Any

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
    _refused_or_kept(values.to_bool, value)
    _refused_or_kept(values.json_text, value)


def test_an_integer_string_too_long_for_int_is_out_of_range() -> None:
    try:
        values.to_integer("1" * 5_000, *INT64, "bigint")
    except values.BadValue as exc:
        assert "out of range for bigint" in str(exc)
        assert len(str(exc)) < 200
    else:
        raise AssertionError("a 5,000-digit integer was taken")
