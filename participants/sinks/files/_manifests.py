"""The manifests: one per committed part, its commit point, and what housekeeping reads.

A manifest holds its part's source positions and commit time, so the committed positions are
the highest offset per partition over them, the last committed part is the manifest with the
highest txn, and retention deletes old manifests but the best one of each partition and those
of the highest txn, which keeps ``manifests/`` bounded.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from twophase.participants.sdk import (
    CommittedInfo,
    FatalSinkError,
    PartId,
    TopicPartition,
    positions_from_json,
)
from twophase.participants.sdk.staging import fsync_dir

__all__ = ["ManifestInfo", "Manifests", "manifest_positions"]


@dataclass(frozen=True, slots=True)
class ManifestInfo:
    """What housekeeping needs of one manifest: its part, its positions and when it was
    committed (immutable once written, so cached per file name and inode)."""

    inode: int
    txn: int
    participant: str
    positions: dict[TopicPartition, int]
    committed_at: datetime | None


def manifest_time(raw: Mapping[str, Any]) -> datetime | None:
    """The ``committed_at`` of a manifest document; None when absent."""
    text = raw.get("committed_at")
    if not isinstance(text, str):
        return None
    moment = datetime.fromisoformat(text)
    return moment if moment.utcoffset() is not None else moment.replace(tzinfo=UTC)


def manifest_positions(raw: Any) -> dict[TopicPartition, int]:
    """The ``positions`` of a manifest (or ``PREPARED.json``) document."""
    if not isinstance(raw, dict) or not isinstance(raw.get("positions"), list):
        raise ValueError("not a manifest document")
    return positions_from_json(raw["positions"])


class Manifests:
    """The ``manifests/`` directory of one pipeline, read through a cache: listing the directory
    is cheap, parsing thousands of JSON documents on every call is not."""

    def __init__(self, directory: Path, pipeline: str, sink: str) -> None:
        self.directory = directory
        self.pipeline = pipeline
        self.sink = sink
        self._lock = threading.Lock()  # guards the cache
        self._cache: dict[str, ManifestInfo] = {}

    def scan(self) -> dict[str, ManifestInfo]:
        """Every manifest of this pipeline by file name, parsing only those not cached yet."""
        directory = self.directory
        with self._lock:
            cache = self._cache
            found: dict[str, ManifestInfo] = {}
            with os.scandir(directory) as listing:
                for entry in listing:
                    name = entry.name
                    inode = entry.inode()
                    info = cache.get(name)
                    if info is None or info.inode != inode:
                        if name.startswith(".") or not name.endswith(".json"):
                            continue  # write_json_atomic's temporary files
                        txn_text, dash, participant = name[: -len(".json")].partition("-")
                        if not (dash and participant and txn_text.isdigit()):
                            continue
                        path = directory / name
                        try:
                            document = orjson.loads(path.read_bytes())
                        except FileNotFoundError:
                            continue  # forgotten by another process meanwhile
                        try:
                            positions = manifest_positions(document)
                            committed_at = manifest_time(document)
                        except (orjson.JSONDecodeError, ValueError, KeyError, TypeError) as exc:
                            raise FatalSinkError(
                                f"manifest {path} is unreadable: {exc}", sink=self.sink
                            ) from exc
                        info = ManifestInfo(
                            inode, int(txn_text), participant, positions, committed_at
                        )
                    found[name] = info
            self._cache = found
        return found

    def positions(self) -> dict[TopicPartition, int]:
        """The highest offset per source partition over every manifest."""
        positions: dict[TopicPartition, int] = {}
        for info in self.scan().values():
            for tp, offset in info.positions.items():
                if offset > positions.get(tp, -1):
                    positions[tp] = offset
        return positions

    def last(self) -> CommittedInfo | None:
        """The manifest with the highest txn (of that txn's parts, the one committed last)."""
        index = self.scan()
        if not index:
            return None
        epoch = datetime.min.replace(tzinfo=UTC)
        newest = max(index.values(), key=lambda i: (i.txn, i.committed_at or epoch, i.participant))
        return CommittedInfo(
            PartId(self.pipeline, newest.txn, newest.participant), newest.committed_at
        )

    def forget(self, before_txn: int, discard_staged: Callable[[PartId], object]) -> int:
        """Delete the manifests of parts with ``txn < before_txn`` but those still needed (see
        :meth:`FileSink.forget`), each after ``discard_staged`` of its part; how many went."""
        forgotten = 0
        index = self.scan()
        best: dict[TopicPartition, tuple[int, int, str]] = {}
        keep: dict[TopicPartition, str] = {}
        for name, info in index.items():
            for tp, offset in info.positions.items():
                rank = (offset, info.txn, info.participant)
                if tp not in best or rank > best[tp]:
                    best[tp], keep[tp] = rank, name
        needed = set(keep.values())
        newest = max((info.txn for info in index.values()), default=-1)
        for name, info in sorted(index.items()):
            if info.txn >= min(before_txn, newest) or name in needed:
                continue
            try:
                forgotten_part = PartId(self.pipeline, info.txn, info.participant)
            except ValueError:
                pass  # not a participant name: no part of ours was staged under it
            else:
                discard_staged(forgotten_part)
            try:
                (self.directory / name).unlink()
            except FileNotFoundError:
                continue  # another process forgot it first
            forgotten += 1
        if forgotten:
            fsync_dir(self.directory)
        return forgotten
