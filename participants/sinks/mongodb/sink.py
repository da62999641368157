"""The MongoDB sink's store operations (:class:`MongoSink`); the package docstring tells the story."""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Collection, Sequence
from datetime import UTC, datetime

from pymongo import MongoClient
from pymongo.errors import DuplicateKeyError

from twophase.participants import sdk
from twophase.participants.sinks.mongodb._commit import NO_LEASE, Committer
from twophase.participants.sinks.mongodb._documents import Documents, Reject
from twophase.participants.sinks.mongodb._retention import Retention
from twophase.participants.sinks.mongodb._staging import OpenStaging, target_refuses
from twophase.participants.sinks.mongodb._store import (
    COMMITTED,
    OPEN,
    PREPARED,
    Doc,
    Store,
)
from twophase.participants.sinks.mongodb.config import MongoSinkConfig

__all__ = ["MongoSink"]


class MongoSink(sdk.BatchingSink):
    """Stages parts in MongoDB, commits them with chunked MongoDB transactions. See the package."""

    config_model = MongoSinkConfig

    def __init__(self, config: sdk.SinkConfig, context: sdk.SinkContext) -> None:
        if not isinstance(config, MongoSinkConfig):
            raise sdk.FatalSinkError("config is not a MongoSinkConfig", sink=context.sink_name)
        super().__init__(config, context)
        self.cfg = config
        self._store = Store(config, self.name)
        self._documents = Documents(self._store)
        me = f"{context.participant}@{socket.gethostname()}:{os.getpid()}/{secrets.token_hex(4)}"
        self._commits = Committer(self._store, me, context.participant, self.log)
        self._retention = Retention(self._store, context.pipeline)
        #: The open part's staging state: put by its open marker, taken by its prepare or discard.
        self._open_staging: sdk.OpenSlot[OpenStaging] = sdk.OpenSlot()
        #: With a ``collection`` template: each record's collection (one per sink, so its
        #: per-topic names are worked out once, for check() and every part alike).
        self._template = (
            sdk.TargetTemplate(config.collection, config.topic_replace)
            if config.templated
            else None
        )

    @property
    def client(self) -> MongoClient[Doc]:
        return self._store.client

    # -- life cycle ------------------------------------------------------------------------

    def setup(self) -> None:
        if self._store.connected:
            return
        self._store.connect()
        cfg = self.cfg
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
        if not self._store.connected:
            return
        self._commits.release_leases()
        self._store.close()

    # -- markers --------------------------------------------------------------------------------

    def load_marker(self, part: sdk.PartId) -> sdk.PartMarker | None:
        store = self._store
        with store.errors("marker", part.token, sdk.RetriableSinkError):
            marker = store.markers.find_one(
                {"_id": store.pk(part)}, {"state": 1, "positions": 1, "records": 1}
            )
        if marker is None:
            return None
        try:
            positions = sdk.positions_from_json(marker.get("positions", []))
        except (ValueError, KeyError, TypeError) as exc:
            raise sdk.FatalSinkError(
                f"part {part.token}: its marker's positions are unreadable: {exc}", sink=self.name
            ) from exc
        return sdk.PartMarker(part, marker["state"], positions, int(marker.get("records", 0)))

    def save_marker(
        self, marker: sdk.PartMarker, *, expect: Collection[sdk.PartState | None]
    ) -> bool:
        """``open``: (re)open the marker, with nothing applied and no lease. ``prepared``: once
        every staged document is there, the marker records the positions and the count."""
        part, store = marker.part, self._store
        if marker.state == OPEN:
            with store.errors("begin", part.token, sdk.AbortTransactionError):
                if not self._open_marker(part, expect):
                    return False
                strict = False if self.cfg.templated else target_refuses(store)
            staging = OpenStaging(part, store.pk(part), store, self._documents, strict)
            staging.template = self._template
            self._open_staging.put(part, staging)
            return True
        if marker.state != PREPARED:
            raise sdk.FatalSinkError(
                f"part {part.token}: the MongoDB sink saves no {marker.state} marker by itself",
                sink=self.name,
            )
        op = self._open_staging.get(part)
        if op is None:
            return False  # not open here: the caller looks at what the part is
        with store.errors("prepare", part.token, sdk.AbortTransactionError):
            # Guards against staged documents lost behind our back (a wrong cleanup, a restore).
            stored = sum(
                int(d.get("n", 1)) for d in store.staging.find({"part": op.pk}, {"n": 1, "_id": 0})
            )
            if stored != op.staged:
                raise sdk.AbortTransactionError(
                    f"prepare: part {part.token} has {stored} staged entries, expected {op.staged}",
                    sink=self.name,
                )
            # The count is this sink's own: a retried write's records are staged once.
            result = store.markers.update_one(
                {"_id": op.pk, "state": {"$in": [s for s in expect if s is not None]}},
                {
                    "$set": {
                        "state": PREPARED,
                        "records": op.staged,
                        "positions": sdk.positions_to_json(marker.positions),
                        "prepared_at": datetime.now(UTC),
                    }
                },
            )
        if result.matched_count == 0:
            return False  # aborted or removed meanwhile
        self._open_staging.get(part, take=True)
        return True

    def _open_marker(self, part: sdk.PartId, expect: Collection[sdk.PartState | None]) -> bool:
        """Reset the marker of ``part`` to open if its state is in ``expect`` (insert it when
        ``expect`` holds None and there is none); whether it did."""
        markers = self._store.markers
        # An aborted part may be opened again: a rewind re-reads the same transaction.
        marker = markers.find_one_and_update(
            {"_id": self._store.pk(part), "state": {"$in": [s for s in expect if s is not None]}},
            {
                "$set": {"state": OPEN, "records": 0, "applied": 0, "opened_at": datetime.now(UTC)},
                "$unset": NO_LEASE,
            },
        )
        if marker is not None:
            return True
        if None not in expect:
            return False
        try:
            markers.insert_one(self._store.new_marker(part, OPEN))
        except DuplicateKeyError:
            return False  # another process wrote it meanwhile
        return True

    def list_parts(self, state: sdk.PartState) -> list[sdk.PartId]:
        """The parts of this pipeline and sink whose marker is in ``state``.

        ``open`` also lists parts whose staged documents outlived their marker (an abort that
        died between the marker and the clean-up, and was forgotten since): a writer or an
        aborter that died left both, and :meth:`abort` removes both.
        """
        store = self._store
        query: Doc = {
            "pipeline": self.context.pipeline,
            "sink": self.name,
            "state": state,
            "kind": "part",
        }
        with store.errors("list_parts", "-", sdk.RetriableSinkError):
            found = {
                sdk.PartId(m["pipeline"], int(m["txn"]), m["participant"])
                for m in store.markers.find(query, {"pipeline": 1, "txn": 1, "participant": 1})
            }
            if state == OPEN:
                found.update(self._leftover_parts())
        return sorted(found)

    def _leftover_parts(self) -> list[sdk.PartId]:
        """Parts of this pipeline with staged documents and no prepared or committed marker."""
        store = self._store
        pattern = store.pk_prefix(self.context.pipeline)
        staged = {str(pk) for pk in store.staging.distinct("part", {"part": {"$regex": pattern}})}
        if not staged:
            return []
        decided = {
            str(m["_id"])
            for m in store.markers.find(
                {"_id": {"$in": sorted(staged)}, "state": {"$in": [PREPARED, COMMITTED]}},
                {"_id": 1},
            )
        }
        prefix = f"{self.name}:"
        parts: list[sdk.PartId] = []
        for pk in staged - decided:
            try:
                part = sdk.PartId.parse(pk[len(prefix) :])
            except ValueError:
                continue  # not a part token of ours (a sink name that contains this one's)
            if pk.startswith(prefix) and part.pipeline == self.context.pipeline:
                parts.append(part)
        return parts

    # -- the write path -------------------------------------------------------------------------

    @property
    def supports_deletes(self) -> bool:
        """In upsert and update mode: a delete removes the document of its key."""
        return self.cfg.mode != "insert"

    def check(self, records: Sequence[sdk.Record]) -> Sequence[sdk.Rejected]:
        """What :meth:`write` would refuse: the same staging code on a stand-in part of the
        same token length (so the staged size is the same), without writing anything."""
        part = sdk.PartId(self.context.pipeline, 0, self.context.participant)
        pk = self._store.pk(part)
        rejected: list[sdk.Rejected] = []
        template = self._template
        for record in records:
            coll = None
            if template is not None:
                target = template.render(record)
                if isinstance(target, sdk.Rejected):
                    rejected.append(sdk.Rejected(record, target.reason, {"sink": self.name}))
                    continue
                coll = target
            try:
                self._documents.staged(part, pk, record, 0, coll)
            except Reject as exc:
                rejected.append(sdk.Rejected(record, str(exc), {"sink": self.name}))
        return rejected

    def stage(self, part: sdk.PartId, records: Sequence[sdk.Record]) -> Sequence[sdk.Rejected]:
        """Stage one entry per record, packed into chunk documents; a retried call stages each of
        them once."""
        op = self._open_staging.get(part)
        if op is None:
            raise sdk.AbortTransactionError(
                f"write: part {part.token} is not open here", sink=self.name
            )
        return op.write(records)

    # -- the commit and recovery path ---------------------------------------------------------

    def publish(self, part: sdk.PartId) -> None:
        self._commits.commit(part)

    def discard(self, part: sdk.PartId) -> None:
        self._open_staging.get(part, take=True)
        removed = self._commits.abort(part)
        if removed:
            self.log.info("part %s: %d staged documents removed", part.token, removed)

    # -- housekeeping ---------------------------------------------------------------------------

    def committed_positions(self) -> dict[tuple[str, int], int]:
        """Next offset per source partition, as committed into this sink with the data."""
        return self._retention.positions()

    def last_committed(self) -> sdk.CommittedInfo | None:
        return self._retention.last()

    def forget(self, before_txn: int) -> int:
        """The SDK's retention hook; see :meth:`forget_decided`."""
        return self.forget_decided(before_txn)

    def forget_decided(self, before_txn: int) -> int:
        """Delete committed and aborted markers of this pipeline older than ``before_txn``, but
        the committed ones of the highest txn (:meth:`last_committed` reads them)."""
        return self._retention.forget(before_txn)
