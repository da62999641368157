"""Topic settings from ``control-topic/topics.yaml`` (shipped in the wheel), per pipeline."""

from __future__ import annotations

from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from twophase.config import PipelineConfig

__all__ = ["topic_defaults", "topic_settings"]


@cache
def topic_defaults() -> dict[str, Any]:
    packaged = resources.files("twophase.protocol").joinpath("_topics.yaml")
    path = (
        Path(str(packaged))
        if packaged.is_file()
        else Path(__file__).resolve().parents[2] / "control-topic" / "topics.yaml"
    )
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    return data


def topic_settings(cfg: PipelineConfig) -> list[tuple[str, int, int, dict[str, str]]]:
    """(name, partitions, replication factor, topic config) for every topic of the pipeline."""
    d = topic_defaults()
    control = {**d["control"]["config"], **cfg.control.topic_config}
    out = [
        (
            cfg.control_topic,
            1,
            cfg.control.replication_factor,
            {k: str(v) for k, v in control.items()},
        ),
        (
            # Replies for the coordinator: one partition, kept like the control topic.
            cfg.reply_topic,
            1,
            cfg.control.replication_factor,
            {k: str(v) for k, v in control.items()},
        ),
        (
            cfg.dead_letter_topic,
            cfg.dead_letter.partitions,
            cfg.dead_letter.replication_factor,
            {k: str(v) for k, v in d["dead_letter"]["config"].items()},
        ),
    ]
    # A topic_pattern's topics are made by whoever produces them (e.g. Debezium, per table).
    out += [(s.topic, s.partitions, s.replication_factor, {}) for s in cfg.sources if s.topic]
    return out
