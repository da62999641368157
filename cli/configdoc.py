"""Generates ``docs/config.md``, the reference of every pipeline option, from the config models.

    python -m twophase.cli.configdoc          # print the page
    python -m twophase.cli.configdoc --write  # rewrite docs/config.md (or: make config-doc)

The models are the source of truth: each field's type, default and bounds come from pydantic,
and its meaning from ``Field(description=...)`` or else from the ``#:`` comment above the field
(the comments the models already carry). ``tests/unit/test_configdoc.py`` fails when the page
is stale or a field has no meaning.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import annotated_types
import yaml
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from twophase.config import (
    CommitConfig,
    ControlConfig,
    DeadLetterConfig,
    KafkaConfig,
    MetricsConfig,
    ParticipantConfig,
    PipelineConfig,
    SourceConfig,
)

__all__ = ["DOC_PATH", "REGENERATE", "Row", "main", "model_rows", "render"]

DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "config.md"
#: The one command that regenerates the page (named by the staleness test's failure message).
REGENERATE = "make config-doc"

#: Top-level sections, in the order of the page: (YAML key, model, what it is).
SECTIONS: list[tuple[str, type[BaseModel], str]] = [
    ("kafka", KafkaConfig, "How every Kafka client of the pipeline connects."),
    ("control", ControlConfig, "The control topic the coordinator and participants talk on."),
    ("sources[]", SourceConfig, "The topics the participants read (at least one)."),
    ("dead_letter", DeadLetterConfig, "Where records no sink can take go, with the reason."),
    ("commit", CommitConfig, "The coordinator's commit cycle and its alarms."),
    ("participant", ParticipantConfig, "How a participant batches, sweeps and forgets."),
    ("metrics", MetricsConfig, "Where each process serves /metrics, /healthz and /readyz."),
]

#: Fields of PipelineConfig set by the loader, not by users.
_INTERNAL = {"source_file"}

#: One example sink section per built-in sink; the test validates each with its model.
SINK_EXAMPLES: dict[str, dict[str, Any]] = {
    "postgres": {
        "name": "pg",
        "type": "postgres",
        "dsn": "postgresql://app@db:5432/app",
        "password": "${ENV:PG_PASSWORD}",
        "table": "orders",
        "mode": "upsert",
        "key": ["order_id"],
        "columns": {"order_id": "id", "customer": "customer.name", "amount": "amount"},
        "create_table": {"order_id": "bigint", "customer": "text", "amount": "numeric(12,2)"},
    },
    "mongodb": {
        "name": "mongo",
        "type": "mongodb",
        "uri": "${ENV:MONGO_URI}",
        "database": "app",
        "collection": "orders",
        "mode": "upsert",
        "key": ["order_id"],
        "server_selection_timeout_s": 15,
    },
    "files": {
        "name": "lake",
        "type": "files",
        "path": "/data/orders",
        "format": "parquet",
        "compression": "zstd",
        "partition_by": "topic+date",
        "schema": {"id": "int64", "customer": "string", "amount": "float64"},
        "unknown_fields": "drop",
    },
    "iceberg": {
        "name": "lake",
        "type": "iceberg",
        "catalog": {
            "uri": "postgresql://app@db:5432/lake",
            "password": "${ENV:CATALOG_PASSWORD}",
            "warehouse": "s3://lake/warehouse",
            "properties": {"s3.endpoint": "http://minio:9000", "s3.region": "us-east-1"},
        },
        "table": "sales.orders",
        "mode": "upsert",
        "key": ["order_id"],
        "create_table": {"order_id": "long", "customer": "string", "amount": "decimal(12, 2)"},
        "partition_by": ["bucket(16, order_id)"],
    },
}


@dataclass(frozen=True)
class Row:
    """One option as the page shows it."""

    name: str
    type: str
    default: str
    bounds: str
    meaning: str


def field_comments(model: type[BaseModel]) -> dict[str, str]:
    """``#:`` comment blocks above each field, for ``model`` and its bases, joined to one line."""
    out: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or cls is BaseModel:
            continue
        try:
            lines = inspect.getsource(cls).splitlines()
        except (OSError, TypeError):
            continue
        pending: list[str] = []
        for line in lines[1:]:
            stripped = line.strip()
            if stripped.startswith("#:"):
                pending.append(stripped[2:].strip())
                continue
            m = re.match(r"^ {4}(\w+)\s*:", line)
            if m and pending:
                out[m.group(1)] = " ".join(pending)
            pending = []
    return out


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    if origin is Literal:
        return " \\| ".join(f"`{json.dumps(a)}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"map of {_type_name(args[0])} to {_type_name(args[1])}"
    if annotation is SecretStr:
        return "string (secret)"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    names = {str: "string", int: "integer", float: "number", bool: "boolean", Path: "path"}
    if annotation in names:
        return names[annotation]
    return getattr(annotation, "__name__", str(annotation))


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "**required**"
    factory = info.default_factory
    value = factory() if factory is not None else info.default  # type: ignore[call-arg]
    if value is PydanticUndefined:
        return "**required**"
    if isinstance(value, BaseModel):
        return "see below"
    if isinstance(value, Path):
        value = str(value)
    return f"`{json.dumps(value)}`"


def _bounds(info: FieldInfo) -> str:
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    out: list[str] = []
    for meta in info.metadata:
        for attr, sign in words.items():
            value = getattr(meta, attr, None)
            if value is not None:
                out.append(f"{sign} {value}")
        if isinstance(meta, annotated_types.MinLen):
            out.append(f"at least {meta.min_length} long")
        if isinstance(meta, annotated_types.MaxLen):
            out.append(f"at most {meta.max_length} long")
        pattern = getattr(meta, "pattern", None)
        if pattern:
            out.append(f"matches `{pattern}`")
    return ", ".join(out)


def model_rows(model: type[BaseModel], prefix: str = "", *, expand: bool = False) -> list[Row]:
    """Every user-settable field of ``model`` in declaration order; a section nested in it with
    its own rows when ``prefix`` or ``expand`` says it has no table of its own."""
    comments = field_comments(model)
    rows = []
    for name, info in model.model_fields.items():
        if name in _INTERNAL:
            continue
        shown = info.alias or name
        meaning = info.description or comments.get(name, "")
        rows.append(
            Row(
                name=f"{prefix}{shown}",
                type=_type_name(info.annotation),
                default=_default(info),
                bounds=_bounds(info),
                meaning=" ".join(meaning.split()),
            )
        )
        # A section inside a section (the page gives each top-level section its own table).
        section = _section_model(info.annotation) if prefix or expand else None
        if section is not None:
            rows += model_rows(section, f"{prefix}{shown}.")
    return rows


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a field that is a section (or a section or null) nested in its model."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _table(rows: list[Row]) -> list[str]:
    out = ["| option | type | default | bounds | meaning |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        meaning = r.meaning.replace("|", "\\|")
        out.append(f"| `{r.name}` | {r.type} | {r.default} | {r.bounds} | {meaning} |")
    return out


def builtin_sink_models() -> dict[str, type[BaseModel]]:
    """The built-in sinks' config models, by type name (installed plugins document themselves)."""
    from twophase.participants.sinks.files import FileSink
    from twophase.participants.sinks.iceberg import IcebergSink
    from twophase.participants.sinks.mongodb import MongoSink
    from twophase.participants.sinks.postgres import PostgresSink

    return {
        "postgres": PostgresSink.config_model,
        "mongodb": MongoSink.config_model,
        "files": FileSink.config_model,
        "iceberg": IcebergSink.config_model,
    }


def render() -> str:
    out = [
        "# Pipeline configuration reference",
        "",
        "<!-- Generated by `python -m twophase.cli.configdoc --write` from the config models; do not",
        f"     edit by hand: change the models' `#:` comments or Field descriptions, then run `{REGENERATE}`. -->",
        "",
        "One YAML file configures a pipeline; `twophase validate pipeline.yaml` checks it and names",
        "the field of any error. A value `${ENV:NAME}` is read from the environment and",
        "`${FILE:/path}` from a file (secrets). An environment variable `TWOPHASE__SECTION__KEY`",
        "overrides `section.key` (e.g. `TWOPHASE__COMMIT__INTERVAL_MS=500`). A text field, and a",
        "password- or key-like librdkafka or registry setting, takes the value as written (a key",
        "`12345` or `&Kx9`, a password `0777` or `a #b`, a PEM's lines), unquoted if quoted, and",
        "`null` clears it; any other value is read as YAML (`500`, `true`, `[a, b]`, `{k: v}`),",
        "but a librdkafka or registry setting keeps a number spelled otherwise than YAML prints",
        "it (`0777`) and any text YAML would change. The list sections (`sources`, `sinks`) are",
        "set in the file: an override cannot reach into them. Unknown keys are errors. Sizes of",
        "sections and lists: `sources` and `sinks` need at least one entry.",
        "",
        "## Top level",
        "",
        *_table(model_rows(PipelineConfig)),
    ]
    for key, model, what in SECTIONS:
        out += ["", f"## `{key}`", "", what, "", *_table(model_rows(model, f"{key}."))]
    out += [
        "",
        "## `sinks[]`",
        "",
        "Each entry is validated by its sink type's own model. Every sink has a `name` (unique in",
        "the pipeline) and a `type`; the other options depend on the type. `twophase sinks list`",
        "shows the installed types; a sink plugin documents its own options.",
    ]
    for type_name, model in builtin_sink_models().items():
        example = yaml.safe_dump(
            {"sinks": [SINK_EXAMPLES[type_name]]}, sort_keys=False, default_flow_style=False
        ).rstrip()
        out += [
            "",
            f"### `type: {type_name}`",
            "",
            " ".join((model.__doc__ or "").split()),
            "",
            *_table(model_rows(model, "", expand=True)),
            "",
            "Example:",
            "",
            "```yaml",
            example,
            "```",
        ]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m twophase.cli.configdoc", description=__doc__)
    ap.add_argument("--write", action="store_true", help=f"rewrite {DOC_PATH}")
    args = ap.parse_args(argv)
    page = render()
    if args.write:
        DOC_PATH.write_text(page)
        print(f"wrote {DOC_PATH}")
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
