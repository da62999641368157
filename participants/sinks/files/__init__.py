"""Files sink: Parquet (default) or JSON Lines, published by atomic rename, one manifest per part.

A :class:`~twophase.participants.sdk.BatchingSink`: the part's directories are its markers, and
its store operations are the steps below. The package, by concern:

* :mod:`.config` -- the ``sinks[]`` entry (:class:`FileSinkConfig`);
* :mod:`._schema`, :mod:`._arrow`, :mod:`._typed`, :mod:`._encoders` -- type mapping: a
  configured schema, inferred Parquet columns, Parquet typed by a record's own schema, and the
  encoders that judge each record;
* :mod:`._datasets` -- each dataset's schema (``_common_metadata``), its changes
  (``auto_evolve``) reserved by the open part and merged at its commit, and
  :func:`read_dataset`;
* :mod:`._layout` -- the directories and the ``flock`` that tells a live writer from a dead one;
* :mod:`._staging` -- the write path: buffers, data files, ``PREPARED.json``;
* :mod:`._raw` -- the raw path of inferred Parquet: JSON values into the same Arrow columns
  without decoding them (``docs/types.md``);
* :mod:`._publish` -- the commit path: staged files to their targets, never overwriting;
* :mod:`._manifests` -- the commit markers and their retention;
* :mod:`.sink` -- :class:`FileSink`, the store operations built from them.

Layout under the configured ``path`` (bookkeeping sits under ``_twophase/``, which Spark, DuckDB
and ``pyarrow.dataset`` skip by default, like every name that starts with ``_`` or ``.``)::

    {path}/{topic}/date=YYYY-MM-DD/part-{txn:012d}-{participant}-{seq:04d}.parquet   committed data
    {path}/{topic}/_common_metadata                    the dataset's schema (typed records)
    {path}/_twophase/{pipeline}/open/{token}/          the part being written (+ LOCK, held by flock)
    {path}/_twophase/{pipeline}/prepared/{token}/      staged: fsynced data files + PREPARED.json
    {path}/_twophase/{pipeline}/manifests/{txn:012d}-{participant}.json   commit marker + file list
    {path}/_twophase/{pipeline}/trash/                 directories being deleted
    {path}/_twophase/_schemas/topic={topic}.lock       the dataset's lock (its schema's changes)

Life of a part:

* ``begin``: create ``open/{token}/`` and hold an exclusive ``flock`` on its ``LOCK`` file for as
  long as this process owns the part. The kernel drops the lock when the process dies, which is
  how :meth:`FileSink.abandoned` tells abandoned parts from live ones.
* ``write``: records are grouped per output file (topic and UTC date of the record timestamp; a
  timestamp no date names -- none, or after 9999-12-31 -- goes under the null date) and
  buffered as Arrow tables (Parquet) or encoded lines (JSON Lines). A buffer that reaches
  ``max_file_records`` is written to a complete, fsynced file in the open directory; when all
  buffers together exceed ``max_buffered_records`` (default 100,000) the largest is written
  early.
* ``prepare``: write the remaining buffers, write ``PREPARED.json`` (positions, the file list with
  target paths, record counts, sizes, SHA-256) atomically, fsync the directory, then rename
  ``open/{token}`` to ``prepared/{token}`` -- the atomic prepare -- and fsync both parents.
* ``commit``: hard-link every staged file to its target (no-replace, so a file is never
  overwritten; rename where hard links are unsupported), fsync the target directories, write the
  manifest atomically -- the commit point of this part in this store -- and discard the staged
  directory. Every step can be repeated, by any process, after a crash at any point.
* ``abort``: the open or prepared directory disappears by one rename into ``trash/``.

Housekeeping: the manifests also hold each part's source positions and commit time, so
:meth:`FileSink.committed_positions` is the highest offset per partition over them,
:meth:`FileSink.last_committed` the manifest with the highest txn, and :meth:`FileSink.forget`
deletes old manifests but the best one of each partition and those of the highest txn, which
keeps ``manifests/`` bounded.

What readers see: no file appears in ``{path}/{topic}`` before ``commit``, and every file that
appears is complete (it was fsynced before it was linked). While a part commits, a reader that
lists the directories may see some of its files before others; the manifest is the atomic view:
read ``manifests/*.json`` and load exactly the files they list for a transactionally consistent
snapshot.

Schema (Parquet): with ``schema`` configured, each record is checked against it (the SDK's
shared conversion rules, :mod:`twophase.participants.sdk.values`) and a value that does not fit is
returned as :class:`Rejected` naming the field; all files then share one schema. Without it, each
column's type is decided when a file is written, from *all* of that file's values of the field,
so no record is refused because of the records around it or their order (``docs/types.md``):
Arrow's own inference when it is exact (ints with floats become doubles only when every int is
exactly a double; objects merge their keys), integers outside int64 as ``decimal(38, 0)``, and
anything else -- mixed types, nesting Parquet readers cannot read -- as the values' exact JSON
text, the column named in the file's ``twophase.json_columns`` metadata. Inferred schemas can
differ between files, so configure ``schema`` for datasets that readers scan as one table.
Parquet cannot store an empty group, so ``{}`` nested in a record is stored as null. Buffered
records wait as Arrow arrays, typed per write; a field whose writes disagree is re-typed from
all of its values when the file is written.

A record that carries a schema (:attr:`Record.schema`) is typed by it instead (Parquet, no
configured ``schema``; :mod:`._typed`), and its dataset keeps one schema, changed only by
committed parts (:mod:`._datasets`): a compatible change with ``auto_evolve`` is reserved by the
open part (``SCHEMAS.json`` in its directory), recorded in its manifest and merged into
``_common_metadata`` at its commit; other changes are refused by :meth:`FileSink.open_targets`,
and a change while another undecided part changes the dataset is held for a later part.
``docs/types.md``, "From a record's schema".
"""

from twophase.participants.sinks.files._datasets import read_dataset
from twophase.participants.sinks.files.config import FieldType, FileSinkConfig
from twophase.participants.sinks.files.sink import FileSink

__all__ = ["FieldType", "FileSink", "FileSinkConfig", "read_dataset"]
