"""The write path: the open part's records, buffered per output file and written as complete,
fsynced files into its directory; at the prepare, the rest of them and ``PREPARED.json``.

Records are grouped per output file (topic and UTC date of the record timestamp; a timestamp no
date names -- none, or after 9999-12-31 -- goes under the null date) and buffered as Arrow
arrays (Parquet) or encoded lines (JSON Lines). A buffer that reaches ``max_file_records`` is
written to a complete, fsynced file in the open directory; when all buffers together exceed
``max_buffered_records`` the largest is written early.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twophase.participants.sdk import (
    FatalSinkError,
    PartId,
    Positions,
    Record,
    Rejected,
    positions_to_json,
)
from twophase.participants.sdk.staging import read_json, write_durable
from twophase.participants.sinks.files._encoders import Encoder, refusal
from twophase.participants.sinks.files._layout import PREPARED_FILE, STATE_DIR, now

if TYPE_CHECKING:
    from twophase.participants.sinks.files._datasets import PartSchemas

__all__ = ["Buffer", "FileEntry", "Key", "OpenFiles", "OutputGroups", "read_prepared"]

DOCUMENT_VERSION = 1
#: What Hive and Spark read back as a null partition value: records whose timestamp has no
#: calendar date (none, or past 9999-12-31).
NULL_DATE = "__HIVE_DEFAULT_PARTITION__"
_DAY_MS = 86_400_000
#: The last day a ``date`` can name (9999-12-31), in days since the epoch. Kafka takes any
#: int64 timestamp once a topic's ``message.timestamp.after.max.ms`` is raised.
_LAST_DAY = (date.max - date(1970, 1, 1)).days
_TOPIC_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
#: Dates named so far, kept up to this many (a replay of old data names many).
_DATE_CACHE = 4096


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One data file of a part: where it is staged, where it goes, and how to recognise it."""

    name: str  # inside the open/prepared directory
    target: str  # relative to ``path``, POSIX separators
    topic: str | None
    records: int
    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "target": self.target,
            "topic": self.topic,
            "records": self.records,
            "bytes": self.size,
            "sha256": self.sha256,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> FileEntry:
        return cls(
            name=str(raw["name"]),
            target=str(raw["target"]),
            topic=None if raw.get("topic") is None else str(raw["topic"]),
            records=int(raw["records"]),
            size=int(raw["bytes"]),
            sha256=str(raw["sha256"]),
        )


#: Output group of a record: (topic or None, date or None).
Group = tuple[str | None, str | None]
#: Output file group: its output group, and the part's schema generation of its dataset for a
#: record stored typed (-1 otherwise): a file holds one schema.
Key = tuple[str | None, str | None, int]


class OutputGroups:
    """Which output file a record goes to, by the configured ``partition_by``."""

    def __init__(self, partition_by: str) -> None:
        self.mode = partition_by
        self._dates: dict[int, str] = {}

    def key(self, record: Record) -> Group | str:
        """The output group of ``record``, or why it has none."""
        return self.key_of(record.topic, record.timestamp_ms)

    def key_of(self, topic: str, ts: int) -> Group | str:
        """The output group of a record of ``topic`` with timestamp ``ts``, or why it has none."""
        mode = self.mode
        if mode == "none":
            return (None, None)
        if topic in (".", "..", STATE_DIR) or not topic or not _TOPIC_CHARS.issuperset(topic):
            return f"topic {topic!r} cannot name a directory of this sink"
        if mode == "topic":
            return (topic, None)
        day = ts // _DAY_MS
        if ts < 0 or day > _LAST_DAY:
            # No date names it: the null partition; ``_timestamp_ms`` keeps the exact value.
            return (topic, NULL_DATE)
        text = self._dates.get(day)
        if text is None:
            if len(self._dates) > _DATE_CACHE:
                self._dates.clear()
            text = self._dates[day] = (date(1970, 1, 1) + timedelta(days=day)).isoformat()
        return (topic, text)


@dataclass(slots=True)
class Buffer:
    """Records of one output file not yet written: encoded JSON lines, or for Parquet the
    records (converted rows with a configured schema), turned into one table when the file is
    written -- so an inferred column type is decided from the whole file, not its first rows.
    ``encoder``: the typed encoder of its dataset's schema, for records stored typed."""

    chunks: list[Any] = field(default_factory=list)
    rows: int = 0
    encoder: Encoder | None = None


@dataclass(slots=True)
class OpenFiles:
    """What the open part keeps in memory: its directory and lock, the buffered records and the
    files written so far (the part's life cycle itself is :class:`BatchingSink`'s)."""

    part: PartId
    directory: Path
    lock_fd: int
    encoder: Encoder
    max_file_records: int
    buffered_limit: int
    buffers: dict[Key, Buffer] = field(default_factory=dict)
    files: list[FileEntry] = field(default_factory=list)
    seq: int = 0
    records: int = 0
    rejected: int = 0
    buffered: int = 0
    started: float = field(default_factory=time.monotonic)
    #: The part's dataset schemas (Parquet without a configured ``schema``): records with a
    #: schema are written by their dataset's (:mod:`._datasets`).
    schemas: PartSchemas | None = None

    def write(self, records: Sequence[Record], groups: OutputGroups) -> list[Rejected]:
        """Buffer ``records`` per output file; the refused ones. A record with a schema must
        have been taken by :meth:`PartSchemas.open` first."""
        rejected: list[Rejected] = []
        by_key: dict[Key, list[Record]] = {}
        encoders: dict[Key, Encoder] = {}
        schemas = self.schemas
        for record in records:
            group = groups.key(record)
            if isinstance(group, str):
                rejected.append(refusal(record, group, None))
            elif schemas is not None and record.schema is not None:
                target = schemas.target(group[0] or "")
                key = (group[0], group[1], target.gen)
                encoders[key] = target.encoder
                by_key.setdefault(key, []).append(record)
            else:
                by_key.setdefault((group[0], group[1], -1), []).append(record)
        for key, group_records in by_key.items():
            typed = encoders.get(key)
            buf = self.buffers.setdefault(key, Buffer(encoder=typed))
            chunk, refused = (typed or self.encoder).encode(group_records)
            rejected.extend(refused)
            if chunk is not None:
                self._append(key, buf, chunk)
        while self.buffered > self.buffered_limit:
            key, buf = max(self.buffers.items(), key=lambda kv: kv[1].rows)
            self._flush(key, buf)
        self.rejected += len(rejected)
        return rejected

    def write_chunks(self, chunks: Mapping[Key, Any | None], rejected: int) -> None:
        """Buffer chunks made without records (the raw path), each of one output file, in
        the order :meth:`write` would have made them (None: every record of that file was
        refused); ``rejected``: how many records were refused."""
        for key, chunk in chunks.items():
            buf = self.buffers.setdefault(key, Buffer())
            if chunk is not None:
                self._append(key, buf, chunk)
        while self.buffered > self.buffered_limit:
            key, buf = max(self.buffers.items(), key=lambda kv: kv[1].rows)
            self._flush(key, buf)
        self.rejected += rejected

    def flush_all(self) -> None:
        """Write every buffer that holds records (the prepare)."""
        for key, buf in sorted(self.buffers.items(), key=lambda kv: str(kv[0])):
            if buf.rows:
                self._flush(key, buf)

    def _append(self, key: Key, buf: Buffer, chunk: Any) -> None:
        encoder = buf.encoder or self.encoder
        total, start, limit = encoder.rows(chunk), 0, self.max_file_records
        while start < total:
            take = min(limit - buf.rows, total - start)
            piece = chunk if take == total else encoder.cut(chunk, start, take)
            buf.chunks.append(piece)
            buf.rows += take
            self.buffered += take
            self.records += take
            start += take
            if buf.rows >= limit:
                self._flush(key, buf)

    def _flush(self, key: Key, buf: Buffer) -> None:
        """Write the buffered rows of ``key`` as one complete, fsynced file in the open dir."""
        encoder = buf.encoder or self.encoder
        data = encoder.serialize(buf.chunks, self.part)
        seq, ext = self.seq, encoder.extension
        name = f"{seq:04d}.{ext}"
        write_durable(self.directory / name, data)
        topic, day, _gen = key
        filename = f"part-{self.part.txn:012d}-{self.part.participant}-{seq:04d}.{ext}"
        target = "/".join(
            p for p in (topic, None if day is None else f"date={day}", filename) if p is not None
        )
        self.files.append(
            FileEntry(name, target, topic, buf.rows, data.nbytes, hashlib.sha256(data).hexdigest())
        )
        self.seq += 1
        self.buffered -= buf.rows
        buf.chunks, buf.rows = [], 0

    def document(self, sink: str, fmt: str, positions: Positions) -> dict[str, Any]:
        """``PREPARED.json``: what a committer needs, from any process (``schemas``: the
        dataset schema changes the part reserved, merged at its commit)."""
        document = {
            "version": DOCUMENT_VERSION,
            "token": self.part.token,
            "pipeline": self.part.pipeline,
            "txn": self.part.txn,
            "participant": self.part.participant,
            "sink": sink,
            "format": fmt,
            "positions": positions_to_json(positions),
            "records": self.records,
            "rejected": self.rejected,
            "files": [f.to_json() for f in self.files],
            "prepared_at": now(),
            "prepared_by": {"host": socket.gethostname(), "pid": os.getpid()},
        }
        if self.schemas is not None and (reserved := self.schemas.reservations()):
            document["schemas"] = reserved
        return document


def read_prepared(
    part: PartId, prepared: Path, sink: str
) -> tuple[dict[str, Any], list[FileEntry]] | None:
    """PREPARED.json of ``part`` and its files; None when the part is not prepared."""
    try:
        document = read_json(prepared / PREPARED_FILE)
        if not isinstance(document, dict) or not isinstance(document.get("files"), list):
            raise ValueError("not a PREPARED document")
        return document, [FileEntry.from_json(raw) for raw in document["files"]]
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as exc:  # JSONDecodeError is a ValueError
        raise FatalSinkError(
            f"part {part.token}: {prepared / PREPARED_FILE} is unreadable: {exc}", sink=sink
        ) from exc
