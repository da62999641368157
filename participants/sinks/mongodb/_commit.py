"""The commit and recovery path: staged documents move into the target in chunked MongoDB
transactions, under a commit lease; an abort flips the marker and removes the staged documents.

Staged chunks (:mod:`._staging`) are applied to the target -- ``insert_many`` in insert mode,
by ``_id`` otherwise (``replace_one(upsert=True)``, or an update with ``version_field`` or
``partial``) -- inside MongoDB transactions that also delete them from staging and advance the
marker's ``applied`` counter; the last one flips the marker to ``committed`` and raises the
stored committed positions (``$max``) -- data, marker and positions in one local transaction.
MongoDB transactions have size and time limits, so a large part is applied as many whole
staged chunks per transaction as fit ``commit_chunk_size`` documents and
``commit_chunk_bytes``; a part that fits in one chunk commits in a single transaction. Because
``_id`` s are deterministic, every chunk is atomic and a chunk only ever applies documents it
removes from staging in the same transaction, a commit that crashes between chunks resumes
where it stopped (from any process) and the result is still exactly once. The package docstring tells why the lease exists and how it is taken over.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import bson
import pymongo
from bson.raw_bson import RawBSONDocument
from pymongo import ASCENDING, DeleteOne, ReplaceOne, UpdateOne
from pymongo.client_session import ClientSession
from pymongo.collection import Collection
from pymongo.errors import BulkWriteError, PyMongoError
from pymongo.read_concern import ReadConcern
from pymongo.read_preferences import ReadPreference
from pymongo.write_concern import WriteConcern

from twophase.participants.sdk import (
    BackpressureError,
    FatalSinkError,
    PartId,
    RetriableSinkError,
    UnknownPartError,
)
from twophase.participants.sinks.mongodb._documents import id_key
from twophase.participants.sinks.mongodb._staging import entries_of
from twophase.participants.sinks.mongodb._store import (
    ABORTED,
    COMMITTED,
    DUPLICATE_KEY,
    OPEN,
    PREPARED,
    RAW,
    Doc,
    Store,
)

__all__ = ["NO_LEASE", "Committer"]


class _InTargetAlready(Exception):
    """An insert-mode chunk met one of its documents in the target (not a SinkError: the
    commit step repeats the chunk by ``_id`` at once, in a new transaction)."""


#: A committer that finds another's live lease asks to be retried after this long. The holder
#: usually finishes within seconds, so waiting out the whole lease would waste most of it; one
#: cheap marker read per second per waiter notices the commit (or an expired lease) promptly.
_LEASE_POLL_S = 1.0
#: Staged documents per cursor batch of a commit's read: one chunk document usually fills a
#: transaction, and one more says whether it is the last (each reply is read whole: a larger
#: batch would read chunks the transaction does not apply). Parts staged one document per
#: record, before packing, are read two at a time too: slower, and only while upgrading.
_STAGED_BATCH = 2
#: The ``keyPattern`` of a duplicate key error from the ``_id`` index.
_ID_KEY = {"_id": 1}
#: Releasing leases on close() only spares other processes the wait for expiry; a shutdown never
#: waits longer than this for it.
_LEASE_RELEASE_TIMEOUT_S = 5.0
#: The lease has expired by the server's clock. Compared as epoch milliseconds: SecantusDB 0.7
#: answers false to every comparison of a stored date with ``$$NOW`` (either direction); on
#: MongoDB both forms mean the same. A missing ``lease_until`` converts to null, which sorts low.
_LEASE_EXPIRED: Doc = {"$expr": {"$lt": [{"$toLong": "$lease_until"}, {"$toLong": "$$NOW"}]}}
NO_LEASE: Doc = {"lease_owner": "", "lease_holder": "", "lease_until": "", "lease_lsid": ""}


class Committer:
    """Commits and aborts parts of one sink instance, under commit leases named after it."""

    def __init__(self, store: Store, me: str, participant: str, log: logging.Logger) -> None:
        self.store = store
        #: This instance's name in commit leases: unique per process and instance, readable in logs.
        self._me = me
        self.participant = participant
        self.log = log
        self._lock = threading.Lock()
        #: Marker ``_id`` s whose commit runs on some thread of this instance right now: a second
        #: thread would hold the same lease, so it waits like any other committer.
        self._committing: set[str] = set()
        #: Marker ``_id`` s this instance holds a lease on, released by close().
        self._leases: set[str] = set()
        #: ``mode: insert`` parts that met a document already in the target: applied by
        #: ``_id`` (replace) from then on (a few, for the life of the process).
        self._replacing: set[str] = set()

    def commit(self, part: PartId) -> None:
        """Apply ``part`` chunk by chunk, each chunk one transaction, under the commit lease;
        nothing if it is committed, :class:`UnknownPartError` if it is not prepared."""
        pk = self.store.pk(part)
        self._enter_commit(part, "commit")
        try:
            # Read first: repeated decisions (recovery, sweeps) of a committed part cost one read.
            with self.store.errors("commit", part.token, FatalSinkError):
                marker = self.store.markers.find_one({"_id": pk}, {"state": 1})
            if marker is not None and marker["state"] == COMMITTED:
                self.log.debug("part %s: already committed", part.token)
                return
            self.require_prepared(part, marker)
            steps = 1
            while not self.step(part):
                steps += 1
        finally:
            with self._lock:
                self._committing.discard(pk)
        with self._lock:
            self._leases.discard(pk)  # the last chunk released it (kept on errors, for close())
        self.log.debug("part %s: applied in %d steps", part.token, steps)

    def abort(self, part: PartId) -> int:
        """Mark ``part`` aborted unless a committer holds or has applied it (or it is committed:
        :class:`FatalSinkError`); remove its staged documents, and say how many."""
        pk = self.store.pk(part)
        self._enter_commit(part, "abort")
        try:
            with self.store.errors("abort", part.token, FatalSinkError):
                self._end_dead_holders_transaction(part)
                marker = self.store.markers.find_one_and_update(
                    {
                        "_id": pk,
                        "state": {"$in": [OPEN, PREPARED]},
                        "applied": 0,
                        "$or": self._lease_free(),
                    },
                    {
                        "$set": {"state": ABORTED, "aborted_at": datetime.now(UTC)},
                        "$unset": NO_LEASE,
                    },
                )
                if marker is None:
                    current = self.store.markers.find_one({"_id": pk})
                    state = current["state"] if current else None
                    if state == COMMITTED:
                        raise FatalSinkError(
                            f"abort: part {part.token} is already committed", sink=self.store.sink
                        )
                    if state in (OPEN, PREPARED) and current and current.get("applied", 0) > 0:
                        raise FatalSinkError(
                            f"abort: part {part.token} is being committed ({current['applied']} "
                            "documents applied); only commit can finish it",
                            sink=self.store.sink,
                        )
                    if current and state in (OPEN, PREPARED) and current.get("lease_owner"):
                        # A committer holds it and has applied nothing yet: wait; it either
                        # commits (then this abort is refused) or dies and its lease expires.
                        raise self._busy("abort", part, current)
                    if state in (OPEN, PREPARED):
                        raise RetriableSinkError(
                            f"abort: part {part.token} changed meanwhile", sink=self.store.sink
                        )
                    # None (unknown part) or already aborted: nothing to mark.
                removed = self.store.staging.delete_many({"part": pk}).deleted_count
        finally:
            with self._lock:
                self._committing.discard(pk)
        with self._lock:
            self._leases.discard(pk)
        return removed

    def _enter_commit(self, part: PartId, what: str) -> None:
        """Refuse a second commit/abort of ``part`` on another thread of this instance: both
        would act under the same lease name and collide like two processes without leases."""
        pk = self.store.pk(part)
        with self._lock:
            if pk not in self._committing:
                self._committing.add(pk)
                return
        raise BackpressureError(
            f"{what}: part {part.token} is being committed by another thread of this process; "
            f"retry after {_LEASE_POLL_S:.1f}s",
            retry_after_s=_LEASE_POLL_S,
            sink=self.store.sink,
        )

    def require_prepared(self, part: PartId, marker: Doc | None) -> Doc:
        """``marker`` when the part is prepared; else :class:`UnknownPartError`."""
        if marker is None:
            raise UnknownPartError(
                f"commit: part {part.token} is not in this store", sink=self.store.sink
            )
        if marker["state"] != PREPARED:
            raise UnknownPartError(
                f"commit: part {part.token} is {marker['state']}, not prepared",
                sink=self.store.sink,
            )
        return marker

    def _busy(self, what: str, part: PartId, marker: Doc) -> BackpressureError:
        wait = min(_LEASE_POLL_S, self.store.cfg.commit_lease_s)
        until = marker.get("lease_until")
        return BackpressureError(
            f"{what}: part {part.token} is being committed by {marker.get('lease_owner')} "
            f"(lease until {until.isoformat(timespec='seconds') if until else '?'} server time, "
            f"{marker.get('applied', 0)} of {marker.get('records', '?')} applied); "
            f"retry after {wait:.1f}s",
            retry_after_s=wait,
            sink=self.store.sink,
        )

    def _lease_free(self) -> list[Doc]:
        """A marker whose commit lease this instance may take: its own, none, expired, or held
        by another incarnation of this participant. Participant ids are unique among live
        processes, so that holder is dead (or, cut off, about to find its lease gone: every
        chunk transaction re-checks ``lease_owner``, so a takeover never applies twice)."""
        return [
            {"lease_owner": self._me},
            {"lease_until": None},
            _LEASE_EXPIRED,
            {"lease_holder": self.participant},
        ]

    def _end_dead_holders_transaction(self, part: PartId) -> None:
        """When this instance is about to take ``part``'s lease from another holder (an earlier
        incarnation of this participant, or a lease expired), end that holder's session first.

        A committer killed inside a chunk transaction leaves it open on the server, holding the
        marker and the chunk's documents, and the server ends it only after its lifetime (60 s
        by default): every write to the marker -- this takeover's first -- waits until then. The
        holder's session id is in the marker (``lease_lsid``, set by each claim), so
        ``killSessions`` aborts its transaction now. A holder that is alive after all (cut off,
        its lease expired) only loses its open chunk transaction: its next one finds the lease
        gone (:meth:`_commit_chunk`), as it would have anyway. A plain read: it never waits."""
        pk = self.store.pk(part)
        holder = self.store.markers.find_one(
            {
                "_id": pk,
                "state": {"$in": [OPEN, PREPARED]},
                "lease_owner": {"$nin": [None, "", self._me]},
                "lease_lsid": {"$type": "object"},
                "$or": self._lease_free(),
            },
            projection={"lease_owner": 1, "lease_lsid": 1},
        )
        if holder is None:
            return
        try:
            self.store.client.admin.command("killSessions", [holder["lease_lsid"]])
        except PyMongoError as exc:  # not allowed, or not known: the server's lifetime ends it
            self.log.info(
                "part %s: could not end the session of %s: %s",
                part.token,
                holder["lease_owner"],
                exc,
            )
            return
        self.log.info(
            "part %s: ended the session of %s, whose lease this instance takes over",
            part.token,
            holder["lease_owner"],
        )

    def claim(self, part: PartId, lsid: Mapping[str, Any] | None = None) -> bool:
        """Take or renew ``part``'s commit lease, outside any transaction.

        True when this instance holds it now; False when the part is committed already. Raises
        :class:`BackpressureError` while another committer's lease is live.
        """
        pk = self.store.pk(part)
        lease_ms = int(self.store.cfg.commit_lease_s * 1000)
        self._end_dead_holders_transaction(part)
        before = self.store.markers.find_one_and_update(
            {
                "_id": pk,
                "state": PREPARED,
                "$or": self._lease_free(),
            },
            # Server time: the clocks of the processes that share a part never matter.
            [
                {
                    "$set": {
                        "lease_owner": self._me,
                        "lease_holder": self.participant,
                        "lease_until": {"$add": ["$$NOW", lease_ms]},
                        "lease_lsid": {"$literal": lsid},
                    }
                }
            ],
            projection={"lease_owner": 1, "lease_holder": 1, "applied": 1},
        )
        if before is not None:
            with self._lock:
                self._leases.add(pk)
            previous = before.get("lease_owner")
            if previous not in (None, "", self._me):
                self.log.warning(
                    "part %s: taking over the commit from %s, %s, at %s applied",
                    part.token,
                    previous,
                    "an earlier incarnation of this participant"
                    if before.get("lease_holder") == self.participant
                    else "whose lease expired",
                    before.get("applied"),
                )
            return True
        current = self.store.markers.find_one({"_id": pk})
        if current is not None and current["state"] == COMMITTED:
            return False
        raise self._busy("commit", part, self.require_prepared(part, current))

    def step(self, part: PartId) -> bool:
        """Renew the lease, apply one chunk of ``part`` in one transaction; True once committed."""
        with (
            self.store.errors("commit", part.token, FatalSinkError),
            self.store.client.start_session() as session,
        ):
            # The claim names the session the chunk transaction runs in: a successor ends it
            # should this process die inside it (_end_dead_holders_transaction).
            if not self.claim(part, session.session_id):
                return True
            return self._step(part, session)

    def _step(self, part: PartId, session: ClientSession) -> bool:
        cfg = self.store.cfg
        while True:
            try:
                with (
                    self.store.errors("commit", part.token, FatalSinkError),
                    session.start_transaction(
                        # Snapshot reads + majority commit: a chunk sees and removes exactly
                        # what it applies.
                        read_concern=ReadConcern("snapshot"),
                        write_concern=WriteConcern(
                            w="majority", wtimeout=int(cfg.write_concern_timeout_s * 1000)
                        ),
                        read_preference=ReadPreference.PRIMARY,
                        max_commit_time_ms=int(cfg.max_commit_time_s * 1000),
                    ),
                ):
                    return self._commit_chunk(part, session)
            except _InTargetAlready as exc:
                # The transaction is gone (aborted by the write error); the chunk again, by _id.
                self.log.info("part %s: %s; applying it by _id from now on", part.token, exc)

    def _commit_chunk(self, part: PartId, session: ClientSession) -> bool:
        pk = self.store.pk(part)
        cfg = self.store.cfg
        staging_raw = self.store.staging.with_options(codec_options=RAW)
        marker = self.store.markers.find_one({"_id": pk}, session=session)
        if marker is not None and marker["state"] == COMMITTED:
            return True
        marker = self.require_prepared(part, marker)
        if marker.get("lease_owner") != self._me:
            raise self._busy("commit", part, marker)  # taken over since our claim: let it finish
        applied = int(marker.get("applied", 0))
        # Whole staged documents (chunks of entries, _staging.py) up to the chunk limits; one
        # more read tells whether this is the last transaction of the part.
        stored: list[RawBSONDocument] = []
        chunk: list[RawBSONDocument] = []
        size = 0
        final = True
        cursor = staging_raw.find({"part": pk}, session=session).sort("seq", ASCENDING)
        with cursor.batch_size(_STAGED_BATCH):
            for staged in cursor:
                entries = entries_of(staged)
                if stored and (
                    len(chunk) + len(entries) > cfg.commit_chunk_size
                    or size + len(staged.raw) > cfg.commit_chunk_bytes
                ):
                    final = False
                    break
                stored.append(staged)
                chunk += entries
                size += len(staged.raw)
        if final and applied + len(chunk) != int(marker.get("records", 0)):
            raise FatalSinkError(
                f"commit: part {part.token} was prepared with {marker.get('records')} documents "
                f"but {applied + len(chunk)} were staged; staging was changed behind this sink's "
                "back",
                sink=self.store.sink,
            )
        # The marker first, guarded by what this transaction read: a takeover or an abort since
        # its snapshot is a write to this document, so this write conflicts before any document
        # is touched, instead of after a whole chunk's work.
        update: Doc
        if final:
            update = {
                "$set": {
                    "state": COMMITTED,
                    "applied": applied + len(chunk),
                    "committed_at": datetime.now(UTC),
                },
                "$unset": NO_LEASE,
            }
        else:
            update = {
                "$inc": {"applied": len(chunk)},
                "$set": {"applied_through": stored[-1]["seq"]},
            }
        guard = {"_id": pk, "state": PREPARED, "lease_owner": self._me, "applied": applied}
        if self.store.markers.update_one(guard, update, session=session).matched_count != 1:
            raise RetriableSinkError(
                f"commit: part {part.token}: marker changed meanwhile", sink=self.store.sink
            )
        writes = self._apply(part, chunk, session) if chunk else 0
        if stored:
            # The chunk is this part's lowest seqs and seqs are unique per staged document, so a
            # range removes exactly the chunk (and uses the part_seq index; a long $in does not
            # on every server).
            removed = staging_raw.delete_many(
                {"part": pk, "seq": {"$lte": stored[-1]["seq"]}}, session=session
            ).deleted_count
            if removed != len(stored):
                raise FatalSinkError(
                    f"commit: part {part.token}: removed {removed} staged documents for a chunk "
                    f"of {len(stored)}; staging was changed behind this sink's back",
                    sink=self.store.sink,
                )
        if not final:
            self.log.debug(
                "part %s: applying, chunk of %d staged (%d writes)", part.token, len(chunk), writes
            )
            return False
        moves = [
            UpdateOne(
                {"_id": f"{self.store.sink}:{part.pipeline}:{p['topic']}:{p['partition']}"},
                {
                    "$max": {"offset": int(p["offset"])},
                    "$setOnInsert": {
                        "kind": "positions",
                        "pipeline": part.pipeline,
                        "sink": self.store.sink,
                        "topic": p["topic"],
                        "partition": int(p["partition"]),
                    },
                },
                upsert=True,
            )
            for p in marker.get("positions", [])
        ]
        if moves:
            self.store.markers.bulk_write(moves, ordered=True, session=session)
        return True

    def _apply(self, part: PartId, chunk: list[RawBSONDocument], session: ClientSession) -> int:
        """Apply the chunk's changes to their targets (the configured collection, or each
        document's own with a ``collection`` template), the last change per ``_id`` winning."""
        by_coll: dict[str | None, list[RawBSONDocument]] = {}
        for staged in chunk:
            by_coll.setdefault(staged.get("coll"), []).append(staged)
        return sum(self._apply_to(part, coll, some, session) for coll, some in by_coll.items())

    def _apply_to(
        self,
        part: PartId,
        coll: str | None,
        chunk: list[RawBSONDocument],
        session: ClientSession,
    ) -> int:
        """Apply the chunk's changes to one target collection, the last change per ``_id``
        winning: a document replaces (or, ``partial``, sets its fields on) its key's, a delete
        removes it; a write after a delete in the chunk starts a new document (the delete is
        applied first)."""
        cfg = self.store.cfg
        keyed = cfg.mode != "insert"
        latest: dict[bytes, RawBSONDocument] = {}
        deleted: dict[bytes, Any] = {}
        merged: dict[bytes, Doc] = {}  # partial: the fields the key's writes set, merged
        for staged in chunk:
            doc = staged["doc"]
            key = id_key(doc["_id"])
            if staged.get("delete"):
                latest.pop(key, None)
                merged.pop(key, None)
                deleted[key] = doc["_id"]
                continue
            # A delete before this write stays: applied first, it makes the write a new document.
            latest.pop(key, None)  # keep the order of the last occurrence
            latest[key] = doc
            if cfg.partial and keyed:
                merged.setdefault(key, {}).update(bson.decode(doc.raw))
        vf = cfg.version_field if keyed else None
        ops: list[ReplaceOne[RawBSONDocument] | UpdateOne | DeleteOne] = []
        if vf and latest:
            # A newer part may have deleted a key already (a commit applied out of order): its
            # tombstone keeps this older write from bringing the document back.
            gone = {
                id_key(t["_id"]["tombstone"])
                for t in self.store.markers.find(
                    {
                        "_id": {
                            "$in": [self._tombstone(part, d["_id"], coll) for d in latest.values()]
                        },
                        "txn": {"$gt": part.txn},
                    },
                    {"_id": 1},
                    session=session,
                )
            }
            latest = {k: d for k, d in latest.items() if k not in gone}
        target = self.store.target if coll is None else self.store.coll(coll)
        if cfg.mode == "insert" and self.store.pk(part) not in self._replacing:
            return self._insert(part, target, list(latest.values()), session)
        if deleted:
            ops += self._deletes(part, list(deleted.values()), vf, session, coll)
        insert = cfg.mode != "update"
        for key, doc in latest.items():
            if cfg.partial and keyed:
                ops.append(self._set(part, merged[key], vf, insert))
            else:
                ops.append(self._replace(part, doc, vf, insert))
        if ops:
            target.with_options(codec_options=RAW).bulk_write(ops, ordered=True, session=session)
        return len(ops)

    def _insert(
        self,
        part: PartId,
        target: Collection[Doc],
        docs: list[RawBSONDocument],
        session: ClientSession,
    ) -> int:
        """``mode: insert``: the chunk's documents inserted, the cheapest write there is. An
        ``_id`` already in the target (only a part applied again after its positions were
        reset) ends the transaction: the part's remaining chunks are then applied by ``_id``
        (replace), which makes the same document again."""
        if not docs:
            return 0
        try:
            target.with_options(codec_options=RAW).insert_many(docs, ordered=True, session=session)
        except BulkWriteError as exc:
            errors = exc.details.get("writeErrors", [])
            # Only the _id index says the document is there already; another unique index's
            # refusal is the target refusing the document, as before (keyPattern: MongoDB 4.4+).
            if not errors or any(
                e.get("code") != DUPLICATE_KEY or e.get("keyPattern", _ID_KEY) != _ID_KEY
                for e in errors
            ):
                raise
            self._replacing.add(self.store.pk(part))
            raise _InTargetAlready(
                f"document {errors[0].get('keyValue')} is in {target.name} already"
            ) from exc
        return len(docs)

    @staticmethod
    def _newer(part: PartId, vf: str) -> Doc:
        """True of a stored document this pipeline wrote from a later transaction."""
        return {
            "$and": [
                {"$eq": [f"${vf}.pipeline", part.pipeline]},
                {"$in": [{"$type": f"${vf}.txn"}, ["int", "long"]]},
                {"$gt": [f"${vf}.txn", part.txn]},
            ]
        }

    def _replace(
        self, part: PartId, doc: RawBSONDocument, vf: str | None, upsert: bool
    ) -> ReplaceOne[RawBSONDocument] | UpdateOne:
        """``doc`` replaces its key's document (inserted when absent and ``upsert``); with
        ``version_field``, one server-side step and no read: a document this pipeline wrote from
        a later transaction stays."""
        if not vf:
            return ReplaceOne({"_id": doc["_id"]}, doc, upsert=upsert)
        return UpdateOne(
            {"_id": doc["_id"]},
            [{"$replaceWith": {"$cond": [self._newer(part, vf), "$$ROOT", {"$literal": doc}]}}],
            upsert=upsert,
        )

    def _set(self, part: PartId, fields: Doc, vf: str | None, upsert: bool) -> UpdateOne:
        """``partial``: set ``fields`` on their key's document, leaving its other fields."""
        doc_id = fields["_id"]
        if not vf:
            return UpdateOne({"_id": doc_id}, {"$set": fields}, upsert=upsert)
        merged = {"$mergeObjects": ["$$ROOT", {"$literal": fields}]}
        return UpdateOne(
            {"_id": doc_id},
            [{"$replaceWith": {"$cond": [self._newer(part, vf), "$$ROOT", merged]}}],
            upsert=upsert,
        )

    def _deletes(
        self,
        part: PartId,
        ids: list[Any],
        vf: str | None,
        session: ClientSession,
        coll: str | None = None,
    ) -> list[DeleteOne]:
        """Deletes of the documents ``ids``; with ``version_field``, not of one a newer part
        wrote, and each leaves a tombstone (in the marker collection, ``kind: tombstone``, the
        part's txn) that an older part's late commit consults, until retention forgets it."""
        if not vf:
            return [DeleteOne({"_id": i}) for i in ids]
        self.store.markers.bulk_write(
            [
                UpdateOne(
                    {"_id": self._tombstone(part, i, coll)},
                    {
                        "$max": {"txn": part.txn},
                        "$setOnInsert": {
                            "kind": "tombstone",
                            "pipeline": part.pipeline,
                            "sink": self.store.sink,
                        },
                    },
                    upsert=True,
                )
                for i in ids
            ],
            ordered=True,
            session=session,
        )
        newer = {f"{vf}.pipeline": part.pipeline, f"{vf}.txn": {"$gt": part.txn}}
        return [DeleteOne({"_id": i, "$nor": [newer]}) for i in ids]

    def _tombstone(self, part: PartId, doc_id: Any, coll: str | None = None) -> Doc:
        """The marker-collection ``_id`` of the tombstone of ``doc_id`` (in ``coll``, with a
        ``collection`` template)."""
        tomb = {"tombstone": doc_id, "sink": self.store.sink, "pipeline": part.pipeline}
        return tomb if coll is None else {**tomb, "coll": coll}

    def release_leases(self) -> None:
        """Hand back the leases this instance holds (a clean shutdown)."""
        with self._lock:
            held = sorted(self._leases)
            self._leases.clear()
        if held:
            # A restarted process has a new lease name: without this it would wait out its own
            # predecessor's lease.
            try:
                with pymongo.timeout(_LEASE_RELEASE_TIMEOUT_S):
                    self.store.markers.update_many(
                        {"_id": {"$in": held}, "state": PREPARED, "lease_owner": self._me},
                        {"$unset": NO_LEASE},
                    )
            except PyMongoError as exc:
                self.log.warning(
                    "could not release the commit lease of %d parts (they expire within %.0fs): %s",
                    len(held),
                    self.store.cfg.commit_lease_s,
                    exc,
                )
