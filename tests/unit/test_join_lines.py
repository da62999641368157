"""``join_lines`` (the JSON-lines buffer for Arrow's reader): the compiled version answers
exactly what the Python one does, for every kind of value it must refuse."""

from __future__ import annotations

import random

import pytest
import twophase_native

from twophase.participants.sdk import rawjson
from twophase.participants.sdk.rawjson import _join_lines_py, join_lines

ODD = [
    b"",
    b"{",
    b"[1]",
    b" {}",
    b'{"a":\n1}',
    b'{"a":1}\n',
    b'{"a":"\r"}',
    b'{"a":"\xc3\xa9"}',  # valid UTF-8
    b'{"a":"\xc3"}',  # cut short
    b'{"a":"\xed\xa0\x80"}',  # a surrogate: not UTF-8
    b'{"a":"\xff"}',
    b"{}",
]


@pytest.mark.parametrize("utf8", [False, True])
def test_native_agrees_with_python_on_random_batches(utf8: bool) -> None:
    rng = random.Random(7)
    good = [b'{"id":%d,"note":"x"}' % i for i in range(50)]
    for _ in range(3000):
        batch = [rng.choice(good) for _ in range(rng.randint(1, 6))]
        if rng.random() < 0.7:
            batch[rng.randrange(len(batch))] = rng.choice(ODD)
        assert twophase_native.join_lines(batch, utf8) == _join_lines_py(batch, utf8=utf8), batch


def test_the_public_helper_uses_the_compiled_one_and_falls_back_for_other_buffers() -> None:
    assert rawjson._native_join is twophase_native.join_lines
    values = [b'{"a":1}', b'{"b":2}']
    assert join_lines(values) == b'{"a":1}\n{"b":2}'
    assert join_lines([]) is None
    # Not bytes (a bytearray): the same answer, from the Python checks.
    assert join_lines([bytearray(b'{"a":1}'), b'{"b":2}']) == b'{"a":1}\n{"b":2}'
    assert join_lines([bytearray(b'{"a":\n1}')]) is None
