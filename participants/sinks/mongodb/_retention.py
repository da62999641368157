"""Marker retention: the committed positions, the newest committed part, and forgetting old
markers -- all read from the marker collection, never from memory.

Committed positions per source partition live in the marker collection (``kind: "positions"``),
raised (``$max``) by the last chunk of every commit. That chunk also stamps the marker's
``committed_at`` (the committer's clock), which :meth:`Retention.last` reports for the committed
marker with the highest txn -- a marker :meth:`Retention.forget` always keeps.
"""

from __future__ import annotations

from datetime import UTC, datetime

from twophase.participants.sdk import CommittedInfo, PartId, RetriableSinkError
from twophase.participants.sinks.mongodb._store import ABORTED, COMMITTED, Doc, Store

__all__ = ["Retention"]

#: Orders markers without a ``committed_at`` before any that has one.
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class Retention:
    """The housekeeping reads and deletes of one sink and pipeline."""

    def __init__(self, store: Store, pipeline: str) -> None:
        self.store = store
        self.pipeline = pipeline

    def positions(self) -> dict[tuple[str, int], int]:
        """Next offset per source partition, as committed into this sink with the data."""
        with self.store.errors("committed_positions", "-", RetriableSinkError):
            docs = self.store.markers.find(
                {"kind": "positions", "pipeline": self.pipeline, "sink": self.store.sink}
            )
            return {(d["topic"], int(d["partition"])): int(d["offset"]) for d in docs}

    def last(self) -> CommittedInfo | None:
        """The committed marker of this pipeline and sink with the highest txn (of that txn's
        parts, the one committed last), with its ``committed_at``. One index range scan
        (``pipeline_sink_state_txn``) over the parts of that txn."""
        with self.store.errors("last_committed", "-", RetriableSinkError):
            newest = self._newest()
            if newest is None:
                return None
            found = self.store.markers.find(
                {**self._committed(), "txn": newest},
                {"txn": 1, "participant": 1, "committed_at": 1},
            )
            marker = max(found, key=lambda m: (m.get("committed_at") or _EPOCH, m["participant"]))
        at = marker.get("committed_at")
        return CommittedInfo(
            PartId(self.pipeline, int(marker["txn"]), str(marker["participant"])),
            at if isinstance(at, datetime) else None,
        )

    def forget(self, before_txn: int) -> int:
        """Delete committed and aborted markers of this pipeline older than ``before_txn``,
        but the committed ones of the highest txn (:meth:`last` reads them).

        Markers make ``commit``/``abort`` idempotent; once the decision log has moved past a
        transaction nobody repeats it, and without this the collection grows by one marker per
        part forever. Returns how many were deleted. Concurrent calls are safe: the highest
        committed txn only grows, so a call that read an older one deletes less.
        """
        with self.store.errors("forget_decided", "-", RetriableSinkError):
            # A tombstone older than every part still to be applied guards nothing any more.
            self.store.markers.delete_many(
                {
                    "pipeline": self.pipeline,
                    "sink": self.store.sink,
                    "kind": "tombstone",
                    "txn": {"$lt": before_txn},
                }
            )
            newest = self._newest()
            if newest is not None:
                before_txn = min(before_txn, newest)
            return self.store.markers.delete_many(
                {
                    "pipeline": self.pipeline,
                    "sink": self.store.sink,
                    "state": {"$in": [COMMITTED, ABORTED]},
                    "kind": "part",
                    "txn": {"$lt": before_txn},
                }
            ).deleted_count

    def _committed(self) -> Doc:
        return {
            "pipeline": self.pipeline,
            "sink": self.store.sink,
            "state": COMMITTED,
            "kind": "part",
        }

    def _newest(self) -> int | None:
        """The highest txn among this pipeline's committed markers in this sink."""
        marker = self.store.markers.find_one(self._committed(), {"txn": 1}, sort=[("txn", -1)])
        return None if marker is None else int(marker["txn"])
