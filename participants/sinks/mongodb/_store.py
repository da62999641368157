"""The MongoDB sink's connection: the client, its three collections, the marker's key, and
pymongo's errors mapped onto the SDK's three branches -- what every other part of the sink uses."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from bson.codec_options import CodecOptions
from bson.raw_bson import RawBSONDocument
from pymongo import ASCENDING, MongoClient
from pymongo.collection import Collection
from pymongo.errors import (
    CollectionInvalid,
    ConfigurationError,
    ConnectionFailure,
    ExecutionTimeout,
    OperationFailure,
    PyMongoError,
    WriteConcernError,
)
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

from twophase.participants.sdk import FatalSinkError, PartId, RetriableSinkError, SinkError
from twophase.participants.sinks.mongodb.config import MongoSinkConfig

__all__ = [
    "ABORTED",
    "COMMITTED",
    "DUPLICATE_KEY",
    "OPEN",
    "PREPARED",
    "RAW",
    "RETRIABLE_CODES",
    "Doc",
    "Store",
]

Doc = dict[str, Any]

# Marker states.
OPEN = "open"
PREPARED = "prepared"
COMMITTED = "committed"
ABORTED = "aborted"

#: Server error codes that are transient even when the server does not label them so
#: (stepdowns, shutdowns, network trouble between mongos and shards, lock/time limits).
RETRIABLE_CODES = frozenset(
    {6, 7, 50, 89, 91, 112, 189, 244, 251, 262, 9001, 10107, 11600, 11601, 11602, 13435, 13436}
)
#: Unauthorized, AuthenticationFailed: retrying with the same credentials cannot help.
_AUTH_CODES = frozenset({13, 18})
_INTERNAL_ERROR = 1
DUPLICATE_KEY = 11000
#: Staged documents are read and replayed as raw BSON: user documents are never decoded.
RAW: CodecOptions[RawBSONDocument] = CodecOptions(document_class=RawBSONDocument)


class Store:
    """One sink instance's client (a process of its own to the server) and collections."""

    def __init__(self, cfg: MongoSinkConfig, sink: str) -> None:
        self.cfg = cfg
        self.sink = sink
        self._client: MongoClient[Doc] | None = None
        #: The server's document size limit, read at connect.
        self.max_bson = 16 * 1024 * 1024
        # Majority + journal: once acknowledged, a staged doc or marker survives any failover.
        self.wc = WriteConcern(
            w="majority", j=True, wtimeout=int(cfg.write_concern_timeout_s * 1000)
        )
        #: Collections known to exist (a template's targets, created on first use).
        self._made: set[str] = set()

    @property
    def client(self) -> MongoClient[Doc]:
        if self._client is None:
            raise FatalSinkError("setup() has not been called", sink=self.sink)
        return self._client

    @property
    def connected(self) -> bool:
        return self._client is not None

    def coll(self, name: str) -> Collection[Doc]:
        return self.client[self.cfg.database].get_collection(
            name, write_concern=self.wc, read_concern=ReadConcern("majority")
        )

    @property
    def target(self) -> Collection[Doc]:
        return self.coll(self.cfg.collection)

    def ensure_collection(self, name: str) -> None:
        """Create ``name`` when it does not exist yet (a template's collection, on its first
        record: collections cannot be created inside transactions before MongoDB 4.4)."""
        if name in self._made:
            return
        try:
            self.client[self.cfg.database].create_collection(name, write_concern=self.wc)
        except CollectionInvalid:
            pass  # there already, or another participant created it first
        except OperationFailure as exc:
            if exc.code != 48:  # NamespaceExists: same race, older servers
                raise
        self._made.add(name)

    @property
    def staging(self) -> Collection[Doc]:
        return self.coll(self.cfg.staging)

    @property
    def markers(self) -> Collection[Doc]:
        return self.coll(self.cfg.marker_collection)

    def pk(self, part: PartId) -> str:
        """The ``_id`` of the part's marker, and the ``part`` of its staged documents."""
        return f"{self.sink}:{part.token}"

    def pk_prefix(self, pipeline: str) -> str:
        """A regular expression for the ``pk`` of every part of ``pipeline`` in this sink."""
        return f"^{re.escape(self.sink)}:{re.escape(pipeline)}~"

    def new_marker(self, part: PartId, state: str) -> Doc:
        return {
            "_id": self.pk(part),
            "kind": "part",
            "pipeline": part.pipeline,
            "sink": self.sink,
            "txn": part.txn,
            "participant": part.participant,
            "state": state,
            "records": 0,
            "applied": 0,
            "created_at": datetime.now(UTC),
        }

    def connect(self) -> None:
        """Connect, check the server can run transactions, create what is missing."""
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
                # Over the URI's readPreference (and the tags and staleness that only a
                # secondary-reading one may name): a secondary can be behind a write the sink
                # has just had acknowledged (a marker, a staged part), and positions read
                # behind it would have committed records applied again.
                readPreference="primary",
                readPreferenceTags="",
                maxStalenessSeconds=-1,
                tz_aware=True,
            )
        except ConfigurationError as exc:
            raise FatalSinkError(
                f"config field 'uri': {_scrub(str(exc), cfg.uri.get_secret_value())}",
                sink=self.sink,
            ) from None  # the chained exception could carry the URI into a traceback
        with self.errors("setup", "-", FatalSinkError):
            hello = self.client.admin.command("hello")
            if not hello.get("setName") and hello.get("msg") != "isdbgrid":
                raise FatalSinkError(
                    "MongoDB is a standalone server; commits need multi-document transactions, "
                    "which only a replica set (a single-node one is fine) or a sharded cluster has",
                    sink=self.sink,
                )
            if int(hello.get("maxWireVersion", 0)) < 8:
                raise FatalSinkError(
                    "MongoDB 4.2 or newer is required (transactions)", sink=self.sink
                )
            self.max_bson = int(hello.get("maxBsonObjectSize", self.max_bson))
            db = self.client[cfg.database]
            existing = set(db.list_collection_names())
            # Collections cannot be created inside a transaction before MongoDB 4.4: create them now.
            names = [cfg.staging, cfg.marker_collection]
            if not cfg.templated:
                names.append(cfg.collection)
            for name in names:
                if name not in existing:
                    try:
                        db.create_collection(name, write_concern=self.wc)
                    except CollectionInvalid:
                        pass  # another participant created it first
                    except OperationFailure as exc:
                        if exc.code != 48:  # NamespaceExists: same race, older servers
                            raise
            self.staging.create_index([("part", ASCENDING), ("seq", ASCENDING)], name="part_seq")
            self.markers.create_index(
                [
                    ("pipeline", ASCENDING),
                    ("sink", ASCENDING),
                    ("state", ASCENDING),
                    ("txn", ASCENDING),
                ],
                name="pipeline_sink_state_txn",
            )

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        self._client = None

    @contextmanager
    def errors(self, what: str, token: str, otherwise: type[SinkError]) -> Iterator[None]:
        """Map pymongo errors onto the SDK's three branches; ``otherwise`` for the rest."""
        try:
            yield
        except SinkError:
            raise
        except (ConnectionFailure, ExecutionTimeout, WriteConcernError) as exc:
            raise RetriableSinkError(
                f"{what} {token}: {type(exc).__name__}: {exc}", sink=self.sink
            ) from exc
        except OperationFailure as exc:
            if (
                exc.has_error_label("TransientTransactionError")
                or exc.has_error_label("UnknownTransactionCommitResult")
                or exc.has_error_label("RetryableWriteError")
                or exc.code in RETRIABLE_CODES
                # Two processes upserting the same marker/positions document at once.
                or (exc.code == DUPLICATE_KEY and what == "commit")
                # A server-side failure of this attempt (a conflicting writer, on servers that
                # report it without the TransientTransactionError label). Applying a decided
                # part is idempotent, so it is repeated rather than ending the process: the
                # chaos run saw a participant exit on one during a commit.
                or (exc.code == _INTERNAL_ERROR and what in ("commit", "abort"))
            ):
                raise RetriableSinkError(f"{what} {token}: {exc}", sink=self.sink) from exc
            if exc.code in _AUTH_CODES:
                raise FatalSinkError(
                    f"{what} {token}: not authorized: {exc}", sink=self.sink
                ) from exc
            raise otherwise(f"{what} {token}: {exc}", sink=self.sink) from exc
        except PyMongoError as exc:
            raise otherwise(f"{what} {token}: {type(exc).__name__}: {exc}", sink=self.sink) from exc


def _scrub(message: str, uri: str) -> str:
    """Remove the URI's credentials from ``message`` (some driver errors quote the URI)."""
    userinfo = re.match(r"^[a-z+]+://([^@/]*)@", uri)
    for secret in (uri, userinfo.group(1) if userinfo else ""):
        if secret:
            message = message.replace(secret, "***")
    return message
