"""Root fixtures: where the local stack listens, and the helpers every service test needs.

The stack is started by ``make stack-up`` (``stack/stack.sh up``), which writes
``$TWOPHASE_STACK_DIR/stack.env``. A test that asks for a service fixture while the stack is
down FAILS with the command to run: a skipped service test would be a test that cannot fail.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shlex
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

REPO = Path(__file__).resolve().parents[1]

# Topic creation on the one-broker stack takes milliseconds; the margin covers a stack that
# is still loading its metadata right after `make stack-up` on a busy 2-core machine.
TOPIC_READY_TIMEOUT_S = 30.0

CreateTopic = Callable[..., str]


def stack_env_path() -> Path:
    stack_dir = os.environ.get("TWOPHASE_STACK_DIR") or str(REPO / ".stack")
    return Path(stack_dir) / "stack.env"


def read_stack_env(path: Path) -> dict[str, str]:
    """KEY='value' lines as written by stack.sh; shlex undoes the shell quoting."""
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        words = shlex.split(line)
        if len(words) == 1:
            key, _, value = words[0].partition("=")
            env[key] = value
    return env


def _stack_down(reason: str) -> NoReturn:
    pytest.fail(f"local stack is not up ({reason}): run `make stack-up`", pytrace=False)


def _require_listening(host_port: str, service: str) -> None:
    host, _, port = host_port.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            pass
    except OSError as exc:
        _stack_down(f"{service} does not answer on {host_port}: {exc}")


@pytest.fixture(scope="session")
def stack_env() -> dict[str, str]:
    path = stack_env_path()
    if not path.is_file():
        _stack_down(f"no {path}")
    return read_stack_env(path)


def _setting(env: dict[str, str], key: str) -> str:
    value = env.get(key)
    if not value:
        _stack_down(f"{key} missing from {stack_env_path()}")
    return value


@pytest.fixture(scope="session")
def kafka_bootstrap(stack_env: dict[str, str]) -> str:
    bootstrap = _setting(stack_env, "TWOPHASE_KAFKA_BOOTSTRAP")
    _require_listening(bootstrap.split(",")[0], "Kafka")
    return bootstrap


@pytest.fixture(scope="session")
def pg_dsn(stack_env: dict[str, str]) -> str:
    dsn = _setting(stack_env, "TWOPHASE_PG_DSN")
    parts = urlsplit(dsn)
    _require_listening(f"{parts.hostname}:{parts.port or 5432}", "PostgreSQL")
    return dsn


@pytest.fixture(scope="session")
def mongo_uri(stack_env: dict[str, str]) -> str:
    uri = _setting(stack_env, "TWOPHASE_MONGO_URI")
    parts = urlsplit(uri)
    _require_listening(f"{parts.hostname}:{parts.port or 27017}", "SecantusDB")
    _require_mongo_reaper(stack_env)
    return uri


_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.failed and report.when in ("setup", "call"):
        item.stash[_FAILED] = True
    return report


@pytest.fixture(autouse=True)
def _roll_back_what_a_failed_test_left_prepared(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that fails while one of its parts is prepared leaves the transaction in the
    shared PostgreSQL (its processes are gone, nobody decides it), and a prepared transaction
    anywhere in the server holds back every new logical replication slot: a later Debezium test
    would fail for this one. After a failed test (its own fixtures already torn down: autouse
    comes first, so it leaves last), roll back what its pipelines left prepared while it ran.
    Passing tests are left alone: what they leave is theirs to assert on.

    Of twophase parts (gid ``twophase:<sink>:<pipeline>~<txn>~<participant>``), only those of
    pipelines that are the test's own: none of the pipeline's sessions is connected (a test's
    processes are gone when it fails) and none of its committed markers predates the test
    (``harness.store_faults.pg_left_by_a_test``). A pipeline
    running beside the suite on the same server -- a chaos run, a demo -- is never touched:
    rolling back its prepared parts by name, as this fixture once did with everything prepared
    since the test began, lost a committed part of a chaos run sharing the stack."""
    started = datetime.datetime.now(datetime.UTC)
    yield
    if not request.node.stash.get(_FAILED, False):
        return
    path = stack_env_path()
    if not path.exists():
        return
    dsn = read_stack_env(path).get("TWOPHASE_PG_DSN")
    if not dsn:
        return
    import psycopg  # late: most tests never get here
    from psycopg import sql

    from harness.store_faults import pg_left_by_a_test

    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
            gids = pg_left_by_a_test(conn, started)
            for gid in gids:
                with contextlib.suppress(psycopg.Error):  # decided meanwhile
                    conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
    except psycopg.Error as exc:
        print(f"could not roll back what {request.node.nodeid} left prepared: {exc}")
        return
    if gids:
        print(f"rolled back {len(gids)} transaction(s) {request.node.nodeid} left prepared")


def _require_mongo_reaper(env: dict[str, str]) -> None:
    """Without the stack's reaper a test that kills a process inside a MongoDB transaction
    stalls for minutes instead of failing (stack/README.md): say so at once."""
    pid_file = Path(env.get("TWOPHASE_STACK_DIR", "")) / "run" / "mongo-reaper.pid"
    try:
        pid = pid_file.read_text().split()[0]
        alive = "mongo_reaper.py" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    except (OSError, IndexError):
        alive = False
    if not alive:
        _stack_down("the MongoDB transaction reaper is not running")


@pytest.fixture(scope="session")
def schema_registry_url(stack_env: dict[str, str]) -> str:
    """Apicurio Registry's Confluent-compatible API (``.../apis/ccompat/v7``): the URL for
    ``confluent_kafka.schema_registry.SchemaRegistryClient``."""
    url = _setting(stack_env, "TWOPHASE_SCHEMA_REGISTRY_URL")
    parts = urlsplit(url)
    _require_listening(f"{parts.hostname}:{parts.port or 80}", "the schema registry")
    return url


@pytest.fixture(scope="session")
def connect_url() -> str:
    """The stack's Kafka Connect worker (``make stack-up`` with ``TWOPHASE_STACK_CONNECT=1``,
    or ``bash stack/connect.sh up``); fails, never skips, when it is down."""
    from harness import debezium

    try:
        return debezium.connect_url()
    except debezium.ConnectDown as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def spark_jars(stack_env: dict[str, str]) -> list[str]:
    """The Spark Kafka connector and what it needs beyond pyspark, for ``spark.jars``."""
    jars = _setting(stack_env, "TWOPHASE_SPARK_JARS").split(",")
    missing = [jar for jar in jars if not Path(jar).is_file()]
    if missing:
        _stack_down(f"Spark connector jars missing: {missing}")
    return jars


@pytest.fixture
def recorded_sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every ``time.sleep`` the test's own thread asks for, recorded instead of slept.

    Only the test's thread: ``time.sleep`` is one function for the whole process, and the
    suite's process keeps threads that outlive their tests (py4j's finalizer of the session's
    Spark gateway, pymongo's monitors) and sleep in loops. Replaced for every thread, each of
    those loops spins and fills the list -- 20 GB within one test before this fixture, and the
    kernel killed the suite. tests/unit/test_suite_rules.py keeps any other test from
    replacing a ``time`` function for the whole process.
    """
    asked: list[float] = []
    real_sleep = time.sleep
    mine = threading.get_ident()

    def sleep(seconds: float) -> None:
        if threading.get_ident() == mine:
            asked.append(seconds)
        else:
            real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    return asked


@pytest.fixture
def unique_name() -> str:
    """``t_<8 hex>``: valid as a topic, group, PostgreSQL table and MongoDB database name,
    so tests sharing one stack (and reruns) never collide."""
    return f"t_{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def kafka_admin(kafka_bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": kafka_bootstrap})


@pytest.fixture
def create_topic(kafka_admin: AdminClient) -> Iterator[CreateTopic]:
    """``create_topic(name, partitions=1, config=None) -> name``; returns once every
    partition has a leader. Topics are deleted after the test so long runs do not pile up
    partitions on the single broker."""
    created: list[str] = []

    def create(name: str, partitions: int = 1, config: dict[str, str] | None = None) -> str:
        topic = NewTopic(name, num_partitions=partitions, replication_factor=1, config=config or {})
        kafka_admin.create_topics([topic], operation_timeout=TOPIC_READY_TIMEOUT_S)[name].result()
        created.append(name)
        deadline = time.monotonic() + TOPIC_READY_TIMEOUT_S
        while True:
            meta = kafka_admin.list_topics(name, timeout=TOPIC_READY_TIMEOUT_S).topics.get(name)
            if (
                meta is not None
                and meta.error is None
                and len(meta.partitions) == partitions
                and all(p.leader >= 0 for p in meta.partitions.values())
            ):
                return name
            if time.monotonic() > deadline:
                raise TimeoutError(f"topic {name} has no leader for every partition")
            time.sleep(0.1)

    yield create
    if created:
        for future in kafka_admin.delete_topics(created, operation_timeout=30).values():
            # Best effort: a leftover topic on a test stack is harmless.
            with contextlib.suppress(KafkaException):
                future.result()


@pytest.fixture(scope="session")
def spark(spark_jars: list[str]) -> Iterator[Any]:
    """One local[2] SparkSession per test process with the Kafka connector on its classpath.

    Shared because a JVM holds one SparkContext: a second session built elsewhere with
    ``getOrCreate()`` would silently get this one, without its own ``spark.jars``.
    """
    from pyspark.sql import SparkSession  # Imported late: ~2 s, and only Spark tests pay it.

    # Executors' Python workers must import twophase: run them on this interpreter (the venv).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    session = (
        SparkSession.builder.master("local[2]")
        .appName("twophase-tests")
        .config("spark.jars", ",".join(spark_jars))
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("WARN")
    yield session
    session.stop()
