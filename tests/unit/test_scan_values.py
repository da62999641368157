"""The runtime's scan of a batch whose values every sink reads itself: the compiled pass
(``twophase_native.scan_values``) gives what the Python loop gives -- the same messages kept
with the same values, the same ones set aside with the same reasons, the same highest offset and
count per partition, the same size -- over random batches of tombstones, oversize values,
missing topics and partitions, and partitions that come back later in the batch."""

from __future__ import annotations

import random
from typing import Any

import pytest
from confluent_kafka import Message

from twophase.participants.decoding import JsonDecoder
from twophase.participants.decoding import json as json_decoding
from twophase.participants.decoding.base import Decoded

LIMIT = 50


def message(rng: random.Random, offset: int) -> Message:
    kind = rng.random()
    if kind < 0.1:
        value = None
    elif kind < 0.2:
        value = b'{"x":"' + b"y" * rng.randrange(LIMIT - 8, LIMIT + 8) + b'"}'
    else:
        value = b'{"id":%d}' % offset
    fields: dict[str, Any] = {"offset": offset, "value": value}
    topic = rng.choice(["orders", "refunds", "", None])
    if topic is not None:
        fields["topic"] = topic
    if rng.random() < 0.9:
        fields["partition"] = rng.randrange(3)
    return Message(**fields)


def outcome(d: Decoded) -> tuple[Any, ...]:
    return (
        d.records,
        [(id(u.msg), u.reason) for u in d.bad],
        d.last,
        d.counts,
        d.size,
        [id(m) for m in d.kept],
        d.values,
    )


@pytest.mark.parametrize("seed", range(20))
def test_the_compiled_scan_gives_what_the_python_loop_gives(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert json_decoding._native_scan is not None, "twophase_native is installed with the package"
    rng = random.Random(seed)
    decoder = JsonDecoder()
    for _ in range(30):
        offset = rng.randrange(100)
        msgs = []
        for _ in range(rng.randrange(0, 40)):
            offset += rng.choice([1, 1, 1, 5, -3])  # mostly rising; a partition may come back
            msgs.append(message(rng, max(offset, 0)))
        native = decoder.decode_batch(msgs, LIMIT, decode=False)
        with monkeypatch.context() as m:
            m.setattr(json_decoding, "_native_scan", None)
            python = decoder.decode_batch(msgs, LIMIT, decode=False)
        assert outcome(native) == outcome(python)
        assert {u.reason for u in native.bad} <= {
            json_decoding.TOMBSTONE,
            *(json_decoding.oversize(n, LIMIT) for n in range(LIMIT + 1, LIMIT + 16)),
        }


def test_a_value_that_is_not_bytes_takes_the_python_loop() -> None:
    """Never from Kafka, but a batch the compiled pass cannot read is not lost: the loop reads
    it as it always did."""
    msgs = [Message(topic="t", partition=0, offset=1, value='{"a":1}')]
    d = JsonDecoder().decode_batch(msgs, LIMIT, decode=False)
    assert d.kept == msgs and d.values == ['{"a":1}'] and d.bad == []
    assert d.last == {("t", 0): 1} and d.counts == {("t", 0): 1}
