"""The files sink's store operations (:class:`FileSink`); the package docstring tells the story."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa

from twophase.participants import sdk
from twophase.participants.sdk.staging import (
    makedirs_durable,
    read_json,
    remove_tree,
    rename_durable,
    write_json_atomic,
)
from twophase.participants.sinks.files._arrow import Columns
from twophase.participants.sinks.files._datasets import DatasetSchemas, PartSchemas
from twophase.participants.sinks.files._encoders import (
    EMPTY_ROW,
    ParquetEncoder,
    Refused,
    encoder_for,
    refusal,
)
from twophase.participants.sinks.files._layout import (
    LOCK_FILE,
    PREPARED_FILE,
    Layout,
    claim,
    create_locked,
    now,
)
from twophase.participants.sinks.files._manifests import Manifests, manifest_positions
from twophase.participants.sinks.files._publish import Publisher
from twophase.participants.sinks.files._raw import RawReader
from twophase.participants.sinks.files._schema import Mismatch
from twophase.participants.sinks.files._staging import (
    Key,
    OpenFiles,
    OutputGroups,
    read_prepared,
)
from twophase.participants.sinks.files._typed import Typing, schema_from_json
from twophase.participants.sinks.files.config import FileSinkConfig
from twophase.retry import DISK_FULL_RETRY_S

__all__ = ["FileSink"]

#: Milliseconds in a day: records of one day share an output file (``partition_by``).
_DAY_MS = 86_400_000
_FATAL_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.EXDEV})
_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


@dataclass(slots=True)
class _Judged:
    """A raw batch as :meth:`FileSink.stage` would take its records: the refusals, and per
    output file (in the order ``stage`` meets them) a chunk, or None when all were refused."""

    refused: list[sdk.Rejected]
    chunks: dict[Key, Columns | None]


class FileSink(sdk.BatchingSink):
    """Exactly-once Parquet / JSON Lines files: staged, fsynced, published by atomic rename.

    The part's directory is its marker: ``open/{token}/`` is open, ``prepared/{token}/`` is
    prepared, a manifest is committed, and nothing at all is aborted (or unknown).
    """

    config_model: ClassVar[type[sdk.SinkConfig]] = FileSinkConfig
    config: FileSinkConfig

    def __init__(self, config: sdk.SinkConfig, context: sdk.SinkContext) -> None:
        if not isinstance(config, FileSinkConfig):
            raise TypeError(f"FileSink needs a FileSinkConfig, got {type(config).__name__}")
        super().__init__(config, context)
        self.base = config.path.absolute()
        self._layout = Layout(self.base, context.pipeline)
        self.state = self._layout.state
        self._encoder = encoder_for(config, Typing(config))
        #: Records with a schema are stored typed by it (Parquet without a configured schema).
        self._typing = self._encoder.typing if isinstance(self._encoder, ParquetEncoder) else None
        self._groups = OutputGroups(config.partition_by)
        self._datasets = DatasetSchemas(self.base, self.name, self.log)
        # The open part's buffers, files and lock: put by its open marker, taken by its prepare
        # or discard.
        self._open_files: sdk.OpenSlot[OpenFiles] = sdk.OpenSlot()
        # Serialises publish/discard/the prepared listing/forget in this process; other
        # processes are safe because every step is idempotent and checks the file system.
        self._decide_lock = threading.Lock()
        self._publisher = Publisher(self.base, self.name, self.log)
        self._manifests = Manifests(self._layout.dir("manifests"), context.pipeline, self.name)
        #: The raw path (:mod:`._raw`): inferred Parquet, every record judged alike.
        raw = config.format == "parquet" and config.schema_ is None and not config.op_column
        self._raw = RawReader(config.source_columns) if raw else None
        #: The last batch judged by :meth:`check_raw`, for the :meth:`stage_raw` that follows.
        self._judged: tuple[list[bytes], _Judged | None] | None = None

    # -- errors --

    @contextlib.contextmanager
    def _fs(
        self, action: str, part: sdk.PartId | None, failure: type[sdk.SinkError]
    ) -> Iterator[None]:
        """Map OSError to the SDK's three branches; permissions and read-only stores are fatal."""
        try:
            yield
        except sdk.SinkError:
            raise
        except OSError as exc:
            where = f"part {part.token}: " if part else ""
            message = f"{where}{action} failed under {self.base}: {exc}"
            if exc.errno in _FATAL_ERRNOS:
                raise sdk.FatalSinkError(message, sink=self.name) from exc
            if failure is sdk.RetriableSinkError and exc.errno in _DISK_FULL_ERRNOS:
                raise sdk.BackpressureError(
                    message, retry_after_s=DISK_FULL_RETRY_S, sink=self.name
                ) from exc
            raise failure(message, sink=self.name) from exc
        except pa.ArrowException as exc:
            where = f"part {part.token}: " if part else ""
            raise sdk.FatalSinkError(
                f"{where}{action}: Arrow refused the data: {exc}", sink=self.name
            ) from exc

    # -- life cycle --

    def setup(self) -> None:
        layout = self._layout
        with self._fs("setup", None, sdk.RetriableSinkError):
            for kind in ("open", "prepared", "manifests", "trash"):
                makedirs_durable(layout.dir(kind))
            makedirs_durable(self._datasets.locks)
            for leftover in layout.dir("trash").iterdir():
                remove_tree(leftover)
            for entry in layout.dir("open").iterdir():
                # ``.begin-*``: a begin that died before its rename; nobody can own it.
                if entry.name.startswith(".") and (fd := claim(entry)) is not None:
                    remove_tree(entry)
                    if fd >= 0:
                        os.close(fd)
            if os.stat(self.base).st_dev != os.stat(self.state).st_dev:
                raise sdk.FatalSinkError(
                    f"{self.state} is on another file system than {self.base}: "
                    "publishing by rename needs one file system",
                    sink=self.name,
                )
            hardlinks = self._publisher.probe_hardlinks(layout.dir("trash"))
        self.log.info(
            "files sink %s ready: %s, format %s, staging %s%s",
            self.name,
            self.base,
            self.config.format,
            self.state,
            "" if hardlinks else " (no hard links: publishing by rename)",
        )

    def close(self) -> None:
        """Discard the open part, if any (it can never be prepared now); prepared parts stay."""
        held = self._open_files.held()
        if held is None:
            return
        part = held[0]
        try:
            self.abort(part)
        except sdk.SinkError as exc:
            self.log.warning(
                "part %s: could not discard the open part on close: %s", part.token, exc
            )

    # -- markers: the part's directory, or its manifest --

    def load_marker(self, part: sdk.PartId) -> sdk.PartMarker | None:
        with self._fs("reading the part's state", part, sdk.RetriableSinkError):
            manifest = self._layout.manifest(part)
            try:
                return self._marker(part, "committed", read_json(manifest), manifest)
            except FileNotFoundError:
                pass
            prepared = self._layout.prepared_dir(part)
            staged = read_prepared(part, prepared, self.name)
            if staged is not None:
                return self._marker(part, "prepared", staged[0], prepared / PREPARED_FILE)
            if self._layout.open_dir(part).exists():
                return sdk.PartMarker(part, "open")
        return None

    def _marker(
        self, part: sdk.PartId, state: sdk.PartState, document: Any, path: Path
    ) -> sdk.PartMarker:
        """The marker a manifest or ``PREPARED.json`` stands for (both hold the positions)."""
        try:
            positions = manifest_positions(document)
            return sdk.PartMarker(part, state, positions, int(document.get("records", 0)))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise sdk.FatalSinkError(f"{path} is unreadable: {exc}", sink=self.name) from exc

    def save_marker(
        self, marker: sdk.PartMarker, *, expect: Collection[sdk.PartState | None]
    ) -> bool:
        """``open``: create the part's directory with its LOCK held. ``prepared``: write what is
        buffered, ``PREPARED.json``, and rename the directory to ``prepared/`` (the prepare)."""
        part = marker.part
        if marker.state == "open":
            with self._fs("begin", part, sdk.RetriableSinkError):
                if self._layout.state_of(part) not in expect:
                    return False
                target = self._layout.open_dir(part)
                opened = OpenFiles(
                    part,
                    target,
                    create_locked(target),
                    self._encoder,
                    self.config.max_file_records,
                    self.config.buffered_limit,
                )
                if self._typing is not None:
                    opened.schemas = PartSchemas(
                        part,
                        target,
                        self._datasets,
                        self._typing,
                        self._groups,
                        self.config.auto_evolve,
                        self.log,
                    )
            self._open_files.put(part, opened)
            self.log.debug("part %s: begun in %s", part.token, target)
            return True
        if marker.state != "prepared":
            raise sdk.FatalSinkError(
                f"part {part.token}: the files sink keeps no {marker.state} marker", sink=self.name
            )
        op = self._open_files.get(part)
        if op is None or "open" not in expect:
            return False  # not open here: the caller looks at what the part is
        with self._fs("prepare", part, sdk.AbortTransactionError):
            op.flush_all()
            document = op.document(self.name, self.config.format, marker.positions)
            write_json_atomic(op.directory / PREPARED_FILE, document)
            # The prepare: atomic and complete.
            rename_durable(op.directory, self._layout.prepared_dir(part))
        self._open_files.get(part, take=True)
        os.close(op.lock_fd)
        self.log.debug(
            "part %s: %d records in %d files staged in %.3fs",
            part.token,
            op.records,
            len(op.files),
            time.monotonic() - op.started,
        )
        return True

    def list_parts(self, state: sdk.PartState) -> list[sdk.PartId]:
        with self._fs(f"listing {state} parts", None, sdk.RetriableSinkError):
            if state == "open":
                return [p for _, p in self._parts_in(self._layout.dir("open"), warn=False)]
            if state == "prepared":
                return self._prepared_parts()
            if state == "committed":
                return [
                    sdk.PartId(self.context.pipeline, info.txn, info.participant)
                    for info in self._manifests.scan().values()
                ]
        return []  # an aborted part leaves nothing behind

    def _parts_in(self, directory: Path, *, warn: bool) -> Iterator[tuple[Path, sdk.PartId]]:
        for entry in directory.iterdir():
            if entry.name.startswith("."):
                continue  # a begin under way (or dead: setup removes it)
            try:
                yield entry, sdk.PartId.parse(entry.name)
            except ValueError:
                if warn:
                    self.log.warning("ignoring %s: not a part directory", entry)

    def _prepared_parts(self) -> list[sdk.PartId]:
        parts: list[sdk.PartId] = []
        with self._decide_lock:
            for entry, part in self._parts_in(self._layout.dir("prepared"), warn=True):
                if not self.owns(part):
                    self.log.warning("ignoring %s: belongs to pipeline %s", entry, part.pipeline)
                    continue
                if self._layout.manifest(part).exists():
                    self._layout.discard(entry)  # committed; a crash interrupted the cleanup
                    continue
                parts.append(part)
        return parts

    def abandoned(self, part: sdk.PartId, before_txn: int) -> bool:
        """Whether the writer of the open ``part`` is gone: its ``flock`` on the part's LOCK is.

        ``before_txn`` is not needed: the lock tells a live writer from a dead one, whatever
        its transaction. Liveness comes from the kernel: the writer holds the lock until it
        prepares, aborts or dies, so no pid, host name or clock is trusted. (On NFS, ``flock``
        needs NFSv4 locks.)
        """
        fd = claim(self._layout.open_dir(part))
        if fd is None:
            return False
        if fd >= 0:
            os.close(fd)
        return True

    # -- the write path --

    @property
    def supports_deletes(self) -> bool:
        """With ``op_column``: a delete is a change row (``docs/cdc.md``)."""
        return bool(self.config.op_column)

    def _change_rows(
        self, records: Sequence[sdk.Record], rejected: list[sdk.Rejected]
    ) -> Sequence[sdk.Record]:
        """With ``op_column``, every record as a change row (``u`` or ``d``); a record that
        already has that field is refused, never overwritten."""
        col = self.config.op_column
        if not col:
            return records
        rows = []
        for r in records:
            if col in r.value:
                rejected.append(refusal(r, f"field {col!r} collides with op_column", col))
                continue
            rows.append(
                r._replace(value={**r.value, col: "d" if r.deleted else "u"}, deleted=False)
            )
        return rows

    def check(self, records: Sequence[sdk.Record]) -> Sequence[sdk.Rejected]:
        """What :meth:`write` would refuse: the same per-record code (the output group, then
        :meth:`Encoder.row`), without buffering anything."""
        rejected: list[sdk.Rejected] = []
        records = self._change_rows(records, rejected)
        row, key = self._encoder.row, self._groups.key
        for record in records:
            group = key(record)
            if isinstance(group, str):
                rejected.append(refusal(record, group, None))
                continue
            try:
                row(record)
            except (Mismatch, Refused) as exc:
                rejected.append(refusal(record, str(exc), exc.field_name))
        return rejected

    # -- the raw path: JSON values into Arrow without decoding (:mod:`._raw`) --

    def accepts_raw(self) -> bool:
        """Inferred Parquet (no ``schema``, no ``op_column``): the values are read into Arrow
        by :class:`~._raw.RawReader`, each batch exactly as its decoded records would be or,
        when that cannot be vouched for, decoded."""
        return self._raw is not None

    def makes_targets_for(self, shape: sdk.RawShape) -> bool:
        """Plain JSON values carry no schema, so their datasets need nothing opened."""
        return shape != sdk.PLAIN_JSON and self.makes_targets

    def check_raw(self, batch: sdk.RawBatch) -> Sequence[sdk.Rejected] | None:
        """:meth:`check` of raw values: the same refusals, found by the reading that
        :meth:`stage_raw` then uses; None when the batch is to be decoded."""
        judged = self._judge(batch)
        self._judged = (batch.values, judged)
        return None if judged is None else judged.refused

    def stage_raw(self, part: sdk.PartId, batch: sdk.RawBatch) -> Sequence[sdk.Rejected] | None:
        op = self._open_files.get(part)
        if op is None:
            raise sdk.AbortTransactionError(f"part {part.token} is not open here", sink=self.name)
        cached, self._judged = self._judged, None
        judged = None
        if cached is not None and cached[0] is batch.values and not batch.known_undecodable():
            judged = cached[1]  # the batch check_raw read, and no sink has found a bad value
        if judged is None:
            judged = self._judge(batch)
            if judged is None:
                return None
        with self._fs("write", part, sdk.AbortTransactionError):
            op.write_chunks(judged.chunks, len(judged.refused))
        return judged.refused

    def _judge(self, batch: sdk.RawBatch) -> _Judged | None:
        """What :meth:`stage` would make of the batch's records: the refusals, and one chunk of
        inferred columns per output file, each read from the values of that file alone (as
        :meth:`Encoder.encode` infers per file of one write); None: decode the batch."""
        source = self.config.source_columns
        if self._raw is None or (origins := batch.origins(positions=source)) is None:
            return None
        topics, partitions, offsets, stamps = origins
        skip = set(batch.known_undecodable())
        refused: dict[int, sdk.Rejected] = {}
        key_of = self._groups.key_of
        distinct = set(topics)
        bad = {t: why for t in distinct if isinstance(why := key_of(t, 0), str)}
        for i, topic in enumerate(topics) if bad else ():
            if topic in bad and i not in skip:
                skip.add(i)
                if (record := batch.record(i)) is not None:
                    refused[i] = refusal(record, bad[topic], None)
        kept = [i for i in range(len(batch)) if i not in skip] if skip else range(len(batch))
        groups: dict[Key, list[int]] = {}
        one = self._one_group(kept, topics, stamps, len(distinct) == 1)
        if one is not None:
            groups[(one[0], one[1], -1)] = list(kept)
        else:
            for i in kept:
                group = key_of(topics[i], stamps[i])
                assert not isinstance(group, str)  # the topic's refusal is above
                groups.setdefault((group[0], group[1], -1), []).append(i)
        chunks: dict[Key, Columns | None] = {}
        values = batch.values
        for key, at in groups.items():
            read = self._raw.read(
                values if len(at) == len(values) else [values[i] for i in at], key[0]
            )
            if read is None:
                return None
            fields = read.fields
            if read.empty:
                for j in read.empty:
                    if (record := batch.record(at[j])) is None:
                        return None  # not an object after all: the decoded path says why
                    refused[at[j]] = refusal(record, EMPTY_ROW, None)
                gone = set(read.empty)
                rows = [j for j in range(len(at)) if j not in gone]
                at = [at[j] for j in rows]
                index = pa.array(rows, type=pa.int64())
                fields = {name: f.take(index) for name, f in fields.items()}
            if not at:
                chunks[key] = None
                continue
            columns = None
            if source:
                columns = [
                    pa.array([topics[i] for i in at], type=pa.string()),
                    pa.array([partitions[i] for i in at], type=pa.int32()),
                    pa.array([offsets[i] for i in at], type=pa.int64()),
                    pa.array([stamps[i] for i in at], type=pa.int64()),
                ]
            chunks[key] = Columns(len(at), fields, columns)
        return _Judged([refused[i] for i in sorted(refused)], chunks)

    def _one_group(
        self, kept: Sequence[int], topics: list[str], stamps: list[int], one_topic: bool
    ) -> tuple[str | None, str | None] | None:
        """The output group of every value at ``kept`` when they share one (the usual batch:
        one topic, one day), found without a look at each value; else None."""
        if not kept:
            return None
        if self._groups.mode == "none":
            return (None, None)
        topic = topics[kept[0]]
        if not one_topic and any(topics[i] != topic for i in kept):
            return None
        if self._groups.mode == "topic":
            return (topic, None)
        ts = [stamps[i] for i in kept] if len(kept) != len(stamps) else stamps
        low, high = min(ts), max(ts)
        if low < 0 or low // _DAY_MS != high // _DAY_MS:
            return None
        group = self._groups.key_of(topic, low)
        return None if isinstance(group, str) else group

    def open_targets(
        self, part: sdk.PartId, records: Sequence[sdk.Record]
    ) -> Sequence[sdk.Rejected | sdk.Held]:
        """The datasets ``records`` go to, ready to take them: each record with a schema is
        compared with its dataset's (:mod:`._datasets`); a compatible change is reserved by this
        part with ``auto_evolve``, refused without it, and held while another undecided part
        changes the same dataset; an incompatible one is refused."""
        if self._typing is None:
            return ()
        op = self._open_files.get(part)
        if op is None or op.schemas is None:
            raise sdk.AbortTransactionError(f"part {part.token} is not open here", sink=self.name)
        with self._fs("open targets", part, sdk.RetriableSinkError):
            return op.schemas.open(records)

    def stage(self, part: sdk.PartId, records: Sequence[sdk.Record]) -> Sequence[sdk.Rejected]:
        """Buffer ``records`` per output file; a full buffer becomes a file in the open dir."""
        op = self._open_files.get(part)
        if op is None:
            raise sdk.AbortTransactionError(f"part {part.token} is not open here", sink=self.name)
        refused: list[sdk.Rejected] = []
        records = self._change_rows(records, refused)
        with self._fs("write", part, sdk.AbortTransactionError):
            if op.schemas is not None:
                records = self._targets_taken(op.schemas, records, refused)
            return refused + op.write(records, self._groups)

    def _targets_taken(
        self, schemas: PartSchemas, records: Sequence[sdk.Record], refused: list[sdk.Rejected]
    ) -> Sequence[sdk.Record]:
        """``records`` less those the part's datasets refuse. The runtime asked
        :meth:`open_targets` first, so this is a lookup per record; a caller that did not (a
        test, the kit) gets the same decisions here, and a record that must wait aborts the
        part, which a later try writes."""
        pending = [
            r
            for r in records
            if r.schema is not None
            and not isinstance(group := self._groups.key(r), str)
            and not schemas.taken(group[0] or "", r)
        ]
        if not pending:
            return records
        out = schemas.open(pending)
        for answer in out:
            if isinstance(answer, sdk.Held):
                raise sdk.AbortTransactionError(
                    f"write: {answer.reason} (open_targets was not asked first)", sink=self.name
                )
        gone = {a.record.record_id for a in out}
        refused.extend(a for a in out if isinstance(a, sdk.Rejected))
        return [r for r in records if r.record_id not in gone]

    # -- the commit and recovery path --

    def publish(self, part: sdk.PartId) -> None:
        """Link every staged file to its target, then write the manifest: the commit point."""
        layout = self._layout
        with self._decide_lock, self._fs("commit", part, sdk.RetriableSinkError):
            manifest = layout.manifest(part)
            prepared = layout.prepared_dir(part)
            if manifest.exists():
                if layout.discard(prepared):
                    self.log.info(
                        "part %s: was committed; removed its staged leftovers", part.token
                    )
                return
            staged = read_prepared(part, prepared, self.name)
            if staged is None:
                if manifest.exists():  # a concurrent committer finished between our two looks
                    return
                raise sdk.UnknownPartError(
                    f"commit of part {part.token}: neither prepared nor committed in {self.state}",
                    sink=self.name,
                )
            document, files = staged
            if not self._publisher.publish(part, prepared, files, manifest):
                return  # another process completed the commit meanwhile
            # The dataset schemas the part changed, before its commit point: repeated after a
            # crash, the merge changes nothing more.
            for dataset, raw in (document.get("schemas") or {}).items():
                self._datasets.publish(dataset, schema_from_json(raw), part.token)
            document.pop("prepared_by", None)
            document["files"] = [
                {k: v for k, v in f.to_json().items() if k != "name"} for f in files
            ]
            document["committed_at"] = now()
            write_json_atomic(manifest, document)  # the commit point of this part here
            layout.discard(prepared)
        self.log.debug(
            "part %s: %d records in %d files published", part.token, document["records"], len(files)
        )

    def discard(self, part: sdk.PartId) -> None:
        """The open or prepared directory disappears by one rename into ``trash/``."""
        op = self._open_files.get(part, take=True)
        if op is not None:
            os.close(op.lock_fd)  # the directory itself goes below, like any other
        layout = self._layout
        prepared, opened = layout.prepared_dir(part), layout.open_dir(part)
        if not (prepared.exists() or opened.exists()):
            return  # nothing to discard (every begin asks): no need to wait for a commit
        with self._decide_lock, self._fs("abort", part, sdk.RetriableSinkError):
            if layout.manifest(part).exists():
                raise sdk.FatalSinkError(
                    f"abort of part {part.token}, which is already committed", sink=self.name
                )
            if prepared.exists():
                staged = read_prepared(part, prepared, self.name)
                self._publisher.refuse_if_published(part, prepared, staged[1] if staged else [])
                layout.discard(prepared)
            if opened.exists():
                self._discard_abandoned(part, opened)

    def _discard_abandoned(self, part: sdk.PartId, opened: Path) -> None:
        fd = claim(opened)
        if fd is None:
            raise sdk.RetriableSinkError(
                f"part {part.token} is open in another live process ({opened / LOCK_FILE})",
                sink=self.name,
            )
        try:
            self._layout.discard(opened)
        finally:
            if fd >= 0:
                os.close(fd)

    # -- housekeeping --

    def committed_positions(self) -> dict[sdk.TopicPartition, int]:
        """Next offset per source partition: the highest in the manifests of this pipeline.

        A manifest is written at the commit point of its part, so prepared and aborted parts
        never count, and the ``max`` per partition keeps decisions applied out of order from
        moving a position back. The manifests of this dataset and pipeline are the sink's identity
        (as for ``commit`` and ``in_doubt``), whatever the sink's name.

        Cost: one listing of ``manifests/`` per call, plus parsing the manifests this instance has
        not seen yet (they never change, so they are cached by name and inode): the first call of
        a process reads all of them, later ones only the new ones. :meth:`forget` keeps their
        number bounded.
        """
        with self._fs("committed_positions", None, sdk.RetriableSinkError):
            return self._manifests.positions()

    def last_committed(self) -> sdk.CommittedInfo | None:
        """The manifest of this pipeline with the highest txn (of that txn's parts, the one
        committed last), with the ``committed_at`` it records (the committer's clock).

        Same cost as :meth:`committed_positions`: one listing, new manifests parsed once.
        """
        with self._fs("last_committed", None, sdk.RetriableSinkError):
            return self._manifests.last()

    def forget(self, before_txn: int) -> int:
        """Delete the manifests of parts with ``txn < before_txn``; returns how many went.

        Only committed parts have a manifest (an aborted part leaves nothing, a prepared one has
        only its staged directory), so prepared parts and the data files are never touched. What
        :meth:`committed_positions` needs is kept: per source partition, the manifest holding its
        highest offset (ties: the newest part), whatever its txn; and what
        :meth:`last_committed` needs: the manifests of the highest txn. Concurrent calls from
        several processes are safe: a manifest is deleted only by a call that saw a better one
        for each of its partitions and a higher txn, so the best one of each partition and the
        newest stay. Staged leftovers of a forgotten part (a commit interrupted before its
        clean-up) go first, so the part can never look prepared again.

        After this the sink no longer knows a forgotten part: ``commit`` of it raises
        :class:`UnknownPartError`, ``abort`` of it is a no-op, and ``begin`` of its id is
        accepted. Callers pass a ``before_txn`` whose decisions nobody repeats any more (the
        decision log is past it), which is what the SDK asks of them.
        """
        layout = self._layout
        with self._decide_lock, self._fs("forget", None, sdk.RetriableSinkError):
            forgotten = self._manifests.forget(
                before_txn, lambda part: layout.discard(layout.prepared_dir(part))
            )
        if forgotten:
            self.log.info("forgot %d manifests of parts before txn %d", forgotten, before_txn)
        return forgotten
