"""The conformance kit against the iceberg sink with an ``s3://`` warehouse in the stack's MinIO.

The same cases as the Iceberg classes of ``test_builtin_sinks.py``, but the sink's data files,
manifests and metadata go through pyiceberg's S3 FileIO into a bucket instead of a directory.
Each test has a prefix of its own in the stack's bucket and a catalog of its own in PostgreSQL;
the reader is a pyiceberg ``SqlCatalog`` with the same ``s3.*`` properties. One more test lists
the bucket: every file the table references, and every file a prepared part wrote, is an object
in MinIO, and none of them was written to the local disk.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow.parquet as pq
import pytest
from pyarrow import fs
from pyiceberg.catalog.sql import SqlCatalog

from harness import iceberg_catalog
from twophase.participants.sdk.testkit import (
    DeleteConformance,
    Kit,
    SinkConformance,
    SinkFactory,
    records,
)
from twophase.participants.sinks.iceberg import IcebergSink

TABLE = "kit.rows"
_S3_KEYS = (
    "TWOPHASE_S3_ENDPOINT",
    "TWOPHASE_S3_ACCESS_KEY",
    "TWOPHASE_S3_SECRET_KEY",
    "TWOPHASE_S3_BUCKET",
    "TWOPHASE_S3_REGION",
)


@dataclass(frozen=True)
class S3:
    """The stack's MinIO, as ``stack.env`` describes it."""

    endpoint: str
    access_key: str
    secret_key: str = field(repr=False)
    bucket: str
    region: str

    def properties(self) -> dict[str, str]:
        """pyiceberg's FileIO properties. The region is given so that pyiceberg never asks AWS
        where the bucket is; path-style is what pyarrow does with an endpoint anyway (pyiceberg
        reads ``s3.path-style-access`` not at all, Java engines do)."""
        return {
            "s3.endpoint": self.endpoint,
            "s3.access-key-id": self.access_key,
            "s3.secret-access-key": self.secret_key,
            "s3.region": self.region,
            "s3.path-style-access": "true",
        }

    def filesystem(self) -> fs.S3FileSystem:
        return fs.S3FileSystem(
            access_key=self.access_key,
            secret_key=self.secret_key,
            endpoint_override=self.endpoint,
            region=self.region,
        )


def _stack_has_no_minio(reason: str) -> None:
    pytest.fail(
        f"the local stack's MinIO is not usable ({reason}): run `make stack-up`", pytrace=False
    )


@pytest.fixture(scope="session")
def s3(stack_env: dict[str, str]) -> S3:
    missing = [key for key in _S3_KEYS if not stack_env.get(key)]
    if missing:
        _stack_has_no_minio(f"{', '.join(missing)} missing from stack.env")
    settings = S3(*(stack_env[key] for key in _S3_KEYS))
    where = urlsplit(settings.endpoint)
    try:
        with socket.create_connection((where.hostname or "", where.port or 80), timeout=2):
            pass
    except OSError as exc:
        _stack_has_no_minio(f"nothing answers on {settings.endpoint}: {exc}")
    info = settings.filesystem().get_file_info(settings.bucket)
    if info.type != fs.FileType.Directory:
        _stack_has_no_minio(f"bucket {settings.bucket!r} does not exist at {settings.endpoint}")
    return settings


class Lake:
    """A catalog of its own in the stack's PostgreSQL, a warehouse of its own in the bucket, and
    a reader: pyiceberg's SQL catalog with the same ``s3.*`` properties."""

    def __init__(self, pg_dsn: str, s3: S3, mode: str) -> None:
        self.catalog = f"kit{uuid.uuid4().hex[:10]}"
        self.bucket = s3.bucket
        self.prefix = f"kit-s3/{self.catalog}"
        self.warehouse = f"s3://{self.bucket}/{self.prefix}"
        self._pg_dsn = pg_dsn
        self._s3 = s3
        self._reader: SqlCatalog | None = None
        config: dict[str, object] = {
            "name": "lake",
            "type": "iceberg",
            "catalog": {
                "uri": pg_dsn,
                "name": self.catalog,
                "warehouse": self.warehouse,
                "properties": s3.properties(),
            },
            "table": TABLE,
            "create_table": {"id": "string", "n": "long", "text": "string"},
        }
        if mode == "upsert":
            config.update(mode="upsert", key=["id"])
        self.factory = SinkFactory(
            sink_class=IcebergSink,
            config=config,
            committed_ids=self.committed_ids,
            # "n" is a long column: a string that spells no integer is refused.
            bad_value={
                "id": "refused",
                "n": "not a number",
                "text": "the column's type refuses it",
            },
        )

    def reader(self) -> SqlCatalog:
        # Made on first use: the catalog's schema exists once a sink has set up.
        if self._reader is None:
            self._reader = iceberg_catalog(
                self._pg_dsn, self.catalog, self.warehouse, **self._s3.properties()
            )
        return self._reader

    def committed_ids(self) -> list[str]:
        scan = self.reader().load_table(TABLE).scan(selected_fields=("id",))
        return [str(v) for v in scan.to_arrow().column("id").to_pylist()]

    def close(self) -> None:
        if self._reader is not None:
            self._reader.engine.dispose()
        # The bucket is shared by every test and every run: leave it as it was.
        store, root = self._s3.filesystem(), f"{self.bucket}/{self.prefix}"
        if store.get_file_info(root).type != fs.FileType.NotFound:
            store.delete_dir(root)


@contextmanager
def _lake(pg_dsn: str, s3: S3, mode: str) -> Iterator[Lake]:
    lake = Lake(pg_dsn, s3, mode)
    try:
        yield lake
    finally:
        lake.close()


@pytest.mark.stack
class TestIcebergSinkS3(SinkConformance):
    @pytest.fixture
    def twophase_sink_factory(self, pg_dsn: str, s3: S3) -> Iterator[SinkFactory]:
        with _lake(pg_dsn, s3, "append") as lake:
            yield lake.factory


@pytest.mark.stack
class TestIcebergSinkS3Deletes(DeleteConformance):
    @pytest.fixture
    def twophase_sink_factory(self, pg_dsn: str, s3: S3) -> Iterator[SinkFactory]:
        with _lake(pg_dsn, s3, "upsert") as lake:
            yield lake.factory


@pytest.mark.stack
def test_the_tables_files_are_objects_in_minio_and_none_is_on_local_disk(
    pg_dsn: str, s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A path that lost its scheme on the way lands relative to the working directory
    # ("s3:/bucket/..." or "bucket/...") or at the root ("/bucket/..."): both are looked at.
    monkeypatch.chdir(tmp_path)
    store = s3.filesystem()
    with _lake(pg_dsn, s3, "append") as lake:
        kit = Kit(lake.factory)
        try:
            sink = kit.sink()
            committed = records(0, 40)
            kit.run(sink, kit.part(1), committed, commit=True)
            kit.run(sink, kit.part(2), records(100, 7))  # prepared: written, not referenced

            root = f"{lake.bucket}/{lake.prefix}"
            listed = _objects(store, root)
            table = lake.reader().load_table(TABLE)
            snapshot = table.current_snapshot()
            assert snapshot is not None
            manifests = snapshot.manifests(table.io)
            data_files = [
                entry.data_file for m in manifests for entry in m.fetch_manifest_entry(table.io)
            ]
            referenced = {
                table.metadata_location: None,
                snapshot.manifest_list: None,
                **{m.manifest_path: m.manifest_length for m in manifests},
                **{f.file_path: f.file_size_in_bytes for f in data_files},
            }
            assert data_files, "the committed part has no data file"
            for path, size in referenced.items():
                assert path.startswith(f"s3://{root}/"), f"{path} is not in the warehouse"
                key = path.removeprefix("s3://")
                assert key in listed, f"{path} is referenced by the table but not in MinIO"
                if size is not None:
                    assert listed[key] == size, f"{path}: {listed[key]} bytes in MinIO, {size} said"

            # The prepared part's data files and its manifest are objects too, apart from the
            # table's; the rows MinIO holds for the committed part are the part's records.
            data_keys = {k for k in listed if k.startswith(f"{root}/kit/rows/data/")}
            committed_keys = {f.file_path.removeprefix("s3://") for f in data_files}
            assert committed_keys < data_keys, "the prepared part wrote no data file to MinIO"
            part_manifests = [k for k in listed if Path(k).name.startswith("twophase-")]
            assert len(part_manifests) == 2, part_manifests
            ids = [
                i
                for key in committed_keys
                for i in pq.read_table(key, filesystem=store, columns=["id"])
                .column("id")
                .to_pylist()
            ]
            assert sorted(ids) == sorted(r.record_id for r in committed)

            # Aborting the prepared part deletes its objects.
            sink.abort(kit.part(2))
            left = _objects(store, root)
            assert not (data_keys - committed_keys) & left.keys(), "the aborted part's files remain"
            assert len([k for k in left if Path(k).name.startswith("twophase-")]) == 1
        finally:
            kit.cleanup()

        assert list(tmp_path.iterdir()) == [], "the sink wrote into its working directory"
        on_disk = [k for k in listed if Path("/", k).exists()]
        assert on_disk == [], f"written to the local disk as well: {on_disk}"


def _objects(store: fs.S3FileSystem, root: str) -> dict[str, int]:
    """``bucket/key`` -> size of every object under ``root`` (``bucket/prefix``)."""
    found = store.get_file_info(fs.FileSelector(root, allow_not_found=True, recursive=True))
    return {info.path: info.size for info in found if info.type == fs.FileType.File}
