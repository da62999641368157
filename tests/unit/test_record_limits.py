"""Pure logic of records at Kafka's limits (issue #14): how a dead letter is cut to fit, and how
a timestamp no date can show is printed."""

from __future__ import annotations

import pytest

from twophase.cli.main import _when
from twophase.participants.runtime.deadletter import fit_letter

KEY = b"orders:0:7"


def _headers(source_key: bytes = b"k") -> list[tuple[str, bytes]]:
    return [("twophase.reason", b"undecodable: not JSON"), ("twophase.source.key", source_key)]


def _size(value: bytes | None, headers: list[tuple[str, bytes]]) -> int:
    return len(KEY) + len(value or b"") + sum(len(k) + len(v) + 8 for k, v in headers)


def test_a_letter_that_fits_is_sent_unchanged() -> None:
    headers = _headers()
    assert fit_letter(KEY, b"v" * 100, headers, 10_000) == (b"v" * 100, headers)


@pytest.mark.parametrize("limit", [2_000, 10_000, 1_000_000])
@pytest.mark.parametrize(
    ("value_size", "key_size"), [(3_000_000, 1), (10, 2_000_000), (2_000_000, 2_000_000)]
)
def test_a_letter_too_large_is_cut_to_the_limit_and_says_what_was_cut(
    limit: int, value_size: int, key_size: int
) -> None:
    value, source_key = b"v" * value_size, b"k" * key_size
    out_value, out = fit_letter(KEY, value, _headers(source_key), limit)
    h = dict(out)
    assert _size(out_value, out) <= limit
    assert out_value is not None and value.startswith(out_value)
    assert source_key.startswith(h["twophase.source.key"])
    assert h["twophase.original.value.size"] == str(value_size).encode()
    cut = h["twophase.truncated"].decode().split(",")
    assert ("value" in cut) == (len(out_value) < value_size)
    assert ("key" in cut) == (len(h["twophase.source.key"]) < key_size)
    if "key" in cut:
        assert h["twophase.original.key.size"] == str(key_size).encode()
    assert h["twophase.reason"].startswith(b"undecodable")


def test_a_tombstone_stays_a_tombstone_when_its_key_is_cut() -> None:
    out_value, out = fit_letter(KEY, None, _headers(b"k" * 2_000_000), 1_000_000)
    assert out_value is None
    assert dict(out)["twophase.truncated"] == b"key"


@pytest.mark.parametrize(
    ("ts_ms", "shown"),
    [
        (1_700_000_000_000, "2023-11-14T22:13:20.000Z"),
        (253_402_300_800_000, "253402300800000ms"),
        (2**63 - 1, f"{2**63 - 1}ms"),
        (-(2**63), f"{-(2**63)}ms"),
        (None, "-"),
    ],
)
def test_cli_times_no_date_can_show_are_printed_raw(ts_ms: int | None, shown: str) -> None:
    assert _when(ts_ms) == shown
