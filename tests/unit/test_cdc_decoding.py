"""Change data capture on the decoding side: Debezium change events (with and without the Kafka
Connect envelope), record keys, Kafka coordinates and tombstones become rows and deletes."""

from __future__ import annotations

import base64
import json
from typing import Any

import orjson
import pytest
from confluent_kafka import Message

from twophase.config import SourceConfig, parse_config
from twophase.errors import ConfigError
from twophase.participants.decoding import DebeziumDecoder, JsonDecoder, decoder_for
from twophase.participants.decoding.connect import ConnectError, unwrap
from twophase.participants.sdk import RawShape


def msg(offset: int, value: Any, key: Any = None, partition: int = 0) -> Message:
    def raw(v: Any) -> bytes | None:
        return v if v is None or isinstance(v, bytes) else orjson.dumps(v)

    return Message(
        topic="pg.public.orders",
        partition=partition,
        offset=offset,
        key=raw(key),
        value=raw(value),
        timestamp=(1, 1_700_000_000_000 + offset),
    )


def source(**options: Any) -> SourceConfig:
    return SourceConfig(topic="pg.public.orders", **options)


def event(op: str, before: Any = None, after: Any = None) -> dict[str, Any]:
    return {
        "before": before,
        "after": after,
        "op": op,
        "ts_ms": 1_700_000_000_123,
        "source": {"table": "orders", "schema": "public", "lsn": 42, "ts_ms": 1_700_000_000_000},
    }


def envelope(schema: dict[str, Any], payload: Any) -> dict[str, Any]:
    return {"schema": schema, "payload": payload}


def decimal_b64(unscaled: int) -> str:
    size = (unscaled.bit_length() + 8) // 8
    return base64.b64encode(unscaled.to_bytes(size, "big", signed=True)).decode()


# -- the Kafka Connect envelope ---------------------------------------------------------------


def test_an_envelope_gives_its_payload_with_logical_types_exact() -> None:
    schema = {
        "type": "struct",
        "fields": [
            {
                "field": "amount",
                "type": "bytes",
                "name": "org.apache.kafka.connect.data.Decimal",
                "parameters": {"scale": "2"},
            },
            {"field": "day", "type": "int32", "name": "io.debezium.time.Date"},
            {"field": "at", "type": "int64", "name": "io.debezium.time.MicroTimestamp"},
            {"field": "t", "type": "int64", "name": "io.debezium.time.MicroTime"},
            {"field": "big", "type": "struct", "name": "io.debezium.data.VariableScaleDecimal"},
            {"field": "n", "type": "int64"},
        ],
    }
    payload = {
        "amount": decimal_b64(-1234567890123456789012345),
        "day": 19_000,
        "at": 1_700_000_000_123_456,
        "t": 3_723_000_001,
        "big": {"scale": 3, "value": decimal_b64(5)},
        "n": 7,
    }
    assert unwrap(envelope(schema, payload)) == {
        "amount": "-12345678901234567890123.45",
        "day": "2022-01-08",
        "at": "2023-11-14T22:13:20.123456Z",
        "t": "01:02:03.000001",
        "big": "0.005",
        "n": 7,
    }


def test_schemaless_json_and_null_schemas_pass_as_they_are() -> None:
    assert unwrap({"id": 1}) == {"id": 1}
    assert unwrap({"schema": {"type": "string"}, "payload": "x", "extra": 1}) == {
        "schema": {"type": "string"},
        "payload": "x",
        "extra": 1,
    }
    assert unwrap(envelope(None, {"id": 1})) == {"id": 1}  # type: ignore[arg-type]


def test_a_payload_that_contradicts_its_schema_is_a_reason() -> None:
    schema = {
        "type": "struct",
        "fields": [
            {"field": "d", "type": "bytes", "name": "org.apache.kafka.connect.data.Decimal"}
        ],
    }
    with pytest.raises(ConnectError, match=r"payload\.d: not a valid .*Decimal"):
        unwrap(envelope(schema, {"d": "%%% not base64"}))


DECIMAL = "org.apache.kafka.connect.data.Decimal"
VARIABLE = "io.debezium.data.VariableScaleDecimal"


def _struct(*fields: Any) -> dict[str, Any]:
    return {"type": "struct", "fields": list(fields)}


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "int32"}
    for _ in range(depth):
        schema = {"type": "struct", "fields": [{"field": "a", **schema}]}
    return schema


#: Envelopes whose schema Kafka Connect would never write, or whose payload breaks a logical
#: type in a way the type's own check does not see: each must be a reason, never an exception
#: (the schema travels in every message: a producer's bug must not stop the pipeline).
MALFORMED: list[tuple[str, dict[str, Any], Any]] = [
    ("variable decimal without value", _struct({"field": "x", "type": "struct", "name": VARIABLE}), {"x": {"scale": 2}}),
    ("decimal parameters a list", _struct({"field": "x", "type": "bytes", "name": DECIMAL, "parameters": [1]}), {"x": "AQ=="}),
    ("a name that is a list", _struct({"field": "x", "type": "bytes", "name": [1]}), {"x": 1}),
    ("a field name that is a list", _struct({"field": [1], "type": "int32"}), {"x": 1}),
    ("a huge scale", _struct({"field": "x", "type": "bytes", "name": DECIMAL, "parameters": {"scale": str(10**30)}}), {"x": "AQ=="}),
    ("a huge variable scale", _struct({"field": "x", "type": "struct", "name": VARIABLE}), {"x": {"scale": 10**30, "value": "AQ=="}}),
    ("a precision not a number", _struct({"field": "x", "type": "bytes", "name": DECIMAL, "parameters": {"connect.decimal.precision": "abc"}}), {"x": None}),
    ("a scale not a number, value null", _struct({"field": "x", "type": "bytes", "name": DECIMAL, "parameters": {"scale": "abc"}}), {"x": None}),
    ("fields not a list", {"type": "struct", "fields": 5}, {"a": 1}),
    ("a wide integer in the schema", {"type": "struct", "fields": [], "v": 2**64 + 1}, {}),
    ("structs nested past the recursion limit", _nested(250), {"a": None}),
]  # fmt: skip


@pytest.mark.parametrize(("why", "schema", "payload"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_envelope_is_a_reason_in_every_decoder_never_a_crash(
    why: str, schema: dict[str, Any], payload: Any
) -> None:
    # The standard library writes what a producer could: integers past 64 bits, deep nesting.
    value = json.dumps(envelope(schema, payload)).encode()
    change = json.dumps(envelope(schema, event("c", after={}))).encode()
    # Debezium's envelope carries the row schema as its after field.
    dbz_schema = _struct({"field": "after", **schema}, {"field": "op", "type": "string"})
    dbz_value = json.dumps(envelope(dbz_schema, {"op": "c", "after": payload})).encode()
    # (decoder, value, key, must refuse): as a connect_json value the schema is read whole
    # (the record's schema), so refused; as a key, a Debezium envelope (row schema in after)
    # and with the change event as its payload, only what a payload value reaches is read:
    # what matters there is that nothing raises.
    cases = [
        (JsonDecoder(source(value_format="connect_json")), value, None, True),
        (JsonDecoder(source(key_format="json")), orjson.dumps({"id": 1}), value, False),
        (DebeziumDecoder(source(format="debezium")), dbz_value, None, False),
        (DebeziumDecoder(source(format="debezium")), change, None, False),
    ]
    for decoder, val, key, refused in cases:
        out = decoder.decode_batch([msg(1, val, key=key)], max_record_bytes=10**7)
        reasons = [b.reason for b in out.bad]
        assert len(reasons) + len(out.records) == 1
        assert bool(reasons) or not refused, (why, decoder)
        for reason in reasons:
            assert reason.startswith(("undecodable: ", "key: ")), reason


def test_a_debezium_op_that_is_not_a_string_is_a_reason() -> None:
    d = DebeziumDecoder(source(format="debezium"))
    out = d.decode_batch(
        [msg(1, {"op": [1], "after": {}}), msg(2, {"op": {}, "after": {}})], max_record_bytes=10**6
    )
    assert [b.reason for b in out.bad] == [
        "undecodable: Debezium op [1] is not a string",
        "undecodable: Debezium op {} is not a string",
    ]


def test_debezium_integers_of_any_width_are_exact() -> None:
    d = DebeziumDecoder(source(format="debezium"))
    value = b'{"op":"c","after":{"id":-9223372036854775809,"n":18446744073709551617}}'
    (rec,) = d.decode_batch([msg(1, value)], max_record_bytes=10**6).records
    assert rec.value == {"id": -(2**63) - 1, "n": 2**64 + 1}


@pytest.mark.parametrize(
    ("unscaled", "scale", "text"),
    [(1, 10, "0.0000000001"), (-5, 2, "-0.05"), (0, 2, "0.00"), (5, -2, "500"), (0, -2, "0"),
     (123456, 2, "1234.56"), (-1234567, 0, "-1234567")],
)  # fmt: skip
def test_connect_decimals_are_spelled_in_plain_notation(
    unscaled: int, scale: int, text: str
) -> None:
    """As the registry formats spell theirs: a text column gets one form whatever the format."""
    schema = _struct(
        {"field": "d", "type": "bytes", "name": DECIMAL, "parameters": {"scale": str(scale)}},
        {"field": "v", "type": "struct", "name": VARIABLE},
    )
    payload = {"d": decimal_b64(unscaled), "v": {"scale": scale, "value": decimal_b64(unscaled)}}
    assert unwrap(envelope(schema, payload)) == {"d": text, "v": text}


# -- Debezium change events -------------------------------------------------------------------


def test_creates_reads_and_updates_are_rows_and_deletes_are_deletes() -> None:
    d = DebeziumDecoder(source(format="debezium"))
    batch = [
        msg(1, event("r", after={"id": 1, "v": "a"})),
        msg(2, event("c", after={"id": 2, "v": "b"})),
        msg(3, event("u", before={"id": 2, "v": "b"}, after={"id": 2, "v": "c"})),
        msg(4, event("d", before={"id": 1, "v": None})),
        msg(5, None),  # Debezium's tombstone after the delete: skipped by default
    ]
    out = d.decode_batch(batch, max_record_bytes=10_000)
    assert [(r.offset, r.value, r.deleted) for r in out.records] == [
        (1, {"id": 1, "v": "a"}, False),
        (2, {"id": 2, "v": "b"}, False),
        (3, {"id": 2, "v": "c"}, False),
        (4, {"id": 1, "v": None}, True),
    ]
    assert out.bad == []
    # The skipped tombstone is consumed: the partition's position moves past it.
    assert out.last == {("pg.public.orders", 0): 5}
    assert out.counts == {("pg.public.orders", 0): 4}
    assert d.deletes
    # A sink may read these events itself: the after rows of c, r and u (the raw path).
    assert d.raw_shape == RawShape("debezium")
    # Not with options that add to the row.
    added = DebeziumDecoder(source(format="debezium", debezium={"add_fields": ["op"]}))
    assert added.raw_shape is None


def test_events_in_the_connect_envelope_decode_the_same() -> None:
    row_schema = {
        "type": "struct",
        "fields": [
            {"field": "id", "type": "int32"},
            {
                "field": "price",
                "type": "bytes",
                "name": "org.apache.kafka.connect.data.Decimal",
                "parameters": {"scale": "2"},
            },
        ],
    }
    schema = {
        "type": "struct",
        "fields": [
            {"field": "before", **row_schema},
            {"field": "after", **row_schema},
            {"field": "op", "type": "string"},
        ],
    }
    value = envelope(schema, event("c", after={"id": 9, "price": decimal_b64(1999)}))
    rec = DebeziumDecoder(source(format="debezium")).decode_message(msg(1, value))
    assert not isinstance(rec, str)
    assert rec.value == {"id": 9, "price": "19.99"}


def test_a_key_change_is_a_delete_of_the_old_key_and_a_create_of_the_new() -> None:
    d = DebeziumDecoder(source(format="debezium"))
    out = d.decode_batch(
        [
            msg(1, event("d", before={"id": 1})),
            msg(2, None),
            msg(3, event("c", after={"id": 100, "v": "moved"})),
        ],
        max_record_bytes=10_000,
    )
    assert [(r.value, r.deleted) for r in out.records] == [
        ({"id": 1}, True),
        ({"id": 100, "v": "moved"}, False),
    ]


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (event("t"), "not a row change: Debezium op 't'"),
        ({"id": 1}, "undecodable: not a Debezium change event (no op)"),
        (b"{nope", "undecodable: not JSON"),
        (event("c", after=None), "undecodable: Debezium op 'c' without an after row"),
    ],
)
def test_what_is_not_a_row_change_goes_to_the_dead_letters_with_the_reason(
    value: Any, reason: str
) -> None:
    out = DebeziumDecoder(source(format="debezium")).decode_batch(
        [msg(1, value)], max_record_bytes=10_000
    )
    assert out.records == []
    (first,) = [u.reason for u in out.bad]
    assert first.startswith(reason)


def test_selected_event_fields_become_columns_as_debezium_names_them() -> None:
    d = decoder_for(
        source(
            format="debezium",
            debezium={"add_fields": ["op", "table", "lsn", "source.ts_ms"]},
        )
    )
    rec = d.decode_message(msg(1, event("u", after={"id": 1})))
    assert not isinstance(rec, str)
    assert rec.value == {
        "id": 1,
        "__op": "u",
        "__table": "orders",
        "__lsn": 42,
        "__source_ts_ms": 1_700_000_000_000,
    }


def test_not_unwrapped_every_event_is_one_record_and_nothing_deletes() -> None:
    d = decoder_for(source(format="debezium", debezium={"unwrap": False}))
    rec = d.decode_message(msg(1, event("d", before={"id": 1})))
    assert not isinstance(rec, str)
    assert not rec.deleted and rec.value["op"] == "d" and rec.value["before"] == {"id": 1}
    assert not d.deletes


# -- keys, coordinates, tombstones, for every format -------------------------------------------


def test_the_record_key_fields_join_the_row_and_name_a_delete() -> None:
    key_schema = {"type": "struct", "fields": [{"field": "id", "type": "int32"}]}
    d = decoder_for(source(format="debezium", key_format="json", tombstones="delete"))
    out = d.decode_batch(
        [
            msg(1, event("c", after={"v": "a"}), key=envelope(key_schema, {"id": 1})),
            msg(2, event("d"), key={"id": 1}),  # no before: the key names the row
            msg(3, None, key={"id": 1}),  # the tombstone: a delete too (idempotent)
            msg(4, event("c", after={"v": "b"}), key=b"not json"),
        ],
        max_record_bytes=10_000,
    )
    assert [(r.value, r.deleted) for r in out.records] == [
        ({"v": "a", "id": 1}, False),
        ({"id": 1}, True),
        ({"id": 1}, True),
    ]
    (first,) = [u.reason for u in out.bad]
    assert first.startswith("key: not JSON")


def test_json_values_with_keys_and_coordinates_leave_the_raw_path() -> None:
    plain = JsonDecoder(source())
    assert plain.raw_values
    d = decoder_for(
        source(
            key_format="json",
            key_field="order_id",
            kafka_fields={"topic": "_t", "partition": "_p", "offset": "_o"},
        )
    )
    assert isinstance(d, JsonDecoder) and not d.raw_values
    out = d.decode_batch([msg(7, {"amount": 5}, key=42, partition=3)], max_record_bytes=10_000)
    assert [r.value for r in out.records] == [
        {"amount": 5, "order_id": 42, "_t": "pg.public.orders", "_p": 3, "_o": 7}
    ]
    # The same through the one-message path (a raw batch's on-demand decoding).
    one = d.decode_message(msg(7, {"amount": 5}, key=42, partition=3))
    assert not isinstance(one, str) and one.value == out.records[0].value


def test_a_plain_json_source_still_dead_letters_tombstones() -> None:
    out = JsonDecoder(source()).decode_batch([msg(1, None, key={"id": 1})], 10_000)
    assert out.records == [] and out.bad[0].reason.startswith("null value (tombstone)")


# -- configuration ------------------------------------------------------------------------------

PIPELINE = {
    "pipeline": "cdc",
    "kafka": {"bootstrap_servers": "127.0.0.1:9092"},
    "sinks": [{"name": "files", "type": "files", "path": "/tmp/x"}],
}


@pytest.mark.parametrize(
    ("src", "field"),
    [
        ({"tombstones": "delete"}, "tombstones"),
        ({"key_field": "id"}, "key_field"),
        ({"debezium": {"unwrap": False}}, "debezium"),
        ({"format": "debezium", "debezium": {"add_fieldz": ["op"]}}, "debezium"),
    ],
)
def test_contradicting_source_options_fail_at_start_up_naming_the_field(
    src: dict[str, Any], field: str
) -> None:
    raw = {**PIPELINE, "sources": [{"topic": "t", **src}]}
    with pytest.raises(ConfigError) as err:
        parse_config(raw, source="cdc.yaml", env={})
    assert err.value.field.startswith(f"sources[0].{field}"), err.value.field


def test_a_sink_that_cannot_delete_is_refused_at_start_up_naming_it_and_the_source() -> None:
    from twophase.participants.registry import check_config

    raw = {**PIPELINE, "sources": [{"topic": "pg.public.orders", "format": "debezium"}]}
    cfg = parse_config(raw, source="cdc.yaml", env={})
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert err.value.field == "sinks[0].type"
    assert "'files' (files) cannot apply deletes" in str(err.value)
    assert "sources[0] (topic 'pg.public.orders', format debezium" in str(err.value)
    # The same sink under a source that never deletes passes.
    kept = {**raw, "sources": [{"topic": "t", "format": "debezium", "debezium": {"unwrap": False}}]}
    assert check_config(parse_config(kept, env={})).pipeline == "cdc"


def test_a_change_carries_its_source_and_a_template_routes_writes_and_deletes_by_it() -> None:
    from twophase.participants.sdk import Rejected, TargetTemplate, check_template

    d = DebeziumDecoder(source(format="debezium"))
    other = event("d", before={"id": 7})
    other["source"] = {**other["source"], "table": "order_lines", "schema": "sales"}
    out = d.decode_batch(
        [msg(1, event("c", after={"id": 1})), msg(2, other), msg(3, {"op": "c", "after": {}})],
        max_record_bytes=10_000,
    )
    template = TargetTemplate(check_template("replica_${source.schema}_${source.table}"))
    assert [template.render(r) for r in out.records[:2]] == [
        "replica_public_orders",
        "replica_sales_order_lines",  # a delete routes by its source too: its value is the key
    ]
    assert out.records[1].deleted and out.records[1].value == {"id": 7}
    # An event without a source block: the record says why it has no target.
    missing = template.render(out.records[2])
    assert isinstance(missing, Rejected) and "no value for ${source.schema}" in missing.reason
    with pytest.raises(ValueError, match=r"\$\{source.FIELD\}"):
        check_template("${sources.table}")
