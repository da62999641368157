"""Sinks by name: built-ins and any package registered under the ``twophase.sinks`` entry points."""

from __future__ import annotations

import logging
from importlib.metadata import entry_points
from typing import Any

from pydantic import ValidationError

from twophase.config import PipelineConfig, check_kafka_settings, validation_error
from twophase.errors import ConfigError
from twophase.participants.decoding import decoder_for
from twophase.participants.sdk import Sink, SinkContext

__all__ = ["ENTRY_POINT_GROUP", "available_sinks", "build_sinks", "check_config", "sink_class"]

ENTRY_POINT_GROUP = "twophase.sinks"


def available_sinks() -> dict[str, str]:
    """type name -> ``module:Class`` of every installed sink."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def sink_class(type_name: str) -> type[Sink]:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == type_name:
            cls = ep.load()
            if not (isinstance(cls, type) and issubclass(cls, Sink)):
                raise ConfigError("type", f"{ep.value} is not a twophase.participants.sdk.Sink")
            return cls
    known = ", ".join(sorted(available_sinks())) or "none"
    raise ConfigError("type", f"unknown sink type {type_name!r} (installed: {known})")


def build_sinks(
    raw_sinks: list[dict[str, Any]], *, pipeline: str, participant: str, source: str = ""
) -> list[Sink]:
    """Validate every sink section with its own model; errors name ``sinks[i].field``."""
    sinks = []
    for i, raw in enumerate(raw_sinks):
        try:
            cls = sink_class(str(raw.get("type")))
        except ConfigError as exc:
            raise ConfigError(
                f"sinks[{i}].type", str(exc).split(": ", 1)[-1], source=source
            ) from None
        context = SinkContext(
            pipeline=pipeline,
            participant=participant,
            sink_name=str(raw["name"]),
            logger=logging.getLogger(f"twophase.sink.{raw['name']}"),
        )
        try:
            sinks.append(cls.from_mapping(raw, context))
        except ValidationError as exc:
            # Names the field, masks any secret the message quotes (a DSN's password, say).
            raise validation_error(exc, prefix=f"sinks[{i}].", source=source) from None
    return sinks


def check_config(cfg: PipelineConfig) -> PipelineConfig:
    """``cfg`` once every sink section has passed its own sink's model (an unknown type, a
    missing field) and every librdkafka passthrough setting has passed librdkafka: the one
    validation every entry point runs before it acts. Builds the sinks without connecting and
    drops them; :class:`ConfigError` names ``sinks[i].field``."""
    sinks = build_sinks(
        cfg.sinks, pipeline=cfg.pipeline, participant=cfg.participant_id, source=cfg.source_file
    )
    for j, src in enumerate(cfg.sources):
        if src.topic and not any(sink.config.takes(src.topic) for sink in sinks):
            raise ConfigError(
                f"sources[{j}].topic",
                f"no sink takes topic {src.topic!r}: every sink's topics leaves it out",
                source=cfg.source_file,
            )
    for j, src in enumerate(cfg.sources):
        decoder = decoder_for(src, cfg.schema_registry)
        if not decoder.deletes:
            continue
        for i, sink in enumerate(sinks):
            # A pattern's topics are not known yet: every sink may get its deletes.
            takes = sink.config.takes(src.topic) if src.topic else True
            if takes and not sink.supports_deletes:
                raise ConfigError(
                    f"sinks[{i}].type",
                    f"sink {sink.name!r} ({sink.config.type}) cannot apply deletes as configured "
                    "(postgres, mongodb: in mode upsert; files: with op_column; docs/cdc.md), and "
                    f"sources[{j}] (topic {src.name!r}, format {src.format}, "
                    f"tombstones {decoder.tombstones}) produces them",
                    source=cfg.source_file,
                )
    if cfg.schema_registry is not None and any(s.registry_formats for s in cfg.sources):
        _check_registry_settings(cfg)
    check_kafka_settings(cfg)
    return cfg


def _check_registry_settings(cfg: PipelineConfig) -> None:
    """``schema_registry.config`` as confluent-kafka's client reads it: a misspelt setting is a
    start-up error, not every record's dead letter (the client is otherwise made at the first
    record). Making the client connects to nothing."""
    from twophase.participants.decoding.registry import registry_client

    assert cfg.schema_registry is not None
    try:
        registry_client(cfg.schema_registry)
    except OSError:
        pass  # a certificate it names, not on this machine: the participant's to read
    except (ValueError, TypeError) as exc:
        raise ConfigError("schema_registry.config", str(exc), source=cfg.source_file) from None
