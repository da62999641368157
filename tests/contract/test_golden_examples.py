"""The wire contract: golden examples against the JSON Schemas and the Python binding."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest

from twophase.errors import ProtocolError
from twophase.protocol import DecodeError, decode, encode
from twophase.protocol.codec import to_dict, validate

EXAMPLES = sorted((Path(__file__).parents[2] / "control-topic" / "examples" / "v1").glob("*.json"))


def test_there_is_an_example_for_every_message_type() -> None:
    types = {json.loads(p.read_text())["type"] for p in EXAMPLES}
    assert types == {1, 2, 3, 4, 5, 6, 7}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_matches_schema_and_binding(path: Path) -> None:
    raw = json.loads(path.read_text())
    validate(raw)  # the schema accepts it
    env = decode(path.read_bytes())  # the binding reads it
    assert to_dict(env) == raw  # and writes exactly the same thing back
    value, _ = encode(env)
    assert orjson.loads(value) == raw


def test_unknown_fields_are_ignored_on_read() -> None:
    raw = json.loads((EXAMPLES[0]).read_text())
    raw["future_field"] = {"x": 1}
    raw["payload"]["also_new"] = True
    env = decode(orjson.dumps(raw))
    assert env.pipeline == raw["pipeline"]


@pytest.mark.parametrize(
    ("mutate", "kind"),
    [
        (lambda r: r.update(type=99), "unknown_type"),
        (lambda r: r.update(version=2), "future_version"),
        (lambda r: r.pop("payload"), "malformed"),
        (lambda r: r["payload"].pop("txn"), "malformed"),
    ],
)
def test_bad_messages_are_classified(mutate, kind) -> None:  # type: ignore[no-untyped-def]
    raw = json.loads(EXAMPLES[0].read_text())
    mutate(raw)
    with pytest.raises(DecodeError) as err:
        decode(orjson.dumps(raw))
    assert err.value.kind == kind


@pytest.mark.parametrize(
    "mutate",
    [
        lambda r: r.update(reply_to=7),
        lambda r: r.update(reply_to=["twophase.control.orders.replies"]),
        lambda r: r["payload"].update(replies_from=-1),
        lambda r: r["payload"].update(replies_from=1.5),
        lambda r: r["payload"].update(replies_from="1830"),
    ],
)
def test_a_reply_topic_or_its_offset_of_the_wrong_type_is_malformed(mutate) -> None:  # type: ignore[no-untyped-def]
    """Both are read and acted on (where a participant sends its vote, where a new leader
    starts reading replies): a reader skips such a message rather than guess."""
    raw = json.loads((EXAMPLES[0].parent / "checkpoint-replies.json").read_text())
    mutate(raw)
    with pytest.raises(DecodeError) as err:
        decode(orjson.dumps(raw))
    assert err.value.kind == "malformed"
    with pytest.raises(ProtocolError):
        validate(raw)  # and no writer can send it


def test_without_a_reply_topic_the_fields_are_absent() -> None:
    """Read by an older reader or written by an older writer, the messages are unchanged."""
    env = decode((EXAMPLES[0].parent / "checkpoint.json").read_bytes())
    assert env.reply_to == "" and env.payload.replies_from == -1  # type: ignore[union-attr]
    raw = to_dict(env)
    assert "reply_to" not in raw and "replies_from" not in raw["payload"]


def test_truncated_and_non_json_messages_are_malformed() -> None:
    data = EXAMPLES[0].read_bytes()
    for value in (data[: len(data) // 2], b"\x00\x01", b"[]"):
        with pytest.raises(DecodeError) as err:
            decode(value)
        assert err.value.kind == "malformed"


def test_hmac_rejects_forged_and_unsigned_messages() -> None:
    env = decode(EXAMPLES[0].read_bytes())
    value, headers = encode(env, b"right-key")
    assert decode(value, headers, key=b"right-key") == env
    forged, forged_headers = encode(env, b"wrong-key")
    for v, h in ((forged, forged_headers), (value, [])):
        with pytest.raises(DecodeError) as err:
            decode(v, h, key=b"right-key")
        assert err.value.kind == "bad_auth"


def test_writer_refuses_invalid_messages() -> None:
    raw = json.loads(EXAMPLES[0].read_text())
    raw["payload"]["txn"] = 0
    with pytest.raises(ProtocolError, match="txn"):
        validate(raw)
