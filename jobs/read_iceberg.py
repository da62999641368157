"""Read a table the iceberg sink writes, with Spark, through Iceberg's ``JdbcCatalog``.

The sink keeps its tables in pyiceberg's SQL catalog: rows of ``iceberg_tables`` in a PostgreSQL
schema (``catalog.schema``, default ``iceberg_catalog``), keyed by the catalog's name
(``catalog.name``). Iceberg's Spark runtime reads the same rows with its ``JdbcCatalog`` when it
is given the same database, with that schema as the connection's current schema, the same
warehouse, and the sink's catalog name as the **Spark catalog's name** (``JdbcCatalog`` files
tables under the name Spark registered it with). :func:`catalog_conf` is that configuration.

Run as a process (the tests do, on ``local[2]`` and on a standalone cluster)::

    python -m twophase.jobs.read_iceberg --uri postgresql://app@db:5432/lake \\
        --catalog twophase --warehouse file:///data/warehouse --table sales.orders \\
        [--master spark://host:7077] [--checksums] [--rows]

It prints one JSON object per ``--table``: ``{"table", "snapshot_id", "count"}``, with
``--checksums`` a per-column checksum (the sum of Spark's ``xxhash64`` of each value: independent
of row order and file layout, so two reads of one snapshot agree on any cluster), and with
``--rows`` every row, as Spark's ``to_json`` writes it (timestamps in UTC; decimals as strings,
exact), in no particular order -- for small tables.
Each table is read at one snapshot: the one its ``main`` branch points at when the read starts.
The password is never on the command line: in the URI, or in the variable ``--password-env``
names. Exit status 0, or 1 when a table could not be read (the error is printed).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from decimal import Decimal
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "DEFAULT_SCHEMA",
    "add_catalog",
    "catalog_conf",
    "current_snapshot",
    "jdbc_url",
    "main",
    "read_table",
    "table_summary",
]

#: The sink's default ``catalog.schema``.
DEFAULT_SCHEMA = "iceberg_catalog"
#: Spark catalog names are SQL identifiers, and a dot would end the name in the config key.
_CATALOG_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def jdbc_url(uri: str, schema: str = DEFAULT_SCHEMA) -> tuple[str, str | None, str | None]:
    """``postgresql://user:pw@host:port/db?...`` as the PostgreSQL JDBC driver's URL, with
    ``currentSchema=<schema>``, and the user and password apart (``JdbcCatalog`` passes them as
    ``jdbc.user`` / ``jdbc.password``). A ``jdbc:postgresql://`` URL is taken as it is.

    The current schema matters: ``JdbcCatalog`` names ``iceberg_tables`` unqualified, so it must
    resolve to the sink's schema, not to ``public``.
    """
    if uri.startswith("jdbc:"):
        return uri, None, None
    parts = urlsplit(uri)
    if parts.scheme not in ("postgresql", "postgres"):
        raise ValueError("the catalog URI must be postgresql://... (the sink's catalog.uri)")
    host = parts.hostname or "localhost"
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "currentSchema"]
    query.append(("currentSchema", schema))
    url = f"jdbc:postgresql://{netloc}{parts.path or '/'}?{urlencode(query)}"
    user = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else None
    return url, user, password


def catalog_conf(
    catalog: str,
    uri: str,
    warehouse: str,
    *,
    schema: str = DEFAULT_SCHEMA,
    password: str | None = None,
) -> dict[str, str]:
    """Spark settings that make ``catalog`` Iceberg's ``JdbcCatalog`` on the sink's catalog.

    ``catalog`` must be the sink's ``catalog.name``; ``uri``, ``schema`` and ``warehouse`` its
    ``catalog.uri``, ``catalog.schema`` and ``catalog.warehouse``. ``password`` overrides the
    URI's.
    """
    if not _CATALOG_NAME.fullmatch(catalog):
        raise ValueError(
            f"catalog name {catalog!r}: Spark needs a plain identifier (letters, digits, _)"
        )
    url, user, uri_password = jdbc_url(uri, schema)
    if warehouse.startswith("/"):
        warehouse = f"file://{warehouse}"  # as the sink reads a bare path
    prefix = f"spark.sql.catalog.{catalog}"
    conf = {
        prefix: "org.apache.iceberg.spark.SparkCatalog",
        f"{prefix}.type": "jdbc",
        f"{prefix}.uri": url,
        f"{prefix}.warehouse": warehouse,
        # A reader never makes the catalog's tables (the sink does, in its schema): a wrong
        # schema or database fails on the missing table instead of creating an empty catalog.
        f"{prefix}.jdbc.init-catalog-tables": "false",
        # Every query loads the table's current metadata. The caching catalog would serve a
        # table loaded earlier for up to 30 s and miss the sink's commits since.
        f"{prefix}.cache-enabled": "false",
    }
    # No jdbc.schema-version: pyiceberg's catalog tables have the iceberg_type column, which
    # JdbcCatalog detects (its "V1" schema, with views) whatever that setting says; setting V1
    # would only make a reader ALTER an older catalog's table.
    if user:
        conf[f"{prefix}.jdbc.user"] = user
    if password or uri_password:
        conf[f"{prefix}.jdbc.password"] = str(password or uri_password)
    return conf


def add_catalog(
    spark: SparkSession,
    catalog: str,
    uri: str,
    warehouse: str,
    *,
    schema: str = DEFAULT_SCHEMA,
    password: str | None = None,
) -> None:
    """Register the catalog in a running session (Spark loads a catalog on its first use)."""
    for key, value in catalog_conf(
        catalog, uri, warehouse, schema=schema, password=password
    ).items():
        spark.conf.set(key, value)


def _name(catalog: str, table: str, *suffix: str) -> str:
    return ".".join(f"`{p}`" for p in (catalog, *table.split("."), *suffix))


def current_snapshot(spark: SparkSession, catalog: str, table: str) -> int | None:
    """The snapshot the table's ``main`` branch points at now; None for a table never written."""
    rows = spark.sql(f"SELECT snapshot_id FROM {_name(catalog, table, 'refs')} WHERE name = 'main'")
    found = rows.collect()
    return int(found[0][0]) if found else None


def read_table(
    spark: SparkSession, catalog: str, table: str, snapshot_id: int | None = None
) -> DataFrame:
    """The table, at ``snapshot_id`` or else at its current snapshot when the query runs."""
    name = _name(catalog, table)
    if snapshot_id is None:
        return spark.table(name)
    return spark.sql(f"SELECT * FROM {name} VERSION AS OF {int(snapshot_id)}")


def table_summary(
    spark: SparkSession,
    catalog: str,
    table: str,
    *,
    checksums: bool = False,
    rows: bool = False,
) -> dict[str, Any]:
    """``{"table", "snapshot_id", "count"}`` (+ ``"checksums"``, ``"rows"``) of one snapshot."""
    from pyspark.sql import functions as F

    snapshot = current_snapshot(spark, catalog, table)
    df = read_table(spark, catalog, table, snapshot)
    aggregates = [F.count(F.lit(1)).alias("__count")]
    if checksums:
        # decimal: a sum of 64-bit hashes overflows a long, which ANSI mode refuses.
        aggregates += [
            F.sum(F.xxhash64(F.col(f"`{c}`")).cast("decimal(20,0)")).alias(c) for c in df.columns
        ]
    totals = df.agg(*aggregates).collect()[0].asDict()
    out: dict[str, Any] = {
        "table": table,
        "snapshot_id": snapshot,
        "count": int(totals.pop("__count")),
    }
    if checksums:
        out["checksums"] = {c: str(v if v is not None else 0) for c, v in totals.items()}
    if rows:
        as_json = F.to_json(
            F.struct(*[F.col(f"`{c}`") for c in df.columns]),
            {
                "ignoreNullFields": "false",
                "timeZone": "UTC",
                "timestampFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX",
            },
        )
        # In scan order (a sort would cost a shuffle). Decimals parsed as Decimal: exact, and
        # with their scale (12.50, not 12.5).
        out["rows"] = [json.loads(r[0], parse_float=Decimal) for r in df.select(as_json).collect()]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m twophase.jobs.read_iceberg", description=__doc__)
    ap.add_argument("--uri", required=True, help="the sink's catalog.uri (postgresql://...)")
    ap.add_argument("--catalog", required=True, help="the sink's catalog.name")
    ap.add_argument("--warehouse", required=True, help="the sink's catalog.warehouse")
    ap.add_argument("--table", required=True, action="append", help="namespace.table; repeatable")
    ap.add_argument("--schema", default=DEFAULT_SCHEMA, help="the sink's catalog.schema")
    ap.add_argument("--password-env", default="", help="a variable holding the password")
    ap.add_argument("--master", default="", help="e.g. spark://host:7077 (default: local[2])")
    ap.add_argument("--checksums", action="store_true")
    ap.add_argument("--rows", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    logging.getLogger("py4j").setLevel(logging.WARNING)
    from twophase.jobs.session import local_session

    password = os.environ.get(args.password_env) if args.password_env else None
    spark = local_session("twophase-read-iceberg", master=args.master or None)
    try:
        add_catalog(
            spark,
            args.catalog,
            args.uri,
            args.warehouse,
            schema=args.schema,
            password=password,
        )
        for table in args.table:
            summary = table_summary(
                spark, args.catalog, table, checksums=args.checksums, rows=args.rows
            )
            print(json.dumps(summary, sort_keys=True, default=str), flush=True)
    except Exception as exc:  # noqa: BLE001 - reported as the exit status, with the cause
        print(f"read failed: {exc}", file=sys.stderr)
        return 1
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
