"""Where a part lives on disk, and the lock that tells a live writer from a dead one.

The part's directory is its marker: ``open/{token}/`` is open, ``prepared/{token}/`` is prepared,
``manifests/{txn:012d}-{participant}.json`` is committed, and nothing at all is aborted.
"""

from __future__ import annotations

import fcntl
import os
import socket
import uuid
from datetime import UTC, datetime
from pathlib import Path

import orjson

from twophase.participants.sdk import PartId, PartState
from twophase.participants.sdk.staging import discard_tree, remove_tree

__all__ = ["LOCK_FILE", "PREPARED_FILE", "STATE_DIR", "Layout", "claim", "create_locked", "now"]

#: Bookkeeping directory under ``path``; the leading underscore hides it from dataset readers.
STATE_DIR = "_twophase"
PREPARED_FILE = "PREPARED.json"
LOCK_FILE = "LOCK"


def now() -> str:
    """The time stamps of PREPARED.json and the manifests: UTC, ISO 8601, milliseconds."""
    return datetime.now(UTC).isoformat(timespec="milliseconds")


class Layout:
    """The directories of one pipeline's parts under the dataset's ``base``."""

    def __init__(self, base: Path, pipeline: str) -> None:
        self.base = base
        self.state = base / STATE_DIR / pipeline

    def dir(self, kind: str) -> Path:
        return self.state / kind

    def open_dir(self, part: PartId) -> Path:
        return self.state / "open" / part.token

    def prepared_dir(self, part: PartId) -> Path:
        return self.state / "prepared" / part.token

    def manifest(self, part: PartId) -> Path:
        return self.state / "manifests" / f"{part.txn:012d}-{part.participant}.json"

    def state_of(self, part: PartId) -> PartState | None:
        """What the directories say of ``part``, without reading any document."""
        if self.manifest(part).exists():
            return "committed"
        if self.prepared_dir(part).exists():
            return "prepared"
        if self.open_dir(part).exists():
            return "open"
        return None

    def discard(self, directory: Path) -> bool:
        """``directory`` disappears by one rename into ``trash/``; whether it was there."""
        return discard_tree(directory, self.dir("trash"))


def create_locked(target: Path) -> int:
    """Create ``target`` with its LOCK already held, so it never exists unlocked; the lock's fd.

    The writer holds the ``flock`` for as long as it owns the part; the kernel drops it when the
    process dies, which is how :func:`claim` tells abandoned parts from live ones.
    """
    building = target.with_name(f".begin-{target.name}-{uuid.uuid4().hex[:12]}")
    building.mkdir()
    fd = os.open(building / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "since": now()}
        os.write(fd, orjson.dumps(owner))
        os.rename(building, target)
    except BaseException:
        os.close(fd)
        remove_tree(building)
        raise
    return fd


def claim(opened: Path) -> int | None:
    """Lock an open part's LOCK if its owner is gone: the fd (-1 without a LOCK), else None.

    After taking the lock, checks that the LOCK still lives in ``opened``: the owner releases
    the lock right after it renamed the directory to ``prepared/``, and that must not count
    as abandoned.
    """
    lock = opened / LOCK_FILE
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return -1 if opened.exists() else None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held, current = os.fstat(fd), os.stat(lock)
        if (held.st_dev, held.st_ino) == (current.st_dev, current.st_ino):
            return fd
    except (BlockingIOError, FileNotFoundError):
        pass
    os.close(fd)
    return None
