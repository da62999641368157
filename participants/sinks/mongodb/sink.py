"""MongoDB sink: exactly-once, all-or-nothing parts on any MongoDB replica set or sharded cluster.

MongoDB clients have no two-phase commit, so a part goes through three durable stages:

1. **begin / write -- staging.** ``begin`` writes an ``open`` marker. Every record becomes one
   staged document in ``staging_collection``::

       {_id: "<pk>|<topic:partition:offset>", part: "<pk>", seq: n, doc: <the target document>}

   where ``pk = "<sink name>:<part token>"``. ``doc`` already carries its final, deterministic
   ``_id`` (see below), so staging is a plain ``insert_many(ordered=False)`` with write concern
   majority; a retried write re-inserts the same ``_id`` s and the duplicates are ignored. Nothing
   of the part is in the target collection yet.

2. **prepare -- marker.** Once every staged write is acknowledged, the part's marker in
   ``marker_collection`` becomes ``prepared`` (write concern majority, journaled) and records the
   part's positions and document count. From then on any process, on new connections, can commit
   or abort the part: :meth:`MongoSink.in_doubt` lists it.

3. **commit -- move.** Staged documents are applied to the target with ``replace_one(upsert=True)``
   by ``_id`` inside MongoDB transactions that also delete them from staging and advance the
   marker's ``applied`` counter; the last one flips the marker to ``committed`` and raises the
   stored committed positions (``$max``) -- data, marker and positions in one local transaction.
   MongoDB transactions have size and time limits, so a large part is applied in chunks of
   ``commit_chunk_size`` documents (and at most ``commit_chunk_bytes``); a part that fits in one
   chunk commits in a single transaction. Because ``_id`` s are deterministic, every chunk is atomic
   and a chunk only ever applies documents it removes from staging in the same transaction, a
   commit that crashes between chunks resumes where it stopped (from any process) and the result
   is still exactly once.

   **Commit lease.** Any process may commit a prepared part (a restarted owner recovering it, another
   participant's sweep), and two of them may try at once. Two committers whose chunk transactions
   both write the marker conflict on every chunk (``WriteConflict``); with the runtime retrying both
   they can livelock. So before each chunk a committer claims the part's lease on its marker,
   outside any transaction, with one atomic ``findAndModify``: it matches only a ``prepared`` marker
   whose lease is free, expired or already its own, and sets ``lease_owner`` and ``lease_until`` =
   server time (``$$NOW``) + ``commit_lease_s`` -- renewing it once per chunk. A committer that finds
   a live lease of another raises :class:`BackpressureError` without opening a transaction and
   polls until the part is committed or the lease expires (its holder died); then it takes over
   and resumes from the marker's ``applied`` count. The lease also names the participant
   (``lease_holder``): a new incarnation of the same participant -- the restarted owner, whose
   predecessor is dead or about to find its lease gone -- takes it over at once instead of
   waiting out ``commit_lease_s``. The lease is for liveness only: exactly-once
   rests on each chunk transaction re-reading the marker, requiring ``lease_owner`` to be this
   committer and ``applied`` to be what it read, and writing the marker before anything else -- a
   takeover in between is a write to the same document, so one of the two fails. ``abort`` respects
   a live lease the same way.

   **Visibility during commit:** while a part larger than one chunk is being applied, a reader of
   the target may see some of its documents and not yet the rest. This is the "briefly ahead while
   the decision is being applied" of the design's atomicity guarantee: once the decision is
   COMMIT the part is completed by whoever applies it, so the difference is never permanent. Once a
   chunk has been applied the part can no longer be aborted (:meth:`MongoSink.abort` refuses).

Deterministic ``_id`` s:

* ``mode: insert`` -- ``_id`` is the record id ``"topic:partition:offset"``. A value that has its
  own ``_id`` is rejected (it would be silently overwritten); use ``mode: upsert, key: [_id]``.
* ``mode: upsert`` -- ``_id`` is the key: the value of the single key field itself, or for a
  composite key a sub-document ``{k1: v1, k2: v2}`` in the configured key order (type-preserving
  and queryable, unlike a joined string). Within one part the last record per key wins -- the one
  written last, which for one source partition is the highest offset. Across parts the later
  transaction wins even when decisions are applied out of order (a recovered part of an earlier
  transaction applied after a later one): each document carries ``version_field`` =
  ``{pipeline, txn}`` and the commit skips a key whose stored version is newer for the same
  pipeline. Set ``version_field: null`` to drop the field; then the last *applied* part wins.

Markers (``marker_collection``, one per part and sink; ``_id = pk``)::

    {_id, kind: "part", pipeline, sink, txn, participant, state, records, applied, positions,
     lease_owner, lease_holder, lease_until}

``state`` goes ``open -> prepared -> committed`` or ``-> aborted``. An aborted part may be opened
again (a rewind re-reads the same transaction under the same id); a part aborted by another
process while this one still writes it can no longer be prepared. ``lease_owner``/``lease_holder``/
``lease_until`` exist only while a ``prepared`` part is being committed. Committed positions per source
partition live in the same collection (``kind: "positions"``) and are readable with
:meth:`MongoSink.committed_positions`. The last chunk's transaction also stamps the marker's
``committed_at`` (the committer's clock), which :meth:`MongoSink.last_committed` reports for the
committed marker with the highest txn -- a marker :meth:`MongoSink.forget` always keeps.

Stale parts: a process that dies while writing leaves staged documents behind an ``open``
marker. They never show in :meth:`MongoSink.in_doubt` (not prepared). The runtime finds them with
:meth:`MongoSink.stale_parts` -- only parts older than a transaction number it knows to be past
(so another live participant's open part is never touched) -- and removes them with ``abort``.

Sharded clusters: shard the target collection on ``_id`` (hashed is fine) -- the deterministic
``_id`` is the only field every write filters on -- and the staging collection on ``part``.
Per-document refusals are found at write time, so they are rejected (dead-lettered), never met
by a commit: a document over the BSON limit, field names MongoDB cannot store, and -- when the
target can refuse a document by itself, i.e. it has a validator or a unique index besides
``_id`` -- whatever the target refuses when the part's documents are tried on it in a MongoDB
transaction that is then aborted (a duplicate key of a unique index, a validation failure,
an index key too long). Checked against what is committed when the part writes: two parts in
flight at once that both bring the same unique value can still meet at commit, which then fails
naming the document.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import threading
from collections.abc import Collection as Some
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import bson
import pymongo
from bson.codec_options import CodecOptions
from bson.raw_bson import RawBSONDocument
from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pymongo import ASCENDING, MongoClient, ReplaceOne, UpdateOne
from pymongo.client_session import ClientSession
from pymongo.collection import Collection
from pymongo.errors import (
    BulkWriteError,
    CollectionInvalid,
    ConfigurationError,
    ConnectionFailure,
    DuplicateKeyError,
    ExecutionTimeout,
    OperationFailure,
    PyMongoError,
    WriteConcernError,
)
from pymongo.read_concern import ReadConcern
from pymongo.read_preferences import ReadPreference
from pymongo.write_concern import WriteConcern

from twophase.participants.sdk import (
    AbortTransactionError,
    BackpressureError,
    BatchingSink,
    CommittedInfo,
    FatalSinkError,
    PartId,
    PartMarker,
    PartState,
    Record,
    Rejected,
    RetriableSinkError,
    SinkConfig,
    SinkContext,
    SinkError,
    UnknownPartError,
    positions_from_json,
    positions_to_json,
)

__all__ = ["MongoSink", "MongoSinkConfig"]

Doc = dict[str, Any]
#: Orders markers without a ``committed_at`` before any that has one.
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

# Marker states.
OPEN = "open"
PREPARED = "prepared"
COMMITTED = "committed"
ABORTED = "aborted"

#: MongoDB refuses documents nested deeper than 100 levels; a staged document adds one level.
_MAX_DEPTH = 99
#: Server error codes that are transient even when the server does not label them so
#: (stepdowns, shutdowns, network trouble between mongos and shards, lock/time limits).
_RETRIABLE_CODES = frozenset(
    {6, 7, 50, 89, 91, 112, 189, 244, 251, 262, 9001, 10107, 11600, 11602, 13435, 13436}
)
#: Unauthorized, AuthenticationFailed: retrying with the same credentials cannot help.
_AUTH_CODES = frozenset({13, 18})
_INTERNAL_ERROR = 1
_DUPLICATE_KEY = 11000
#: Staged documents are read and replayed as raw BSON: user documents are never decoded.
_RAW: CodecOptions[RawBSONDocument] = CodecOptions(document_class=RawBSONDocument)
_DB_NAME_FORBIDDEN = re.compile(r'[/\\. "$\x00]')
#: A committer that finds another's live lease asks to be retried after this long. The holder
#: usually finishes within seconds, so waiting out the whole lease would waste most of it; one
#: cheap marker read per second per waiter notices the commit (or an expired lease) promptly.
_LEASE_POLL_S = 1.0
#: Releasing leases on close() only spares other processes the wait for expiry; a shutdown never
#: waits longer than this for it.
_LEASE_RELEASE_TIMEOUT_S = 5.0
#: The lease has expired by the server's clock. Compared as epoch milliseconds: SecantusDB 0.7
#: answers false to every comparison of a stored date with ``$$NOW`` (either direction); on
#: MongoDB both forms mean the same. A missing ``lease_until`` converts to null, which sorts low.
_LEASE_EXPIRED: Doc = {"$expr": {"$lt": [{"$toLong": "$lease_until"}, {"$toLong": "$$NOW"}]}}
_NO_LEASE: Doc = {"lease_owner": "", "lease_holder": "", "lease_until": ""}


class MongoSinkConfig(SinkConfig):
    """``sinks[]`` entry with ``type: mongodb``."""

    type: Literal["mongodb"]
    #: ``mongodb://`` or ``mongodb+srv://`` URI of a replica set or mongos. It may hold a password,
    #: so it is a secret: never logged, never shown in a config dump.
    uri: SecretStr
    #: Database of the target collection (1-63 bytes, no ``/\. "$``).
    database: str
    #: The target collection.
    collection: str
    #: ``insert``: one document per record, ``_id`` = record id. ``upsert``: one document per key.
    mode: Literal["insert", "upsert"] = "insert"
    #: Top-level value fields that form the document key (``mode: upsert`` only).
    key: list[str] = Field(default_factory=list, validate_default=True)
    #: Where parts wait for their decision; default ``<collection>__twophase_staging``.
    staging_collection: str | None = None
    #: Per-part markers and committed positions; may be shared by many sinks and pipelines.
    marker_collection: str = "twophase_parts"
    #: Upsert mode: field holding ``{pipeline, txn}`` so an older part never overwrites a newer
    #: one, whatever order decisions are applied in. ``null`` disables the guard and the field.
    version_field: str | None = "_twophase"
    #: Documents per commit transaction. MongoDB aborts transactions that run longer than
    #: ``transactionLifetimeLimitSeconds`` (60 s by default); 1000 replaces finish well inside
    #: that even on slow servers, and bigger chunks gain little once per-transaction overhead
    #: is amortized.
    commit_chunk_size: int = Field(1000, ge=1, le=100_000)
    #: Bytes of staged documents per commit transaction: keeps one transaction's oplog entries
    #: and cache pressure modest (MongoDB's per-transaction limits are in this range).
    commit_chunk_bytes: int = Field(8 * 1024 * 1024, ge=1)
    #: TCP connect; a reachable server answers in milliseconds, so 10 s only covers slow networks.
    connect_timeout_s: float = Field(10.0, gt=0)
    #: How long to wait for a writable primary -- longer than a typical election (~10 s).
    server_selection_timeout_s: float = Field(15.0, gt=0)
    #: One round trip; must exceed the slowest single operation (a chunk's bulk replace).
    socket_timeout_s: float = Field(120.0, gt=0)
    #: Waiting for majority acknowledgement; after it the write is retried, not lost.
    write_concern_timeout_s: float = Field(60.0, gt=0)
    #: ``maxCommitTimeMS`` of each commit transaction.
    max_commit_time_s: float = Field(60.0, gt=0)
    #: How long a committer's claim on a part lasts; it renews the claim before every chunk. As
    #: long as MongoDB's default ``transactionLifetimeLimitSeconds`` (60 s): any chunk that can
    #: still succeed finishes inside it, so a live committer is never overtaken, while a crashed one
    #: delays the rest of its part by at most this long (a dead client's open transaction blocks
    #: the marker for that long on the server anyway). Safety never depends on it.
    commit_lease_s: float = Field(60.0, gt=0)
    #: The client's ``appName``, as the server's logs and ``currentOp`` show it.
    app_name: str = "twophase"

    @field_validator("database")
    @classmethod
    def _check_database(cls, value: str) -> str:
        if not value or len(value.encode()) > 63 or _DB_NAME_FORBIDDEN.search(value):
            raise ValueError('use 1-63 bytes without / \\ . space " $')
        return value

    @field_validator("collection", "staging_collection", "marker_collection")
    @classmethod
    def _check_collection(cls, value: str | None) -> str | None:
        if value is not None and (
            not value or "$" in value or "\x00" in value or value.startswith("system.")
        ):
            raise ValueError(
                "a collection name is non-empty, has no $ and does not start with system."
            )
        return value

    @field_validator("version_field")
    @classmethod
    def _check_version_field(cls, value: str | None) -> str | None:
        if value is not None and (
            not value or value.startswith("$") or "." in value or value == "_id"
        ):
            raise ValueError("a top-level field name without $ or '.', not _id")
        return value

    @field_validator("key")
    @classmethod
    def _check_key(cls, value: list[str], info: ValidationInfo) -> list[str]:
        mode = info.data.get("mode", "insert")
        if mode == "upsert" and not value:
            raise ValueError("required when mode is 'upsert': the fields that identify a document")
        if mode == "insert" and value:
            raise ValueError("only used when mode is 'upsert' (insert mode keys by record id)")
        for name in value:
            if not name or name.startswith("$") or "." in name or "\x00" in name:
                raise ValueError(f"{name!r}: key fields are top-level field names without $ or '.'")
        if len(set(value)) != len(value):
            raise ValueError("key fields must be distinct")
        return value

    @property
    def staging(self) -> str:
        return self.staging_collection or f"{self.collection}__twophase_staging"


class _Reject(Exception):
    """Internal: one record cannot become a document."""


@dataclass(slots=True)
class _OpenStaging:
    """What the open part keeps in memory: the next staging seq, how many documents are staged,
    and how to repeat a write that failed (the part's life cycle itself is BatchingSink's)."""

    part: PartId
    pk: str
    next_seq: int = 0
    staged: int = 0
    #: ``_id`` s of a write() that failed; a retry finding them already staged counts them.
    uncertain: set[str] = field(default_factory=set)
    #: Record ids and first seq of the last write() that failed with a retriable error.
    failed: tuple[tuple[str, ...], int] | None = None
    #: The target can refuse a document by itself (validator, unique index): write() tries
    #: each batch on it first.
    strict: bool = False


class MongoSink(BatchingSink):
    """Stages parts in MongoDB, commits them with chunked MongoDB transactions. See module doc."""

    config_model = MongoSinkConfig

    def __init__(self, config: SinkConfig, context: SinkContext) -> None:
        if not isinstance(config, MongoSinkConfig):
            raise FatalSinkError("config is not a MongoSinkConfig", sink=context.sink_name)
        super().__init__(config, context)
        self.cfg = config
        self._client: MongoClient[Doc] | None = None
        self._max_bson = 16 * 1024 * 1024
        self._lock = threading.Lock()
        #: The open part in memory: set by its open marker, taken by its prepare or discard.
        self._open_staging: _OpenStaging | None = None
        #: This instance's name in commit leases: unique per process and instance, readable in logs.
        self._me = (
            f"{context.participant}@{socket.gethostname()}:{os.getpid()}/{secrets.token_hex(4)}"
        )
        #: Marker ``_id`` s whose commit runs on some thread of this instance right now: a second
        #: thread would hold the same lease, so it waits like any other committer.
        self._committing: set[str] = set()
        #: Marker ``_id`` s this instance holds a lease on, released by close().
        self._leases: set[str] = set()
        # Majority + journal: once acknowledged, a staged doc or marker survives any failover.
        self._wc = WriteConcern(
            w="majority", j=True, wtimeout=int(config.write_concern_timeout_s * 1000)
        )

    # -- collections -----------------------------------------------------------------------

    @property
    def client(self) -> MongoClient[Doc]:
        if self._client is None:
            raise FatalSinkError("setup() has not been called", sink=self.name)
        return self._client

    def _coll(self, name: str) -> Collection[Doc]:
        return self.client[self.cfg.database].get_collection(
            name, write_concern=self._wc, read_concern=ReadConcern("majority")
        )

    @property
    def _target(self) -> Collection[Doc]:
        return self._coll(self.cfg.collection)

    @property
    def _staging(self) -> Collection[Doc]:
        return self._coll(self.cfg.staging)

    @property
    def _markers(self) -> Collection[Doc]:
        return self._coll(self.cfg.marker_collection)

    def _pk(self, part: PartId) -> str:
        return f"{self.name}:{part.token}"

    def _pk_prefix(self) -> str:
        return f"^{re.escape(self.name)}:{re.escape(self.context.pipeline)}~"

    # -- life cycle ------------------------------------------------------------------------

    def setup(self) -> None:
        cfg = self.cfg
        if self._client is not None:
            return
        try:
            self._client = MongoClient(
                cfg.uri.get_secret_value(),
                appname=cfg.app_name,
                connectTimeoutMS=int(cfg.connect_timeout_s * 1000),
                serverSelectionTimeoutMS=int(cfg.server_selection_timeout_s * 1000),
                socketTimeoutMS=int(cfg.socket_timeout_s * 1000),
                retryWrites=True,
                tz_aware=True,
            )
        except ConfigurationError as exc:
            raise FatalSinkError(
                f"config field 'uri': {_scrub(str(exc), cfg.uri.get_secret_value())}",
                sink=self.name,
            ) from None  # the chained exception could carry the URI into a traceback
        with self._errors("setup", "-", FatalSinkError):
            hello = self.client.admin.command("hello")
            if not hello.get("setName") and hello.get("msg") != "isdbgrid":
                raise FatalSinkError(
                    "MongoDB is a standalone server; commits need multi-document transactions, "
                    "which only a replica set (a single-node one is fine) or a sharded cluster has",
                    sink=self.name,
                )
            if int(hello.get("maxWireVersion", 0)) < 8:
                raise FatalSinkError(
                    "MongoDB 4.2 or newer is required (transactions)", sink=self.name
                )
            self._max_bson = int(hello.get("maxBsonObjectSize", self._max_bson))
            db = self.client[cfg.database]
            existing = set(db.list_collection_names())
            # Collections cannot be created inside a transaction before MongoDB 4.4: create them now.
            for name in (cfg.collection, cfg.staging, cfg.marker_collection):
                if name not in existing:
                    try:
                        db.create_collection(name, write_concern=self._wc)
                    except CollectionInvalid:
                        pass  # another participant created it first
                    except OperationFailure as exc:
                        if exc.code != 48:  # NamespaceExists: same race, older servers
                            raise
            self._staging.create_index([("part", ASCENDING), ("seq", ASCENDING)], name="part_seq")
            self._markers.create_index(
                [
                    ("pipeline", ASCENDING),
                    ("sink", ASCENDING),
                    ("state", ASCENDING),
                    ("txn", ASCENDING),
                ],
                name="pipeline_sink_state_txn",
            )
        self.log.info(
            "mongodb sink %s ready: %s.%s mode=%s staging=%s markers=%s",
            self.name,
            cfg.database,
            cfg.collection,
            cfg.mode,
            cfg.staging,
            cfg.marker_collection,
        )

    def close(self) -> None:
        if self._client is None:
            return
        with self._lock:
            held = sorted(self._leases)
            self._leases.clear()
        if held:
            # A restarted process has a new lease name: without this it would wait out its own
            # predecessor's lease.
            try:
                with pymongo.timeout(_LEASE_RELEASE_TIMEOUT_S):
                    self._markers.update_many(
                        {"_id": {"$in": held}, "state": PREPARED, "lease_owner": self._me},
                        {"$unset": _NO_LEASE},
                    )
            except PyMongoError as exc:
                self.log.warning(
                    "could not release the commit lease of %d parts (they expire within %.0fs): %s",
                    len(held),
                    self.cfg.commit_lease_s,
                    exc,
                )
        self._client.close()
        self._client = None

    # -- markers --------------------------------------------------------------------------------

    def load_marker(self, part: PartId) -> PartMarker | None:
        with self._errors("marker", part.token, RetriableSinkError):
            marker = self._markers.find_one(
                {"_id": self._pk(part)}, {"state": 1, "positions": 1, "records": 1}
            )
        if marker is None:
            return None
        try:
            positions = positions_from_json(marker.get("positions", []))
        except (ValueError, KeyError, TypeError) as exc:
            raise FatalSinkError(
                f"part {part.token}: its marker's positions are unreadable: {exc}", sink=self.name
            ) from exc
        return PartMarker(part, marker["state"], positions, int(marker.get("records", 0)))

    def save_marker(self, marker: PartMarker, *, expect: Some[PartState | None]) -> bool:
        """``open``: (re)open the marker, with nothing applied and no lease. ``prepared``: once
        every staged document is there, the marker records the positions and the count."""
        part = marker.part
        if marker.state == OPEN:
            with self._errors("begin", part.token, AbortTransactionError):
                if not self._open_marker(part, expect):
                    return False
                strict = self._target_refuses()
            with self._lock:
                self._open_staging = _OpenStaging(part, self._pk(part), strict=strict)
            return True
        if marker.state != PREPARED:
            raise FatalSinkError(
                f"part {part.token}: the MongoDB sink saves no {marker.state} marker by itself",
                sink=self.name,
            )
        op = self._opened(part)
        if op is None:
            return False  # not open here: the caller looks at what the part is
        with self._errors("prepare", part.token, AbortTransactionError):
            # Guards against staged documents lost behind our back (a wrong cleanup, a restore).
            stored = self._staging.count_documents({"part": op.pk})
            if stored != op.staged:
                raise AbortTransactionError(
                    f"prepare: part {part.token} has {stored} staged documents, expected {op.staged}",
                    sink=self.name,
                )
            # The count is this sink's own: a record written twice is staged once.
            result = self._markers.update_one(
                {"_id": op.pk, "state": {"$in": [s for s in expect if s is not None]}},
                {
                    "$set": {
                        "state": PREPARED,
                        "records": op.staged,
                        "positions": positions_to_json(marker.positions),
                        "prepared_at": datetime.now(UTC),
                    }
                },
            )
        if result.matched_count == 0:
            return False  # aborted or removed meanwhile
        self._opened(part, take=True)
        return True

    def _open_marker(self, part: PartId, expect: Some[PartState | None]) -> bool:
        """Reset the marker of ``part`` to open if its state is in ``expect`` (insert it when
        ``expect`` holds None and there is none); whether it did."""
        pk = self._pk(part)
        # An aborted part may be opened again: a rewind re-reads the same transaction.
        marker = self._markers.find_one_and_update(
            {"_id": pk, "state": {"$in": [s for s in expect if s is not None]}},
            {
                "$set": {"state": OPEN, "records": 0, "applied": 0, "opened_at": datetime.now(UTC)},
                "$unset": _NO_LEASE,
            },
        )
        if marker is not None:
            return True
        if None not in expect:
            return False
        try:
            self._markers.insert_one(self._new_marker(part, OPEN))
        except DuplicateKeyError:
            return False  # another process wrote it meanwhile
        return True

    def _opened(self, part: PartId, *, take: bool = False) -> _OpenStaging | None:
        """The staging state of ``part`` if it is open in this instance (and no longer, ``take``)."""
        with self._lock:
            op = self._open_staging
            if op is None or op.part != part:
                return None
            if take:
                self._open_staging = None
            return op

    def list_parts(self, state: PartState) -> list[PartId]:
        """The parts of this pipeline and sink whose marker is in ``state``.

        ``open`` also lists parts whose staged documents outlived their marker (an abort that
        died between the marker and the clean-up, and was forgotten since): a writer or an
        aborter that died left both, and :meth:`abort` removes both.
        """
        query: Doc = {
            "pipeline": self.context.pipeline,
            "sink": self.name,
            "state": state,
            "kind": "part",
        }
        with self._errors("list_parts", "-", RetriableSinkError):
            found = {
                PartId(m["pipeline"], int(m["txn"]), m["participant"])
                for m in self._markers.find(query, {"pipeline": 1, "txn": 1, "participant": 1})
            }
            if state == OPEN:
                found.update(self._leftover_parts())
        return sorted(found)

    def _leftover_parts(self) -> list[PartId]:
        """Parts of this pipeline with staged documents and no prepared or committed marker."""
        staged = {
            str(pk)
            for pk in self._staging.distinct("part", {"part": {"$regex": self._pk_prefix()}})
        }
        if not staged:
            return []
        decided = {
            str(m["_id"])
            for m in self._markers.find(
                {"_id": {"$in": sorted(staged)}, "state": {"$in": [PREPARED, COMMITTED]}},
                {"_id": 1},
            )
        }
        prefix = f"{self.name}:"
        parts: list[PartId] = []
        for pk in staged - decided:
            try:
                part = PartId.parse(pk[len(prefix) :])
            except ValueError:
                continue  # not a part token of ours (a sink name that contains this one's)
            if pk.startswith(prefix) and part.pipeline == self.context.pipeline:
                parts.append(part)
        return parts

    # -- the write path -------------------------------------------------------------------------

    def check(self, records: Sequence[Record]) -> Sequence[Rejected]:
        """What :meth:`write` would refuse: the same staging code on a stand-in part of the
        same token length (so the staged size is the same), without writing anything."""
        part = PartId(self.context.pipeline, 0, self.context.participant)
        op = _OpenStaging(part, self._pk(part))
        rejected: list[Rejected] = []
        for record in records:
            try:
                self._stage(op, record, 0)
            except _Reject as exc:
                rejected.append(Rejected(record, str(exc), {"sink": self.name}))
        return rejected

    def _target_refuses(self) -> bool:
        """Whether the target can refuse a document by itself: a validator, or a unique index
        besides ``_id`` (read once per part, so an index added later counts from the next)."""
        db = self.client[self.cfg.database]
        for info in db.list_collections(filter={"name": self.cfg.collection}):
            if info.get("options", {}).get("validator"):
                return True
        return any(
            ix.get("unique") and ix.get("name") != "_id_" for ix in self._target.list_indexes()
        )

    def _tried_on_target(self, op: _OpenStaging, staged: list[RawBSONDocument]) -> dict[int, str]:
        """Which of ``staged`` the target refuses, and why: each batch is written to the
        target in a MongoDB transaction that is always aborted. A write error ends a
        transaction, so each round finds one refused document and the rest are tried again."""
        refused: dict[int, str] = {}
        left = list(range(len(staged)))
        target = self._target.with_options(codec_options=_RAW)
        while left:
            ops = [
                ReplaceOne({"_id": staged[i]["doc"]["_id"]}, staged[i]["doc"], upsert=True)
                for i in left
            ]
            with (
                self._errors("write", op.part.token, AbortTransactionError),
                self.client.start_session() as session,
            ):
                session.start_transaction()
                try:
                    target.bulk_write(ops, ordered=True, session=session)
                    return refused
                except BulkWriteError as exc:
                    errors = exc.details.get("writeErrors", [])
                finally:
                    if session.in_transaction:
                        session.abort_transaction()
            mine = [e for e in errors if e.get("code") not in _RETRIABLE_CODES]
            if not mine:
                raise RetriableSinkError(
                    f"write: part {op.part.token}: trying documents on the target: "
                    f"{errors[0].get('errmsg') if errors else 'no write error reported'}",
                    sink=self.name,
                )
            for e in mine:
                refused[left[int(e["index"])]] = (
                    f"MongoDB refused the document: {e.get('errmsg')} (code {e.get('code')})"
                )
            left = [i for i in left if i not in refused]
        return refused

    def stage(self, part: PartId, records: Sequence[Record]) -> Sequence[Rejected]:
        """Stage one document per record; a retried call stages each of them once."""
        batch = tuple(r.record_id for r in records)
        op = self._opened(part)
        if op is None:
            raise AbortTransactionError(
                f"write: part {part.token} is not open here", sink=self.name
            )
        with self._lock:
            # A retry of a failed call gets the same seqs (its documents may be staged already);
            # anything else gets fresh ones, so no two staged documents ever share a seq.
            retry = op.failed is not None and op.failed[0] == batch
            seq = op.failed[1] if op.failed is not None and retry else op.next_seq
        base = seq
        rejected: list[Rejected] = []
        staged: list[RawBSONDocument] = []
        staged_records: list[Record] = []
        for record in records:
            try:
                staged.append(self._stage(op, record, seq))
            except _Reject as exc:
                rejected.append(Rejected(record, str(exc), {"sink": self.name}))
                continue
            staged_records.append(record)
            seq += 1
        if staged and op.strict:
            refused = self._tried_on_target(op, staged)
            if refused:
                rejected.extend(
                    Rejected(staged_records[i], why, {"sink": self.name})
                    for i, why in sorted(refused.items())
                )
                staged = [doc for i, doc in enumerate(staged) if i not in refused]
        try:
            inserted, duplicates = self._insert_staged(op, staged) if staged else (0, [])
        except RetriableSinkError:
            with self._lock:
                op.failed = (batch, base)
                op.next_seq = max(op.next_seq, seq)
            raise
        with self._lock:
            op.next_seq = max(op.next_seq, seq)
            op.staged += inserted + len(op.uncertain.intersection(duplicates))
            op.uncertain.clear()
            op.failed = None
        return rejected

    # -- the commit and recovery path ---------------------------------------------------------

    def publish(self, part: PartId) -> None:
        """Apply ``part`` chunk by chunk, each chunk one transaction, under the commit lease."""
        pk = self._pk(part)
        self._enter_commit(part, "commit")
        try:
            # Read first: repeated decisions (recovery, sweeps) of a committed part cost one read.
            with self._errors("commit", part.token, FatalSinkError):
                marker = self._markers.find_one({"_id": pk}, {"state": 1})
            if marker is not None and marker["state"] == COMMITTED:
                self.log.debug("part %s: already committed", part.token)
                return
            self._require_prepared(part, marker)
            steps = 1
            while not self._commit_step(part):
                steps += 1
        finally:
            with self._lock:
                self._committing.discard(pk)
        with self._lock:
            self._leases.discard(pk)  # the last chunk released it (kept on errors, for close())
        self.log.debug("part %s: applied in %d steps", part.token, steps)

    def discard(self, part: PartId) -> None:
        """Mark ``part`` aborted unless a committer holds or has applied it; remove its staged
        documents."""
        pk = self._pk(part)
        self._opened(part, take=True)
        self._enter_commit(part, "abort")
        try:
            with self._errors("abort", part.token, FatalSinkError):
                marker = self._markers.find_one_and_update(
                    {
                        "_id": pk,
                        "state": {"$in": [OPEN, PREPARED]},
                        "applied": 0,
                        "$or": self._lease_free(),
                    },
                    {
                        "$set": {"state": ABORTED, "aborted_at": datetime.now(UTC)},
                        "$unset": _NO_LEASE,
                    },
                )
                if marker is None:
                    current = self._markers.find_one({"_id": pk})
                    state = current["state"] if current else None
                    if state == COMMITTED:
                        raise FatalSinkError(
                            f"abort: part {part.token} is already committed", sink=self.name
                        )
                    if state in (OPEN, PREPARED) and current and current.get("applied", 0) > 0:
                        raise FatalSinkError(
                            f"abort: part {part.token} is being committed ({current['applied']} "
                            "documents applied); only commit can finish it",
                            sink=self.name,
                        )
                    if current and state in (OPEN, PREPARED) and current.get("lease_owner"):
                        # A committer holds it and has applied nothing yet: wait; it either
                        # commits (then this abort is refused) or dies and its lease expires.
                        raise self._busy("abort", part, current)
                    if state in (OPEN, PREPARED):
                        raise RetriableSinkError(
                            f"abort: part {part.token} changed meanwhile", sink=self.name
                        )
                    # None (unknown part) or already aborted: nothing to mark.
                removed = self._staging.delete_many({"part": pk}).deleted_count
        finally:
            with self._lock:
                self._committing.discard(pk)
        with self._lock:
            self._leases.discard(pk)
        if removed:
            self.log.info("part %s: %d staged documents removed", part.token, removed)

    # -- housekeeping ---------------------------------------------------------------------------

    def committed_positions(self) -> dict[tuple[str, int], int]:
        """Next offset per source partition, as committed into this sink with the data."""
        with self._errors("committed_positions", "-", RetriableSinkError):
            docs = self._markers.find(
                {"kind": "positions", "pipeline": self.context.pipeline, "sink": self.name}
            )
            return {(d["topic"], int(d["partition"])): int(d["offset"]) for d in docs}

    def last_committed(self) -> CommittedInfo | None:
        """The committed marker of this pipeline and sink with the highest txn (of that txn's
        parts, the one committed last), with its ``committed_at``. One index range scan
        (``pipeline_sink_state_txn``) over the parts of that txn."""
        with self._errors("last_committed", "-", RetriableSinkError):
            newest = self._newest_committed()
            if newest is None:
                return None
            found = self._markers.find(
                {**self._committed_filter(), "txn": newest},
                {"txn": 1, "participant": 1, "committed_at": 1},
            )
            marker = max(found, key=lambda m: (m.get("committed_at") or _EPOCH, m["participant"]))
        at = marker.get("committed_at")
        return CommittedInfo(
            PartId(self.context.pipeline, int(marker["txn"]), str(marker["participant"])),
            at if isinstance(at, datetime) else None,
        )

    def forget(self, before_txn: int) -> int:
        """The SDK's retention hook; see :meth:`forget_decided`."""
        return self.forget_decided(before_txn)

    def forget_decided(self, before_txn: int) -> int:
        """Delete committed and aborted markers of this pipeline older than ``before_txn``,
        but the committed ones of the highest txn (:meth:`last_committed` reads them).

        Markers make ``commit``/``abort`` idempotent; once the decision log has moved past a
        transaction nobody repeats it, and without this the collection grows by one marker per
        part forever. Returns how many were deleted. Concurrent calls are safe: the highest
        committed txn only grows, so a call that read an older one deletes less.
        """
        with self._errors("forget_decided", "-", RetriableSinkError):
            newest = self._newest_committed()
            if newest is not None:
                before_txn = min(before_txn, newest)
            return self._markers.delete_many(
                {
                    "pipeline": self.context.pipeline,
                    "sink": self.name,
                    "state": {"$in": [COMMITTED, ABORTED]},
                    "kind": "part",
                    "txn": {"$lt": before_txn},
                }
            ).deleted_count

    def _committed_filter(self) -> Doc:
        return {
            "pipeline": self.context.pipeline,
            "sink": self.name,
            "state": COMMITTED,
            "kind": "part",
        }

    def _newest_committed(self) -> int | None:
        """The highest txn among this pipeline's committed markers in this sink."""
        marker = self._markers.find_one(self._committed_filter(), {"txn": 1}, sort=[("txn", -1)])
        return None if marker is None else int(marker["txn"])

    # -- internals -------------------------------------------------------------------------

    def _new_marker(self, part: PartId, state: str) -> Doc:
        return {
            "_id": self._pk(part),
            "kind": "part",
            "pipeline": part.pipeline,
            "sink": self.name,
            "txn": part.txn,
            "participant": part.participant,
            "state": state,
            "records": 0,
            "applied": 0,
            "created_at": datetime.now(UTC),
        }

    def _stage(self, op: _OpenStaging, record: Record, seq: int) -> RawBSONDocument:
        value: Any = record.value
        if not isinstance(value, Mapping):
            raise _Reject(f"value is a {type(value).__name__}, not a JSON object")
        _check_fields(value, "", 1)
        body: Doc
        if self.cfg.mode == "insert":
            if "_id" in value:
                raise _Reject(
                    "value has an _id field; insert mode sets _id to the record id "
                    "(use mode: upsert with key: [_id] to keep it)"
                )
            body = {"_id": record.record_id, **value}
        else:
            doc_id = self._key_of(value)
            body = {**value, "_id": doc_id}
            if self.cfg.version_field:
                body[self.cfg.version_field] = {"pipeline": op.part.pipeline, "txn": op.part.txn}
        staged = {"_id": f"{op.pk}|{record.record_id}", "part": op.pk, "seq": seq, "doc": body}
        try:
            try:
                raw = bson.encode(staged)
            except OverflowError:
                # An integer outside int64 (rare: checked only when BSON says so).
                staged["doc"] = _wide_ints_as_decimal(body, "")
                raw = bson.encode(staged)
        except (bson.InvalidDocument, OverflowError, TypeError, ValueError) as exc:
            raise _Reject(f"value cannot be stored as BSON: {exc}") from None
        if len(raw) > self._max_bson:
            raise _Reject(
                f"document is {len(raw)} bytes staged; MongoDB's limit is {self._max_bson}"
            )
        return RawBSONDocument(raw)

    def _key_of(self, value: Mapping[str, Any]) -> Any:
        parts: Doc = {}
        for name in self.cfg.key:
            v = value.get(name)
            if v is None:
                raise _Reject(f"key field {name!r} is {'null' if name in value else 'missing'}")
            if isinstance(v, list | tuple):
                raise _Reject(f"key field {name!r} is an array; arrays cannot be part of _id")
            parts[name] = v
        if len(parts) == 1:
            return next(iter(parts.values()))
        return parts

    def _insert_staged(
        self, op: _OpenStaging, staged: list[RawBSONDocument]
    ) -> tuple[int, list[str]]:
        ids = [str(d["_id"]) for d in staged]
        try:
            with self._errors("write", op.part.token, AbortTransactionError):
                try:
                    self._staging.insert_many(staged, ordered=False)
                    return len(staged), []
                except BulkWriteError as exc:
                    errors = exc.details.get("writeErrors", [])
                    others = [e for e in errors if e.get("code") != _DUPLICATE_KEY]
                    if others:
                        # The staging ``_id`` ends with the record id: the record's coordinates.
                        first = ids[int(others[0].get("index", 0))].rsplit("|", 1)[-1]
                        raise AbortTransactionError(
                            f"write: part {op.part.token}: {others[0].get('errmsg')} "
                            f"(at record {first}; {len(others)} documents refused)",
                            sink=self.name,
                        ) from exc
                    if exc.details.get("writeConcernErrors"):
                        raise RetriableSinkError(
                            f"write: part {op.part.token}: write concern not satisfied",
                            sink=self.name,
                        ) from exc
                    duplicates = [ids[int(e["index"])] for e in errors]
                    return len(staged) - len(duplicates), duplicates
        except RetriableSinkError:
            with self._lock:
                op.uncertain.update(ids)
            raise

    def _enter_commit(self, part: PartId, what: str) -> None:
        """Refuse a second commit/abort of ``part`` on another thread of this instance: both
        would act under the same lease name and collide like two processes without leases."""
        pk = self._pk(part)
        with self._lock:
            if pk not in self._committing:
                self._committing.add(pk)
                return
        raise BackpressureError(
            f"{what}: part {part.token} is being committed by another thread of this process; "
            f"retry after {_LEASE_POLL_S:.1f}s",
            retry_after_s=_LEASE_POLL_S,
            sink=self.name,
        )

    def _require_prepared(self, part: PartId, marker: Doc | None) -> Doc:
        """``marker`` when the part is prepared; else :class:`UnknownPartError`."""
        if marker is None:
            raise UnknownPartError(
                f"commit: part {part.token} is not in this store", sink=self.name
            )
        if marker["state"] != PREPARED:
            raise UnknownPartError(
                f"commit: part {part.token} is {marker['state']}, not prepared", sink=self.name
            )
        return marker

    def _busy(self, what: str, part: PartId, marker: Doc) -> BackpressureError:
        wait = min(_LEASE_POLL_S, self.cfg.commit_lease_s)
        until = marker.get("lease_until")
        return BackpressureError(
            f"{what}: part {part.token} is being committed by {marker.get('lease_owner')} "
            f"(lease until {until.isoformat(timespec='seconds') if until else '?'} server time, "
            f"{marker.get('applied', 0)} of {marker.get('records', '?')} applied); "
            f"retry after {wait:.1f}s",
            retry_after_s=wait,
            sink=self.name,
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
            {"lease_holder": self.context.participant},
        ]

    def _claim(self, part: PartId) -> bool:
        """Take or renew ``part``'s commit lease, outside any transaction.

        True when this instance holds it now; False when the part is committed already. Raises
        :class:`BackpressureError` while another committer's lease is live.
        """
        pk = self._pk(part)
        lease_ms = int(self.cfg.commit_lease_s * 1000)
        before = self._markers.find_one_and_update(
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
                        "lease_holder": self.context.participant,
                        "lease_until": {"$add": ["$$NOW", lease_ms]},
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
                    if before.get("lease_holder") == self.context.participant
                    else "whose lease expired",
                    before.get("applied"),
                )
            return True
        current = self._markers.find_one({"_id": pk})
        if current is not None and current["state"] == COMMITTED:
            return False
        raise self._busy("commit", part, self._require_prepared(part, current))

    def _commit_step(self, part: PartId) -> bool:
        """Renew the lease, apply one chunk of ``part`` in one transaction; True once committed."""
        cfg = self.cfg
        with self._errors("commit", part.token, FatalSinkError):
            if not self._claim(part):
                return True
        with (
            self._errors("commit", part.token, FatalSinkError),
            self.client.start_session() as session,
            session.start_transaction(
                # Snapshot reads + majority commit: a chunk sees and removes exactly what it applies.
                read_concern=ReadConcern("snapshot"),
                write_concern=WriteConcern(
                    w="majority", wtimeout=int(cfg.write_concern_timeout_s * 1000)
                ),
                read_preference=ReadPreference.PRIMARY,
                max_commit_time_ms=int(cfg.max_commit_time_s * 1000),
            ),
        ):
            return self._commit_chunk(part, session)

    def _commit_chunk(self, part: PartId, session: ClientSession) -> bool:
        pk = self._pk(part)
        cfg = self.cfg
        staging_raw = self._staging.with_options(codec_options=_RAW)
        marker = self._markers.find_one({"_id": pk}, session=session)
        if marker is not None and marker["state"] == COMMITTED:
            return True
        marker = self._require_prepared(part, marker)
        if marker.get("lease_owner") != self._me:
            raise self._busy("commit", part, marker)  # taken over since our claim: let it finish
        applied = int(marker.get("applied", 0))
        batch = list(
            staging_raw.find({"part": pk}, session=session)
            .sort("seq", ASCENDING)
            .limit(cfg.commit_chunk_size + 1)
            .batch_size(cfg.commit_chunk_size + 1)
        )
        chunk: list[RawBSONDocument] = []
        size = 0
        for staged in batch[: cfg.commit_chunk_size]:
            size += len(staged.raw)
            if chunk and size > cfg.commit_chunk_bytes:
                break
            chunk.append(staged)
        final = len(chunk) == len(batch)
        if final and applied + len(chunk) != int(marker.get("records", 0)):
            raise FatalSinkError(
                f"commit: part {part.token} was prepared with {marker.get('records')} documents "
                f"but {applied + len(chunk)} were staged; staging was changed behind this sink's "
                "back",
                sink=self.name,
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
                "$unset": _NO_LEASE,
            }
        else:
            update = {
                "$inc": {"applied": len(chunk)},
                "$set": {"applied_through": chunk[-1]["seq"]},
            }
        guard = {"_id": pk, "state": PREPARED, "lease_owner": self._me, "applied": applied}
        if self._markers.update_one(guard, update, session=session).matched_count != 1:
            raise RetriableSinkError(
                f"commit: part {part.token}: marker changed meanwhile", sink=self.name
            )
        writes = self._apply(part, chunk, session) if chunk else 0
        if chunk:
            # The chunk is this part's lowest seqs and seqs are unique per staged document, so a
            # range removes exactly the chunk (and uses the part_seq index; a long $in does not
            # on every server).
            removed = staging_raw.delete_many(
                {"part": pk, "seq": {"$lte": chunk[-1]["seq"]}}, session=session
            ).deleted_count
            if removed != len(chunk):
                raise FatalSinkError(
                    f"commit: part {part.token}: removed {removed} staged documents for a chunk "
                    f"of {len(chunk)}; staging was changed behind this sink's back",
                    sink=self.name,
                )
        if not final:
            self.log.debug(
                "part %s: applying, chunk of %d staged (%d writes)", part.token, len(chunk), writes
            )
            return False
        moves = [
            UpdateOne(
                {"_id": f"{self.name}:{part.pipeline}:{p['topic']}:{p['partition']}"},
                {
                    "$max": {"offset": int(p["offset"])},
                    "$setOnInsert": {
                        "kind": "positions",
                        "pipeline": part.pipeline,
                        "sink": self.name,
                        "topic": p["topic"],
                        "partition": int(p["partition"]),
                    },
                },
                upsert=True,
            )
            for p in marker.get("positions", [])
        ]
        if moves:
            self._markers.bulk_write(moves, ordered=True, session=session)
        return True

    def _apply(self, part: PartId, chunk: list[RawBSONDocument], session: ClientSession) -> int:
        """Replace-upsert the chunk's documents into the target, last one per ``_id`` winning."""
        latest: dict[bytes, RawBSONDocument] = {}
        for staged in chunk:
            doc = staged["doc"]
            latest.pop(_id_key(doc["_id"]), None)  # keep the order of the last occurrence
            latest[_id_key(doc["_id"])] = doc
        vf = self.cfg.version_field if self.cfg.mode == "upsert" else None
        ops: list[ReplaceOne[RawBSONDocument] | UpdateOne]
        if vf:
            # One server-side step per key, no read round trip: keep the stored document when
            # this pipeline already wrote it from a later transaction, else replace it.
            newer = {
                "$and": [
                    {"$eq": [f"${vf}.pipeline", part.pipeline]},
                    {"$in": [{"$type": f"${vf}.txn"}, ["int", "long"]]},
                    {"$gt": [f"${vf}.txn", part.txn]},
                ]
            }
            ops = [
                UpdateOne(
                    {"_id": doc["_id"]},
                    [{"$replaceWith": {"$cond": [newer, "$$ROOT", {"$literal": doc}]}}],
                    upsert=True,
                )
                for doc in latest.values()
            ]
        else:
            ops = [ReplaceOne({"_id": doc["_id"]}, doc, upsert=True) for doc in latest.values()]
        if ops:
            self._target.with_options(codec_options=_RAW).bulk_write(
                ops, ordered=True, session=session
            )
        return len(ops)

    @contextmanager
    def _errors(self, what: str, token: str, otherwise: type[SinkError]) -> Iterator[None]:
        """Map pymongo errors onto the SDK's three branches; ``otherwise`` for the rest."""
        try:
            yield
        except SinkError:
            raise
        except (ConnectionFailure, ExecutionTimeout, WriteConcernError) as exc:
            raise RetriableSinkError(
                f"{what} {token}: {type(exc).__name__}: {exc}", sink=self.name
            ) from exc
        except OperationFailure as exc:
            if (
                exc.has_error_label("TransientTransactionError")
                or exc.has_error_label("UnknownTransactionCommitResult")
                or exc.has_error_label("RetryableWriteError")
                or exc.code in _RETRIABLE_CODES
                # Two processes upserting the same marker/positions document at once.
                or (exc.code == _DUPLICATE_KEY and what == "commit")
                # A server-side failure of this attempt (a conflicting writer, on servers that
                # report it without the TransientTransactionError label). Applying a decided
                # part is idempotent, so it is repeated rather than ending the process: the
                # chaos run saw a participant exit on one during a commit.
                or (exc.code == _INTERNAL_ERROR and what in ("commit", "abort"))
            ):
                raise RetriableSinkError(f"{what} {token}: {exc}", sink=self.name) from exc
            if exc.code in _AUTH_CODES:
                raise FatalSinkError(
                    f"{what} {token}: not authorized: {exc}", sink=self.name
                ) from exc
            raise otherwise(f"{what} {token}: {exc}", sink=self.name) from exc
        except PyMongoError as exc:
            raise otherwise(f"{what} {token}: {type(exc).__name__}: {exc}", sink=self.name) from exc


def _check_fields(value: Mapping[Any, Any] | Sequence[Any], path: str, depth: int) -> None:
    """Reject field names MongoDB refuses or misreads, at any depth."""
    if depth > _MAX_DEPTH:
        raise _Reject(f"nested deeper than {_MAX_DEPTH} levels at {path or 'top'}")
    if isinstance(value, Mapping):
        for name, inner in value.items():
            if not isinstance(name, str):
                raise _Reject(f"field name {name!r} at {path or 'top'} is not a string")
            where = f"{path}.{name}" if path else name
            if name.startswith("$"):
                raise _Reject(f"field name {where!r} starts with '$'")
            if "." in name:
                raise _Reject(f"field name {where!r} contains '.'")
            if "\x00" in name:
                raise _Reject(f"field name {where!r} contains a NUL character")
            if isinstance(inner, Mapping | list | tuple):
                _check_fields(inner, where, depth + 1)
    else:
        for i, inner in enumerate(value):
            if isinstance(inner, Mapping | list | tuple):
                _check_fields(inner, f"{path}[{i}]", depth + 1)


#: Digits of a BSON Decimal128 (IEEE 754 decimal128): an integer with more has no exact form.
_DECIMAL128_DIGITS = 34


def _wide_ints_as_decimal(value: Any, path: str) -> Any:
    """``value`` with every integer outside int64 as an exact Decimal128 (the documented rule,
    ``docs/types.md``); one with more than 34 digits has no exact BSON form: refused."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        if -(2**63) <= value < 2**63:
            return value
        digits = len(str(abs(value)))
        if digits > _DECIMAL128_DIGITS:
            raise _Reject(
                f"field {path or 'value'!r}: integer of {digits} digits has no exact BSON form "
                f"(int64, or Decimal128 up to {_DECIMAL128_DIGITS} digits)"
            )
        return bson.Decimal128(str(value))
    if isinstance(value, Mapping):
        return {
            k: _wide_ints_as_decimal(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_wide_ints_as_decimal(v, f"{path}[{i}]") for i, v in enumerate(value)]
    return value


def _id_key(value: Any) -> bytes:
    """Hashable form of an ``_id`` (sub-documents included) for de-duplicating a chunk."""
    return bson.encode({"k": value})


def _scrub(message: str, uri: str) -> str:
    """Remove the URI's credentials from ``message`` (some driver errors quote the URI)."""
    userinfo = re.match(r"^[a-z+]+://([^@/]*)@", uri)
    for secret in (uri, userinfo.group(1) if userinfo else ""):
        if secret:
            message = message.replace(secret, "***")
    return message
