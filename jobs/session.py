"""A local SparkSession for the jobs, the demo and the benchmark (tests use their own fixture)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["connector_jars", "local_session"]


def connector_jars() -> list[str]:
    """The Kafka connector jars and Iceberg's runtime with its JDBC driver, comma-separated in
    ``$TWOPHASE_SPARK_JARS`` (the local stack writes them into its ``stack.env``; the demo and
    the benchmark export them from there)."""
    jars = os.environ.get("TWOPHASE_SPARK_JARS", "")
    return [j for j in jars.split(",") if j]


def local_session(app_name: str, *, cores: int = 2, master: str | None = None) -> SparkSession:
    """``local[cores]`` with the Kafka connector, no UI, and small shuffles.

    The machine this runs on is small and shared: two shuffle partitions keep a stateful
    aggregation to two state stores, and the UI and the console progress bar are off.

    ``master`` (or else ``$TWOPHASE_SPARK_MASTER``), e.g. ``spark://host:7077``, runs the same
    session on a cluster: the tests run the jobs on a standalone cluster that way. Its executors
    start this interpreter (``PYSPARK_PYTHON``), so they must run where the same path imports
    twophase.
    """
    from pyspark.sql import SparkSession

    # Executors' Python workers must import twophase: run them on this interpreter (PySpark reads
    # only the environment variable, when the context is created).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    session = (
        SparkSession.builder.master(
            master or os.environ.get("TWOPHASE_SPARK_MASTER") or f"local[{cores}]"
        )
        .appName(app_name)
        .config("spark.jars", ",".join(connector_jars()))
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("WARN")
    return session
