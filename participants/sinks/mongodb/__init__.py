"""MongoDB sink: exactly-once, all-or-nothing parts on any MongoDB replica set or sharded cluster.

MongoDB clients have no two-phase commit, so a part goes through three durable stages, the
store operations of a :class:`~twophase.participants.sdk.BatchingSink`. The package, by concern:

* :mod:`.config` -- the ``sinks[]`` entry (:class:`MongoSinkConfig`);
* :mod:`._store` -- the client, the collections, and pymongo's errors mapped to the SDK's;
* :mod:`._documents` -- type mapping: a record becomes a document with a deterministic ``_id``;
* :mod:`._typed` -- a record with a schema: each field as the BSON type of its kind;
* :mod:`._staging` -- the write path: staged documents, tried on a target that can refuse them;
* :mod:`._commit` -- the commit and recovery path: chunked transactions under a commit lease;
* :mod:`._retention` -- committed positions, the last committed part, forgetting old markers;
* :mod:`.sink` -- :class:`MongoSink`, the store operations built from them.

1. **begin / write -- staging.** ``begin`` writes an ``open`` marker. Every record becomes one
   staged entry, and a write's entries are stored in ``staging_collection`` packed into chunk
   documents of up to ``commit_chunk_size`` entries (and ``commit_chunk_bytes``)::

       {_id: "<pk>|#<seq>", part: "<pk>", seq: <first entry's seq>, n: <entries>,
        entries: [{_id: "<pk>|<topic:partition:offset>", seq, doc: <the target document>}, ...]}

   where ``pk = "<sink name>:<part token>"``. ``doc`` already carries its final, deterministic
   ``_id`` (see below), so staging is a plain ``insert_many(ordered=False)`` with write concern
   majority; a retried write packs the same records into the same ``_id`` s and the duplicates
   are ignored. One server write per chunk instead of one per record: staging, reading back and
   removing the staged records per record were most of the sink's cost. Nothing of the part is
   in the target collection yet.

2. **prepare -- marker.** Once every staged write is acknowledged, the part's marker in
   ``marker_collection`` becomes ``prepared`` (write concern majority, journaled) and records the
   part's positions and document count. From then on any process, on new connections, can commit
   or abort the part: :meth:`MongoSink.in_doubt` lists it.

3. **commit -- move.** Staged documents are applied to the target (``insert_many`` in insert
   mode; by ``_id``, ``replace_one(upsert=True)``, otherwise -- and in insert mode too once a
   part meets one of its documents already there, a part applied again after a reset of its
   positions) inside MongoDB transactions that also delete them from staging and advance the
   marker's ``applied`` counter; the last one flips the marker to ``committed`` and raises the
   stored committed positions (``$max``) -- data, marker and positions in one local transaction.
   MongoDB transactions have size and time limits, so a large part is applied in its staged
   chunks, as many whole chunk documents per transaction as fit ``commit_chunk_size`` documents
   and ``commit_chunk_bytes``; a part that fits in one chunk commits in a single transaction. Because ``_id`` s are deterministic, every chunk is atomic
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
  and queryable, unlike a joined string). Without a configured ``key``, each record's schema
  names it (:attr:`RecordSchema.key`); a record without one is rejected. Within one part the last record per key wins -- the one
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

from twophase.participants.sinks.mongodb.config import MongoSinkConfig
from twophase.participants.sinks.mongodb.sink import MongoSink

__all__ = ["MongoSink", "MongoSinkConfig"]
