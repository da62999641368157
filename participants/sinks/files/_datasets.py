"""Dataset schemas: the one schema of each dataset's typed files, changed only by committed parts.

A *dataset* is what readers scan as one table: ``{path}/{topic}`` (``{path}`` itself with
``partition_by: none``). Its schema is the merge of the schemas of the parts committed into it,
kept where readers find it -- ``{dataset}/_common_metadata``, the Parquet convention: a Parquet
file with the schema and no rows, here also carrying the twophase schema as ``twophase.schema``
in its key-value metadata -- and judged by the SDK's one rule,
:func:`~twophase.participants.sdk.compare`:

* A record whose stored schema (:class:`~._typed.Typing`) needs no change is written by the
  dataset's schema (an older, narrower version converts to it as it is).
* A compatible change (a field added, a type widened, a field made optional) with
  ``auto_evolve`` is **reserved** by the open part: under the dataset's lock, the part writes the
  merged schema into ``SCHEMAS.json`` in its own directory, which the prepare renames with
  the rest of the part. Its files carry that schema; ``PREPARED.json`` and then the manifest
  record it; the commit merges it into ``_common_metadata`` (under the same lock, before the
  manifest: the commit point) -- so the schema appears when the part commits, and an aborted
  part, whose directory goes to the trash, leaves no trace of it.
* An incompatible change, and any change without ``auto_evolve``, is refused (dead-lettered)
  with compare()'s reason. A dataset's first schema is made from its first record with one
  whatever ``auto_evolve`` says: making a directory needs no permission.
* While another undecided part (open or prepared, of any participant or pipeline writing this
  path) reserves a change of the dataset, a record that needs a change is **held** for a
  later part: changes are made one part at a time, so two parts never commit schemas that
  contradict each other, and no update is lost. A part never waits for another's decision
  (the lock is held only to read and write these small files).

Why ``_common_metadata`` is kept under a lock rather than recomputed from the manifests:
retention (:meth:`FileSink.forget`) deletes old manifests, and the schema must outlive them.
The merge is idempotent and changes are serialised, so a commit repeated after a crash, or
applied late, gives the same schema.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from twophase.participants.sdk import (
    Change,
    FatalSinkError,
    Field,
    Held,
    PartId,
    Record,
    RecordSchema,
    Rejected,
    compare,
)
from twophase.participants.sdk.staging import (
    makedirs_durable,
    read_json,
    write_atomic,
    write_json_atomic,
)
from twophase.participants.sinks.files._encoders import Refused, refusal
from twophase.participants.sinks.files._layout import claim
from twophase.participants.sinks.files._schema import Mismatch
from twophase.participants.sinks.files._staging import OutputGroups
from twophase.participants.sinks.files._typed import (
    SCHEMA_KEY,
    TypedEncoder,
    Typing,
    arrow_type,
    schema_from_json,
    schema_to_json,
)

__all__ = [
    "RESERVATION_FILE",
    "SCHEMA_FILE",
    "DatasetSchemas",
    "PartSchemas",
    "merged",
    "read_dataset",
]

#: The dataset's schema, in the dataset's directory (hidden from readers by its ``_``).
SCHEMA_FILE = "_common_metadata"
#: An open or prepared part's reserved schema changes, in the part's directory.
RESERVATION_FILE = "SCHEMAS.json"


def merged(target: RecordSchema | None, record: RecordSchema) -> RecordSchema:
    """``target`` changed as :func:`compare` allows for ``record`` (refused changes are not
    made): widened types, optional fields, added fields at the end (nullable: the rows stored
    before have none). The first schema of a dataset is the record's own."""
    if target is None:
        out = RecordSchema(record.fields, name=record.name, key=record.key)
    else:
        changes: dict[str, list[Change]] = {}
        for c in compare(target, record):
            if c.refused is None:
                changes.setdefault(c.name, []).append(c)
        fields: list[Field] = []
        for f in target:
            t, has_default = f.type, f.has_default
            for c in changes.get(f.name, ()):
                if c.kind == "widen" and c.new is not None:
                    t = replace(c.new, nullable=t.nullable or c.new.nullable)
                elif c.kind == "relax":
                    t = replace(t, nullable=True)
            fields.append(Field(f.name, t, has_default))
        for f in record:
            if any(c.kind == "add" for c in changes.get(f.name, ())):
                fields.append(Field(f.name, replace(f.type, nullable=True), f.has_default))
        out = RecordSchema(tuple(fields), name=target.name, key=target.key)
    digest = hashlib.sha1(orjson.dumps(schema_to_json(out)), usedforsecurity=False).hexdigest()
    return replace(out, id=f"dataset:{digest[:16]}")


def _described(changes: Sequence[Change]) -> str:
    parts = []
    for c in changes:
        if c.kind == "add" and c.new is not None:
            parts.append(f"field {c.name!r} added ({c.new.describe()})")
        elif c.kind == "widen" and c.old is not None and c.new is not None:
            parts.append(f"field {c.name!r} {c.old.describe()} -> {c.new.describe()}")
        elif c.kind == "relax":
            parts.append(f"field {c.name!r} made optional")
        else:
            parts.append(f"field {c.name!r} {c.kind}")
    return ", ".join(parts)


class DatasetSchemas:
    """The committed schema of each dataset under ``base``, its lock, and the changes open and
    prepared parts reserve (of every pipeline writing ``base``: they share the datasets)."""

    def __init__(self, base: Path, sink: str, log: logging.Logger) -> None:
        self.base = base
        #: ``{base}/_twophase``: every pipeline's state, and ``_schemas/`` (the locks).
        self.root = base / "_twophase"
        self.locks = self.root / "_schemas"
        self.sink = sink
        self.log = log
        self._cache: dict[str, tuple[tuple[int, int, int], RecordSchema]] = {}

    def directory(self, dataset: str) -> Path:
        return self.base / dataset if dataset else self.base

    def committed(self, dataset: str) -> RecordSchema | None:
        """The dataset's schema as committed (None before its first typed part commits); one
        ``stat`` when it has not changed since it was last read."""
        path = self.directory(dataset) / SCHEMA_FILE
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        known = self._cache.get(dataset)
        if known is not None and known[0] == stamp:
            return known[1]
        try:
            metadata = pq.read_schema(path).metadata or {}
            schema = schema_from_json(orjson.loads(metadata[SCHEMA_KEY.encode()]))
        except FileNotFoundError:
            return None
        except (KeyError, ValueError, TypeError, pa.ArrowException) as exc:
            raise FatalSinkError(
                f"{path} is not a dataset schema twophase wrote ({exc}); move it away",
                sink=self.sink,
            ) from exc
        schema = merged(None, schema)  # its id, from its content
        self._cache[dataset] = (stamp, schema)
        return schema

    @contextlib.contextmanager
    def locked(self, dataset: str) -> Iterator[None]:
        """The dataset's lock (an ``flock``, across processes): held only while reading and
        writing its schema and reservations, never across a part."""
        name = f"topic={dataset}.lock" if dataset else "all.lock"
        fd = os.open(self.locks / name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def reserved(self, dataset: str, mine: str) -> list[tuple[str, RecordSchema]]:
        """The schemas other undecided parts reserved for ``dataset``: ``(token, schema)``.
        Call under the dataset's lock. An open part whose writer is gone (its ``flock`` is free)
        can never be prepared, so its reservation does not count."""
        out: list[tuple[str, RecordSchema]] = []
        if not self.root.exists():
            return out
        for pipeline in self.root.iterdir():
            if pipeline.name.startswith(("_", ".")) or not pipeline.is_dir():
                continue
            # ``open`` before ``prepared``: a part renamed between the two listings is seen in
            # the second.
            for kind in ("open", "prepared"):
                directory = pipeline / kind
                if not directory.is_dir():
                    continue
                for entry in directory.iterdir():
                    if entry.name.startswith(".") or entry.name == mine:
                        continue
                    try:
                        document = read_json(entry / RESERVATION_FILE)
                    except (FileNotFoundError, NotADirectoryError):
                        continue
                    raw = (document.get("datasets") or {}).get(dataset)
                    if raw is None:
                        continue
                    if kind == "open" and (fd := claim(entry)) is not None:
                        if fd >= 0:
                            os.close(fd)
                        continue  # abandoned
                    out.append((entry.name, schema_from_json(raw)))
        return out

    def publish(self, dataset: str, schema: RecordSchema, token: str) -> bool:
        """Merge a committed part's ``schema`` into the dataset's (the commit, before its
        manifest); whether it changed. Idempotent."""
        directory = self.directory(dataset)
        with self.locked(dataset):
            current = self.committed(dataset)
            if current is not None:
                refused = [c.refused for c in compare(current, schema) if c.refused]
                if refused:
                    # Changes are made one part at a time, so this needs two writers that do
                    # not share the lock (another file system, another copy of the base).
                    self.log.error(
                        "part %s: its schema of dataset %r contradicts the committed one, "
                        "which keeps its types: %s",
                        token,
                        dataset or "/",
                        "; ".join(r for r in refused if r),
                    )
            new = merged(current, schema)
            if current is not None and new == current:
                return False
            makedirs_durable(directory)
            arrow = pa.schema(
                [pa.field(f.name, arrow_type(f.type)) for f in new],
                metadata={SCHEMA_KEY: orjson.dumps(schema_to_json(new)).decode()},
            )
            out = pa.BufferOutputStream()
            pq.write_metadata(arrow, out)
            write_atomic(directory / SCHEMA_FILE, memoryview(out.getvalue()))
        self.log.info(
            "part %s: dataset %r schema %s",
            token,
            dataset or "/",
            "made" if current is None else _described(compare(current, new)),
        )
        return True


@dataclass(frozen=True, slots=True)
class _Wait:
    """The dataset cannot take the schema in this part; why."""

    reason: str


@dataclass(slots=True)
class _Target:
    """What one part writes one dataset's typed files with."""

    schema: RecordSchema
    encoder: TypedEncoder
    #: Bumped whenever the schema changes within the part: a new file is started for it.
    gen: int
    #: The schema is a change this part reserved (not the committed one).
    reserved: bool


@dataclass(slots=True)
class PartSchemas:
    """The open part's schemas, per dataset: the committed one, or the change it reserved."""

    part: PartId
    directory: Path
    datasets: DatasetSchemas
    typing: Typing
    groups: OutputGroups
    auto_evolve: bool
    log: logging.Logger
    targets: dict[str, _Target] = field(default_factory=dict)
    #: (dataset, stored schema key) -> None (taken) or why not.
    decided: dict[tuple[str, Any], str | None] = field(default_factory=dict)

    def open(self, records: Sequence[Record]) -> list[Rejected | Held]:
        """Make every dataset ready for ``records`` (those with a schema): what they refuse
        (:class:`Rejected`) and what waits for a later part (:class:`Held`)."""
        out: list[Rejected | Held] = []
        held: dict[tuple[str, Any], str] = {}
        for record in records:
            if record.schema is None:
                continue
            group = self.groups.key(record)
            if isinstance(group, str):
                continue  # no directory: the write refuses it
            dataset = group[0] or ""
            try:
                key, schema = self.typing.stored(record)
            except Mismatch as exc:
                out.append(refusal(record, str(exc), exc.field_name))
                continue
            k = (dataset, key)
            if k in self.decided:
                why = self.decided[k]
            elif k in held:
                out.append(Held(record, held[k]))
                continue
            else:
                answer = self._decide(dataset, schema)
                if isinstance(answer, _Wait):
                    held[k] = answer.reason
                    out.append(Held(record, answer.reason))
                    continue
                why = self.decided[k] = answer
            if why is not None:
                out.append(refusal(record, why, None))
        return out

    def target(self, dataset: str) -> _Target:
        """The schema the part writes ``dataset`` with (after :meth:`open` took its records)."""
        return self.targets[dataset]

    def taken(self, dataset: str, record: Record) -> bool:
        """Whether :meth:`open` took ``record`` (and so the part's schema for ``dataset``
        holds it)."""
        try:
            key, _schema = self.typing.stored(record)
        except Mismatch:
            return False
        return self.decided.get((dataset, key), "") is None

    def _decide(self, dataset: str, schema: RecordSchema) -> str | _Wait | None:
        """None: the dataset takes the schema (now, changed if need be); or why it never will;
        or why it cannot in this part (:class:`_Wait`)."""
        where = f"dataset {dataset!r}" if dataset else "the dataset"
        current = self.targets.get(dataset)
        base = current.schema if current is not None else self.datasets.committed(dataset)
        if base is not None and not compare(base, schema):
            return self._use(dataset, base, reserved=current is not None and current.reserved)
        # A change, or a refusal, by what this part knows: decided on the committed schema.
        with self.datasets.locked(dataset):
            committed = self.datasets.committed(dataset)
            own = current.schema if current is not None and current.reserved else None
            base = own or committed
            if base is not None:
                changes = compare(base, schema)
                refused = [c.refused for c in changes if c.refused]
                if refused:
                    return f"{where}: schema change refused: {'; '.join(r for r in refused if r)}"
                if not changes:
                    return self._use(dataset, base, reserved=own is not None)
                if not self.auto_evolve:
                    return (
                        f"{where}: the record's schema changes it ({_described(changes)}) and "
                        "auto_evolve is false"
                    )
            for token, theirs in self.datasets.reserved(dataset, self.part.token):
                if committed is None or compare(committed, theirs):
                    return _Wait(
                        f"{where}: its schema is being changed by part {token}, not decided yet"
                    )
            new = merged(base, schema)
            why = self._use(dataset, new, reserved=True)
            if why is None:
                self._write_reservations()
                self.log.info(
                    "part %s: %s schema %s (reserved until the part is decided)",
                    self.part.token,
                    where,
                    "made" if base is None else _described(compare(base, new)),
                )
            return why

    def _use(self, dataset: str, schema: RecordSchema, *, reserved: bool) -> str | None:
        current = self.targets.get(dataset)
        if current is not None and current.schema == schema:
            return None
        try:
            encoder = self.typing.encoder(schema)
        except Refused as exc:
            return str(exc)
        gen = 0 if current is None else current.gen + 1
        self.targets[dataset] = _Target(schema, encoder, gen, reserved)
        return None

    def reservations(self) -> dict[str, Any]:
        """The changes this part reserved, per dataset (``PREPARED.json``, the manifest)."""
        return {d: schema_to_json(t.schema) for d, t in self.targets.items() if t.reserved}

    def _write_reservations(self) -> None:
        write_json_atomic(
            self.directory / RESERVATION_FILE,
            {"version": 1, "token": self.part.token, "datasets": self.reservations()},
        )


def read_dataset(path: str | os.PathLike[str]) -> ds.Dataset:
    """A files sink dataset (``{path}/{topic}``, or ``path`` with ``partition_by: none``) as one
    ``pyarrow.dataset.Dataset`` of its merged schema: files written by older schemas read with
    the new fields null and widened types cast (``.to_table()`` reads it all). The ``date``
    directories become a column. Without a ``_common_metadata`` (no typed part committed yet),
    pyarrow's own discovery."""
    base = Path(path)
    discovered = ds.dataset(base, format="parquet", partitioning="hive")
    try:
        schema = pq.read_schema(base / SCHEMA_FILE)
    except FileNotFoundError:
        return discovered
    partitioning = discovered.partitioning
    if partitioning is not None:
        for f in partitioning.schema:
            if f.name not in schema.names:
                schema = schema.append(f)
    return ds.dataset(base, format="parquet", partitioning=partitioning, schema=schema)
