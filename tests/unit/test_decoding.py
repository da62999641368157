"""The decoding room: bytes + headers in, a record or a reason out, one decoder per format."""

from __future__ import annotations

from typing import Any, get_args

import orjson
import pytest
from confluent_kafka import Message

from twophase.config import SourceConfig, parse_config
from twophase.errors import ConfigError
from twophase.participants.decoding import (
    DECODERS,
    Decoder,
    JsonDecoder,
    source_decoder,
)
from twophase.participants.decoding import _ByTopic as ByTopic
from twophase.participants.decoding.base import Headers

PIPELINE = {
    "pipeline": "orders",
    "kafka": {"bootstrap_servers": "127.0.0.1:9092"},
    "sources": [{"topic": "orders"}],
    "sinks": [{"name": "files", "type": "files", "path": "/tmp/x"}],
}


def msg(partition: int, offset: int, value: Any, topic: str = "orders") -> Message:
    raw = value if value is None or isinstance(value, bytes) else orjson.dumps(value)
    return Message(
        topic=topic,
        partition=partition,
        offset=offset,
        key=b"k",
        value=raw,
        timestamp=(1, 1_700_000_000_000 + offset),
        headers=[("h", b"1")],
    )


BATCH = [
    msg(0, 10, {"id": 10}),
    msg(1, 5, {"id": 5}),
    msg(0, 12, b"{not json"),
    msg(1, 6, None),  # tombstone
    msg(0, 13, [1, 2]),  # JSON, not an object
    msg(1, 7, {"id": 7, "pad": "x" * 100}),  # oversize
    msg(0, 14, b'{"n": 18446744073709551617}'),  # wider than int64: kept exact
    msg(0, 3, {"id": 3}, topic="refunds"),
]


class _JsonThroughTheBase(Decoder):
    """JSON written the way a new format is: one method, the base class's scan."""

    format = "json-slow"

    def decode_value(self, value: bytes, headers: Headers, topic: str = "") -> dict[str, Any] | str:
        return JsonDecoder().decode_value(value, headers)  # type: ignore[return-value]


def _summary(decoder: Decoder, decode: bool) -> tuple[Any, ...]:
    d = decoder.decode_batch(BATCH, max_record_bytes=64, decode=decode)
    return (
        d.records,
        [(u.msg.topic(), u.msg.offset(), u.reason) for u in d.bad],
        d.last,
        d.counts,
        d.size,
        [m.offset() for m in d.kept],
        d.values,
    )


@pytest.mark.parametrize("decode", [True, False])
def test_a_new_decoder_needs_one_method_and_scans_like_json(decode: bool) -> None:
    """The JSON decoder's inlined hot loop and the base class's scan agree on every outcome."""
    assert _summary(_JsonThroughTheBase(), decode) == _summary(JsonDecoder(), decode)


def test_json_decoding_keeps_its_reasons_and_wide_integers() -> None:
    d = JsonDecoder().decode_batch(BATCH, max_record_bytes=64)
    reasons = {u.msg.offset(): u.reason for u in d.bad}
    assert reasons[12].startswith("undecodable: not JSON")
    assert reasons[6] == "null value (tombstone): nothing to write"
    assert reasons[13] == "undecodable: JSON list, expected an object"
    assert reasons[7] == "oversize: 117 bytes > 64"
    assert {r.offset: r.value for r in d.records}[14] == {"n": 18446744073709551617}
    # A raw batch (sinks that read JSON themselves) decodes on demand, with the same reasons.
    raw = JsonDecoder().decode_batch(BATCH, max_record_bytes=64, decode=False)
    assert [r.offset for r in raw.raw_batch().records()] == [10, 5, 14, 3]


@pytest.mark.parametrize("decoder", [JsonDecoder(), _JsonThroughTheBase()], ids=["json", "base"])
def test_integers_past_a_double_s_range_are_kept_exact_and_floats_past_it_refused(
    decoder: Decoder,
) -> None:
    """orjson reads every number as a double first, so an integer of 309+ digits failed as
    "number is infinity": it is kept exact, as narrower wide integers are; a float past a
    double's range, NaN, and an integer past the interpreter's 4,300 digits stay refused."""
    wide = 10**400 + 1
    batch = [
        msg(0, 1, b'{"n": %d, "x": [1.5, -%d]}' % (wide, wide)),
        msg(0, 2, b'{"n": %d, "f": 1e400}' % wide),
        msg(0, 3, b'{"n": %d, "c": NaN}' % wide),
        msg(0, 4, b'{"n": 1%s}' % (b"0" * 5000)),
        msg(0, 5, b'{"n": %d, "s": "\\ud800"}' % wide),  # orjson refuses the surrogate too
    ]
    d = decoder.decode_batch(batch, max_record_bytes=10**6)
    assert [(r.offset, r.value) for r in d.records] == [(1, {"n": wide, "x": [1.5, -wide]})]
    reasons = {u.msg.offset(): u.reason for u in d.bad}
    assert sorted(reasons) == [2, 3, 4, 5]
    assert all(r.startswith("undecodable: not JSON") for r in reasons.values()), reasons


def test_the_config_names_exactly_the_formats_there_are_decoders_for() -> None:
    assert set(get_args(SourceConfig.model_fields["format"].annotation)) == set(DECODERS)


def test_an_unknown_format_fails_at_start_up_naming_the_field() -> None:
    raw = {**PIPELINE, "sources": [{"topic": "orders", "format": "avro"}]}
    with pytest.raises(ConfigError) as err:
        parse_config(raw, source="pipeline.yaml", env={})
    assert "sources" in err.value.field and "format" in err.value.field, err.value.field


def test_the_decoder_is_picked_by_the_sources_format() -> None:
    cfg = parse_config(PIPELINE, env={})
    assert isinstance(source_decoder(cfg), JsonDecoder)


def test_sources_of_different_formats_decode_each_topic_with_its_own() -> None:
    class _Tagged(Decoder):
        format = "tagged"

        def decode_value(
            self, value: bytes, headers: Headers, topic: str = ""
        ) -> dict[str, Any] | str:
            return {"raw": value.decode(errors="replace"), "headers": len(headers or [])}

    decoders = {"orders": JsonDecoder(), "refunds": _Tagged()}
    by_topic = ByTopic(decoders.__getitem__, list(decoders.values()))
    assert not by_topic.raw_values  # one format whose values are not JSON: decode here
    d = by_topic.decode_batch(BATCH, max_record_bytes=64)
    assert {(r.topic, r.offset) for r in d.records} == {
        ("orders", 10),
        ("orders", 5),
        ("orders", 14),
        ("refunds", 3),
    }
    (refund,) = [r for r in d.records if r.topic == "refunds"]
    assert refund.value == {"raw": '{"id":3}', "headers": 1}
    assert d.last == {("orders", 0): 14, ("orders", 1): 7, ("refunds", 0): 3}
    assert by_topic.decode_message(BATCH[-1]) == refund
