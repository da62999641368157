"""The write path: every record becomes one staged entry, and a write's entries are stored in
``staging_collection`` packed into chunk documents::

    {_id: "<pk>|#<seq>.<crc32>", part: "<pk>", seq: <first entry's seq>, n: <entries>,
     entries: [{_id: "<pk>|<topic:partition:offset>", part, seq, doc: <the target document>}, ...]}

where ``pk = "<sink name>:<part token>"``. ``doc`` already carries its final, deterministic
``_id`` (:mod:`._documents`). A chunk document holds at most ``commit_chunk_size`` entries and
``commit_chunk_bytes`` (at most 12 MiB, under MongoDB's 16 MiB document limit; a larger entry
is a chunk of its own), so the commit applies whole chunk documents, one or more per
transaction. Packing is what makes staging cheap: the server indexes, writes and later deletes
one document per chunk instead of one per record -- three writes per record were 90% of the
sink's cost. Staging is a plain ``insert_many(ordered=False)`` with write concern majority; a
retried write packs the same records into the same ``_id`` s and the duplicates are ignored
(:func:`pack`). Nothing of the part is in the target collection yet. Parts staged by versions
before packing, one document per record, are read as chunks of one entry; a part staged by
this version cannot be committed by an older one, so upgrade a pipeline's participants
together.

When the target can refuse a document by itself -- it has a validator or a unique index besides
``_id`` -- the part's documents are first tried on it in a MongoDB transaction that is then
aborted, so what it refuses (a duplicate key of a unique index, a validation failure, an index
key too long) is rejected at write time, never met by a commit. Checked against what is
committed when the part writes: two parts in flight at once that both bring the same unique
value can still meet at commit, which then fails naming the document.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import bson
from bson.raw_bson import RawBSONDocument
from pymongo import ReplaceOne
from pymongo.errors import BulkWriteError
from pymongo.read_concern import ReadConcern
from pymongo.read_preferences import ReadPreference

from twophase.participants.sdk import (
    AbortTransactionError,
    PartId,
    Record,
    Rejected,
    RetriableSinkError,
    TargetTemplate,
)
from twophase.participants.sinks.mongodb._documents import Documents, Reject
from twophase.participants.sinks.mongodb._store import DUPLICATE_KEY, RAW, RETRIABLE_CODES, Store

__all__ = ["OpenStaging", "entries_of", "pack", "target_refuses"]

#: A chunk document's bytes at most, whatever ``commit_chunk_bytes`` says: MongoDB refuses
#: documents over 16 MiB, and the wrapper and the transaction need some room.
PACK_BYTES_MAX = 12 * 1024 * 1024


def pack(pk: str, staged: Sequence[RawBSONDocument], docs: int, size: int) -> list[RawBSONDocument]:
    """``staged`` entries (in seq order) as chunk documents of at most ``docs`` entries and
    ``size`` bytes each (an entry larger than that alone). A chunk's ``_id`` names its first
    seq and a checksum of its entries: the same entries always pack into the same ``_id`` s (a
    retried write's chunks are duplicates), and a retry that packs other entries from the same
    seq -- the target refused a record on one try and not on the other -- makes new ones, so
    the prepare's count of staged entries tells (and the part is aborted and re-read) instead
    of one record being counted as staged in a chunk that holds another."""
    size = min(size, PACK_BYTES_MAX)
    out: list[RawBSONDocument] = []
    group: list[RawBSONDocument] = []
    used = 0

    def close() -> None:
        first = int(group[0]["seq"])
        crc = 0
        for entry in group:
            crc = zlib.crc32(entry.raw, crc)
        body = {"_id": f"{pk}|#{first}.{crc:08x}", "part": pk, "seq": first, "n": len(group)}
        out.append(RawBSONDocument(bson.encode({**body, "entries": group})))

    for entry in staged:
        if group and (len(group) >= docs or used + len(entry.raw) > size):
            close()
            group, used = [], 0
        group.append(entry)
        used += len(entry.raw)
    if group:
        close()
    return out


def entries_of(stored: RawBSONDocument) -> list[RawBSONDocument]:
    """The staged entries of a document of the staging collection: a chunk document's, or
    (staged before packing) the document itself."""
    entries = stored.get("entries")
    return [stored] if entries is None else list(entries)


def target_refuses(store: Store, name: str | None = None) -> bool:
    """Whether the target (``name``, else the configured collection) can refuse a document by
    itself: a validator, or a unique index besides ``_id`` (read once per part and collection,
    so an index added later counts from the next part)."""
    name = name or store.cfg.collection
    db = store.client[store.cfg.database]
    for info in db.list_collections(filter={"name": name}):
        if info.get("options", {}).get("validator"):
            return True
    indexes = store.coll(name).list_indexes()
    return any(ix.get("unique") and ix.get("name") != "_id_" for ix in indexes)


@dataclass(slots=True)
class OpenStaging:
    """What the open part keeps in memory: the next staging seq, how many documents are staged,
    and how to repeat a write that failed (the part's life cycle itself is BatchingSink's, which
    never runs two writes, or a write and the prepare, of one part at once)."""

    part: PartId
    pk: str
    store: Store
    documents: Documents
    #: The target can refuse a document by itself (validator, unique index): write() tries
    #: each batch on it first.
    strict: bool = False
    next_seq: int = 0
    staged: int = 0
    #: Chunk ``_id`` s of a write() that failed, with their entries: a retry finding them
    #: already staged counts their entries.
    uncertain: dict[str, int] = field(default_factory=dict)
    #: Record ids and first seq of the last write() that failed with a retriable error.
    failed: tuple[tuple[str, ...], int] | None = None
    #: With a ``collection`` template: each record's collection, and per collection whether
    #: it can refuse a document (``strict``, looked up on its first record in the part).
    template: TargetTemplate | None = None
    strict_of: dict[str, bool] = field(default_factory=dict)

    def write(self, records: Sequence[Record]) -> list[Rejected]:
        """Stage one entry per record, packed into chunk documents; a retried call stages each of
        them once."""
        sink = self.store.sink
        batch = tuple(r.record_id for r in records)
        # A retry of a failed call gets the same seqs (its documents may be staged already);
        # anything else gets fresh ones, so no two staged documents ever share a seq.
        retry = self.failed is not None and self.failed[0] == batch
        seq = self.failed[1] if self.failed is not None and retry else self.next_seq
        base = seq
        rejected: list[Rejected] = []
        staged: list[RawBSONDocument] = []
        staged_records: list[Record] = []
        for record in records:
            coll = None
            if self.template is not None:
                target = self.template.render(record)
                if isinstance(target, Rejected):
                    rejected.append(Rejected(record, target.reason, {"sink": sink}))
                    continue
                coll = target
                if coll not in self.strict_of:
                    with self.store.errors("write", self.part.token, AbortTransactionError):
                        self.store.ensure_collection(coll)
                        self.strict_of[coll] = target_refuses(self.store, coll)
            try:
                staged.append(self.documents.staged(self.part, self.pk, record, seq, coll))
            except Reject as exc:
                rejected.append(Rejected(record, str(exc), {"sink": sink}))
                continue
            staged_records.append(record)
            seq += 1
        if staged and (self.strict or any(self.strict_of.values())):
            refused = self._tried_on_target(staged)
            if refused:
                rejected.extend(
                    Rejected(staged_records[i], why, {"sink": sink})
                    for i, why in sorted(refused.items())
                )
                staged = [doc for i, doc in enumerate(staged) if i not in refused]
        try:
            inserted, duplicates = self._insert(staged) if staged else (0, [])
        except RetriableSinkError:
            self.failed = (batch, base)
            self.next_seq = max(self.next_seq, seq)
            raise
        self.next_seq = max(self.next_seq, seq)
        self.staged += inserted + sum(self.uncertain.get(d, 0) for d in duplicates)
        self.uncertain.clear()
        self.failed = None
        return rejected

    def _tried_on_target(self, staged: list[RawBSONDocument]) -> dict[int, str]:
        """Which of ``staged`` the target refuses, and why: each batch is written to the
        target in a MongoDB transaction that is always aborted. A write error ends a
        transaction, so each round finds one refused document and the rest are tried again."""
        refused: dict[int, str] = {}
        # A delete cannot be refused by a validator or a unique index.
        writes = [i for i in range(len(staged)) if not staged[i].get("delete")]
        by_coll: dict[str | None, list[int]] = {}
        for i in writes:
            by_coll.setdefault(staged[i].get("coll"), []).append(i)
        for coll, some in by_coll.items():
            strict = self.strict if coll is None else self.strict_of.get(coll, False)
            if strict:
                refused.update(self._tried_on(coll, staged, some))
        return refused

    def _tried_on(
        self, coll: str | None, staged: list[RawBSONDocument], left: list[int]
    ) -> dict[int, str]:
        """:meth:`_tried_on_target` for the documents ``left`` of one target collection."""
        store, token = self.store, self.part.token
        refused: dict[int, str] = {}
        target = (store.target if coll is None else store.coll(coll)).with_options(
            codec_options=RAW
        )
        while left:
            ops = [
                ReplaceOne({"_id": staged[i]["doc"]["_id"]}, staged[i]["doc"], upsert=True)
                for i in left
            ]
            with (
                store.errors("write", token, AbortTransactionError),
                store.client.start_session() as session,
            ):
                # Its own concerns, not the URI's: a transaction refuses w: 0 and the read
                # concerns "available" and "linearizable" (the probe is always aborted).
                session.start_transaction(
                    read_concern=ReadConcern("majority"),
                    write_concern=store.wc,
                    read_preference=ReadPreference.PRIMARY,
                )
                try:
                    target.bulk_write(ops, ordered=True, session=session)
                    return refused
                except BulkWriteError as exc:
                    errors = exc.details.get("writeErrors", [])
                finally:
                    if session.in_transaction:
                        session.abort_transaction()
            mine = [e for e in errors if e.get("code") not in RETRIABLE_CODES]
            if not mine:
                raise RetriableSinkError(
                    f"write: part {token}: trying documents on the target: "
                    f"{errors[0].get('errmsg') if errors else 'no write error reported'}",
                    sink=store.sink,
                )
            for e in mine:
                refused[left[int(e["index"])]] = (
                    f"MongoDB refused the document: {e.get('errmsg')} (code {e.get('code')})"
                )
            left = [i for i in left if i not in refused]
        return refused

    def _insert(self, staged: list[RawBSONDocument]) -> tuple[int, list[str]]:
        """Stage the entries ``staged``, packed: how many entries were new, and the chunk
        ``_id`` s that were there already."""
        store, token = self.store, self.part.token
        cfg = store.cfg
        chunks = pack(self.pk, staged, cfg.commit_chunk_size, cfg.commit_chunk_bytes)
        ids = [str(d["_id"]) for d in chunks]
        sizes = {i: int(d["n"]) for i, d in zip(ids, chunks, strict=True)}
        try:
            with store.errors("write", token, AbortTransactionError):
                try:
                    store.staging.insert_many(chunks, ordered=False)
                    return len(staged), []
                except BulkWriteError as exc:
                    errors = exc.details.get("writeErrors", [])
                    others = [e for e in errors if e.get("code") != DUPLICATE_KEY]
                    if others:
                        # An entry's ``_id`` ends with the record id: the record's coordinates.
                        at = chunks[int(others[0].get("index", 0))]["entries"][0]["_id"]
                        raise AbortTransactionError(
                            f"write: part {token}: {others[0].get('errmsg')} "
                            f"(in the chunk from record {str(at).rsplit('|', 1)[-1]}; "
                            f"{len(others)} chunks refused)",
                            sink=store.sink,
                        ) from exc
                    if exc.details.get("writeConcernErrors"):
                        raise RetriableSinkError(
                            f"write: part {token}: write concern not satisfied",
                            sink=store.sink,
                        ) from exc
                    duplicates = [ids[int(e["index"])] for e in errors]
                    return len(staged) - sum(sizes[d] for d in duplicates), duplicates
        except RetriableSinkError:
            self.uncertain.update(sizes)
            raise
