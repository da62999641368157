"""Durable file-system steps for sinks that stage files before they publish them.

A staged file is only as durable as the directory entry that names it, so every step here fsyncs
the file *and* the directory it changed. The building blocks::

    write_durable(dir / "0000.parquet", data)     # new file, written and fsynced
    write_json_atomic(dir / "PREPARED.json", doc)  # tmp + fsync + rename + fsync of the directory
    rename_durable(open_dir, prepared_dir)         # atomic, then both parents fsynced
    discard_tree(prepared_dir, trash_dir)          # atomic disappearance, then the slow delete

POSIX only: atomic ``rename(2)`` and ``fsync`` of a directory. All paths of one sink must live on
one file system (``rename`` across file systems is neither atomic nor allowed).

After a failed ``fsync`` the kernel may already have dropped the dirty pages, so retrying the fsync
proves nothing: callers treat a failed write or fsync of staged data as "rewrite it", never as
"retry the same call".
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

__all__ = [
    "discard_tree",
    "fsync_dir",
    "makedirs_durable",
    "read_json",
    "remove_tree",
    "rename_durable",
    "write_atomic",
    "write_durable",
    "write_json_atomic",
]


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (creations, renames, removals) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes | bytearray | memoryview) -> None:
    """Create ``path`` (it must not exist), write all of ``data`` and fsync it.

    The directory entry is not fsynced: callers batch that into one :func:`fsync_dir`.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | bytearray | memoryview) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new content, never a part.

    The temporary name is unique per call, so concurrent writers of the same path (two processes
    finishing the same commit) never interleave; the last rename wins with a complete file.
    """
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        write_durable(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: Path, document: Any) -> None:
    """:func:`write_atomic` of ``document`` as stable, human-readable JSON."""
    text = json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    write_atomic(path, text.encode())


def read_json(path: Path) -> Any:
    """The JSON document at ``path``; :class:`FileNotFoundError` when it does not exist."""
    with path.open("rb") as f:
        return json.load(f)


def rename_durable(src: Path, dst: Path) -> None:
    """Atomically rename ``src`` to ``dst`` and fsync the directories that changed."""
    os.rename(src, dst)
    fsync_dir(dst.parent)
    if src.parent != dst.parent:
        fsync_dir(src.parent)


def makedirs_durable(path: Path) -> None:
    """Create ``path`` and missing ancestors, fsyncing each parent whose entries changed."""
    missing: list[Path] = []
    probe = path
    while not probe.is_dir():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:
            if not directory.is_dir():
                raise
            continue  # a concurrent creator won; it fsyncs the parent itself
        fsync_dir(directory.parent)


def remove_tree(path: Path) -> None:
    """Delete ``path`` and everything under it; entries that vanish concurrently are fine."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            Path(root, name).unlink(missing_ok=True)
        for name in dirs:
            _rmdir_if_present(Path(root, name))
    _rmdir_if_present(path)


def discard_tree(path: Path, trash_dir: Path) -> bool:
    """Make ``path`` disappear atomically, then delete it. False when it did not exist.

    The rename into ``trash_dir`` (same file system) is the atomic step: a crash during the slow
    delete leaves garbage in the trash, never a half-deleted ``path`` that looks like real state.
    """
    trash = trash_dir / f"{path.name}.{uuid.uuid4().hex[:12]}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return False
    fsync_dir(path.parent)
    remove_tree(trash)
    return True


def _rmdir_if_present(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.rmdir()
