"""The commit path: staged files go to their targets without ever replacing another file.

``commit`` hard-links every staged file to its target (no-replace, so a file is never
overwritten; rename where hard links are unsupported), fsyncs the target directories, and only
then writes the manifest -- the commit point. Every step can be repeated, by any process, after
a crash at any point: a target that already holds the staged file counts as done.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import uuid
from collections.abc import Sequence
from pathlib import Path

from twophase.participants.sdk import FatalSinkError, PartId
from twophase.participants.sdk.staging import fsync_dir, makedirs_durable, write_durable
from twophase.participants.sinks.files._staging import FileEntry

__all__ = ["Publisher"]

# link(2) fails with these where the file system has no hard links (or forbids them to us).
_NO_HARDLINK_ERRNOS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK})


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


class Publisher:
    """Puts one part's staged files at their targets under ``base``."""

    def __init__(self, base: Path, sink: str, log: logging.Logger) -> None:
        self.base = base
        self.sink = sink
        self.log = log
        #: Found out by :meth:`probe_hardlinks` (and by a link that fails): rename otherwise.
        self.hardlinks = True

    def probe_hardlinks(self, scratch: Path) -> bool:
        """Whether the file system links files (tried in ``scratch``); remembered."""
        probe = scratch / f"probe-{uuid.uuid4().hex[:12]}"
        write_durable(probe, b"")
        try:
            os.link(probe, probe.with_name(probe.name + ".link"))
        except OSError as exc:
            if exc.errno not in _NO_HARDLINK_ERRNOS:
                raise
            self.hardlinks = False
        else:
            self.hardlinks = True
        finally:
            probe.unlink(missing_ok=True)
            probe.with_name(probe.name + ".link").unlink(missing_ok=True)
        return self.hardlinks

    def publish(
        self, part: PartId, prepared: Path, files: Sequence[FileEntry], manifest: Path
    ) -> bool:
        """Every staged file of ``part`` at its target, durably; False when another process
        completed the commit meanwhile (its ``manifest`` exists and the sources are gone)."""
        directories: dict[Path, None] = {}
        for entry in files:
            target = self.base / entry.target
            if target.parent not in directories:
                makedirs_durable(target.parent)
                directories[target.parent] = None
            if not self._place(part, prepared / entry.name, target, entry, manifest):
                return False
        for directory in directories:
            fsync_dir(directory)
        if prepared.exists():
            fsync_dir(prepared)  # in rename mode, the sources left this directory
        return True

    def _place(
        self, part: PartId, source: Path, target: Path, entry: FileEntry, manifest: Path
    ) -> bool:
        """Put ``source`` at ``target`` without ever replacing another file there.

        Repeatable after a crash at any point: a target that already holds this file (same inode,
        or the source is gone and size and checksum match) counts as done. False when the source
        and target are both gone but the manifest exists: another process finished the commit.
        """
        if self.hardlinks:
            try:
                os.link(source, target)
                return True
            except FileExistsError:
                pass
            except FileNotFoundError:
                if source.exists():
                    raise  # the target directory vanished; the runtime retries
                return self._already_placed(part, target, entry, manifest)
            except OSError as exc:
                if exc.errno not in _NO_HARDLINK_ERRNOS:
                    raise
                self.hardlinks = False
                self.log.warning("part %s: no hard links here, publishing by rename", part.token)
                return self._place(part, source, target, entry, manifest)
            try:
                if os.path.samefile(source, target):
                    return True  # linked by an interrupted commit
            except FileNotFoundError:
                return self._already_placed(part, target, entry, manifest)
            raise self._collision(part, target)
        if target.exists():
            if source.exists():
                raise self._collision(part, target)
            return self._already_placed(part, target, entry, manifest)
        try:
            os.rename(source, target)
        except FileNotFoundError:
            return self._already_placed(part, target, entry, manifest)
        return True

    def _already_placed(self, part: PartId, target: Path, entry: FileEntry, manifest: Path) -> bool:
        try:
            size = target.stat().st_size
        except FileNotFoundError:
            if manifest.exists():
                return False
            raise FatalSinkError(
                f"part {part.token}: {entry.name} is neither staged nor at {target}",
                sink=self.sink,
            ) from None
        if size != entry.size or _sha256_of(target) != entry.sha256:
            raise self._collision(part, target)
        return True

    def _collision(self, part: PartId, target: Path) -> FatalSinkError:
        return FatalSinkError(
            f"part {part.token}: {target} already exists and is another file; refusing to "
            "overwrite it (do two pipelines write the same path with the same participant names?)",
            sink=self.sink,
        )

    def refuse_if_published(self, part: PartId, prepared: Path, files: Sequence[FileEntry]) -> None:
        """Abort after commit started would leave a partial part visible: refuse loudly."""
        for entry in files:
            source, target = prepared / entry.name, self.base / entry.target
            if not target.exists():
                continue
            if not source.exists() or os.path.samefile(source, target):
                raise FatalSinkError(
                    f"abort of part {part.token}, whose commit has already published {target}",
                    sink=self.sink,
                )
