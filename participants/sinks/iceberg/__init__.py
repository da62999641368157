"""Iceberg sink: a part's rows become data files of an Apache Iceberg table, committed in one
snapshot together with the part's marker.

A :class:`~twophase.participants.sdk.BatchingSink` on the public SDK. The table lives in
pyiceberg's SQL catalog in a PostgreSQL database, its files in a warehouse (a local directory
or an S3 bucket); the sink's part markers live in the same database, in the catalog's schema.

Life of a part:

* **write** -- each record is converted to a row of the table's columns (``docs/types.md``),
  or refused with the column and the reason (dead-lettered); the rows wait in memory as Arrow
  batches. In ``upsert`` mode only each key's last change counts (a row, or a delete).
* **prepare** -- the rows are written as Parquet data files into the table's data directory
  (partitioned by its spec, fsynced on a local warehouse), with an Avro manifest listing them;
  then the marker row says ``prepared`` and names the manifest (and in ``upsert`` mode the keys
  the part touched). Nothing in the table references the files yet: readers do not see them.
* **commit** -- one PostgreSQL transaction: lock the marker row; if it is still ``prepared``,
  build the table's next snapshot (``upsert``: delete the rows of the part's keys, copy-on-write;
  then append the part's data files) with the part's id in its summary, swap the table's
  metadata pointer in the catalog row (:class:`~._catalog.PartCatalog`), mark the part
  committed and raise its positions. A concurrent commit of another part that won the pointer
  first makes pyiceberg rebuild the snapshot on the new head and try again. A repeated commit
  finds the marker committed and does nothing.
* **abort** -- marker ``aborted`` under the same lock, then the part's files are deleted. A late
  commit (a zombie's) finds the marker aborted and commits nothing: the lock orders the two.

The package: :mod:`.config` (the ``sinks[]`` entry), :mod:`._catalog` (the catalog committing on
the sink's connection; a FileIO that fsyncs), :mod:`._rows` (records to Arrow rows),
:mod:`._parts` (the marker and position tables), :mod:`.sink` (:class:`IcebergSink`).
User guide: ``docs/iceberg.md``.
"""

from twophase.participants.sinks.iceberg.config import IcebergSinkConfig
from twophase.participants.sinks.iceberg.sink import IcebergSink

__all__ = ["IcebergSink", "IcebergSinkConfig"]
