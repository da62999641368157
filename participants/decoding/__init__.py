"""Decoding: how a source message's bytes become a record, or a reason it cannot.

One decoder per source format (``source.format`` in the pipeline config), chosen at start-up by
:func:`decoder_for`. The runtime dead-letters what a decoder refuses, with its reason, and hands
the records to the sinks; neither the dead-letter path nor a sink decodes anything itself.

A new format is one :class:`Decoder` subclass (one method, :meth:`Decoder.decode_value`) and one
entry in :data:`DECODERS` -- and its name in ``SourceConfig.format``, which validates the config
before anything starts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import Message

from twophase.config import PipelineConfig, SchemaRegistryConfig, SourceConfig
from twophase.participants.decoding.base import Decoded, Decoder, Headers, Row, Undecodable
from twophase.participants.decoding.debezium import DebeziumDecoder
from twophase.participants.decoding.json import JsonDecoder
from twophase.participants.sdk import Record

__all__ = [
    "DECODERS",
    "DebeziumDecoder",
    "Decoded",
    "Decoder",
    "JsonDecoder",
    "Row",
    "Undecodable",
    "can_delete",
    "decoder_for",
    "source_decoder",
]

#: ``source.format`` -> its decoder.
DECODERS: dict[str, type[Decoder]] = {
    JsonDecoder.format: JsonDecoder,
    DebeziumDecoder.format: DebeziumDecoder,
}


def decoder_for(source: SourceConfig, registry: SchemaRegistryConfig | None = None) -> Decoder:
    """The decoder of one source: its ``format``'s, with its options (the config model has
    already refused unknown formats and contradicting options)."""
    return DECODERS[source.format](source, registry)


def source_decoder(cfg: PipelineConfig) -> Decoder:
    """One decoder for every source topic of a pipeline: the source's own when there is one
    (the hot path), else one that hands each topic's messages to the decoder of the source the
    topic belongs to (``cfg.source_for``: named, or matched by a pattern)."""
    sources = cfg.sources
    decoders = [decoder_for(s, cfg.schema_registry) for s in sources]
    first = decoders[0]
    if all(type(d) is type(first) and d.options == first.options for d in decoders):
        return first
    by_source = {id(s): d for s, d in zip(sources, decoders, strict=True)}

    def pick(topic: str) -> Decoder:
        source = cfg.source_for(topic)
        if source is None:  # the participants subscribe only to topics of a source
            raise LookupError(f"topic {topic!r} belongs to no source of pipeline {cfg.pipeline}")
        return by_source[id(source)]

    return _ByTopic(functools.cache(pick), decoders)


def can_delete(
    sources: Sequence[SourceConfig], registry: SchemaRegistryConfig | None = None
) -> bool:
    """True when a record of these sources may be a delete (:attr:`Record.deleted`)."""
    return any(decoder_for(s, registry).deletes for s in sources)


class _ByTopic(Decoder):
    """Sources of different formats: each topic's messages go to its own decoder."""

    format = "per source"

    def __init__(self, pick: Callable[[str], Decoder], decoders: Sequence[Decoder]) -> None:
        self.pick = pick
        self.decoders = list(decoders)
        shapes = {d.raw_shape for d in decoders}
        self.raw_shape = shapes.pop() if len(shapes) == 1 else None
        self.deletes = any(d.deletes for d in decoders)

    def decode_value(self, value: bytes, headers: Headers, topic: str = "") -> dict[str, Any] | str:
        raise TypeError("a per-source decoder decodes messages, which name their topic")

    def writer_schema(self, schema_id: int) -> str | None:
        # Schema ids are the one registry's: any source that decoded a value of it knows it.
        return next((t for d in self.decoders if (t := d.writer_schema(schema_id))), None)

    def decode_message(self, m: Message) -> Record | str:
        return self.pick(m.topic() or "").decode_message(m)

    def decode_batch(
        self, msgs: Sequence[Message], max_record_bytes: int, decode: bool = True
    ) -> Decoded:
        groups: dict[str, list[Message]] = {}
        for m in msgs:
            groups.setdefault(m.topic() or "", []).append(m)
        out = Decoded([], [], {}, {}, 0, [], [], self)
        for topic, group in groups.items():
            part = self.pick(topic).decode_batch(group, max_record_bytes, decode)
            out.records += part.records
            out.bad += part.bad
            out.last.update(part.last)  # (topic, partition) keys: disjoint across topics
            out.counts.update(part.counts)
            out.size += part.size
            out.kept += part.kept
            out.values += part.values
        return out
