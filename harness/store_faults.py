"""Store faults under a running pipeline, for the end-to-end tests and ``chaos.run``.

* PostgreSQL: the pipeline's sessions (the PostgreSQL sink names them
  ``twophase/<pipeline>/<sink>/<participant>`` in ``application_name``), its prepared
  transactions (gid ``twophase:<sink>:<pipeline>~<txn>~<participant>``), ending sessions with
  ``pg_terminate_backend``, and a server filled to ``max_connections``.
* A full disk: a tmpfs of its own under the files sink, made full by shrinking it to what it
  holds (``mount -o remount,size=``) and given room again the same way. Needs root and
  ``mount -t tmpfs``; where that is refused :class:`TmpfsRefused` says so.
"""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path
from typing import Any

import psycopg

from twophase.participants.sdk import PartId

__all__ = [
    "FILLER_APP",
    "TOO_MANY",
    "Tmpfs",
    "TmpfsRefused",
    "fill_connections",
    "pg_left_by_a_test",
    "pg_prepared",
    "pg_sessions",
    "terminate",
]

#: What PostgreSQL answers a connection past max_connections (SQLSTATE 53300).
TOO_MANY = "too many clients"
#: The ``application_name`` of a filler connection.
FILLER_APP = "twophase-fault-filler"


def pg_sessions(
    conn: psycopg.Connection[Any],
    pipeline: str,
    participant: str | None = None,
    sink: str = "pg",
    state: str | None = None,
) -> list[int]:
    """Backend pids of the pipeline's sessions of ``sink`` (of ``participant``, in ``state``
    -- e.g. ``idle in transaction``: an open part between two writes -- when given)."""
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s"
        " AND (%s::text IS NULL OR state = %s)",
        (f"twophase/{pipeline}/{sink}/{participant or '%'}", state, state),
    ).fetchall()
    return [int(r[0]) for r in rows]


def pg_prepared(
    conn: psycopg.Connection[Any], pipeline: str, participant: str | None = None, sink: str = "pg"
) -> list[str]:
    """Gids of the pipeline's prepared transactions in ``sink`` (of ``participant``), in order."""
    rows = conn.execute(
        "SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s ORDER BY gid",
        (f"twophase:{sink}:{pipeline}~%~{participant or '%'}",),
    ).fetchall()
    return [r[0] for r in rows]


def pg_left_by_a_test(conn: psycopg.Connection[Any], started: datetime.datetime) -> list[str]:
    """Gids prepared since ``started`` that are a test's own, which the test suite rolls back
    after a failed test (``tests/conftest.py``): twophase parts of pipelines with no connected
    session and no marker committed before ``started``, and any other gid prepared meanwhile (a
    smoke test's, the Flink peer's XA transactions: nothing runs those beside a test)."""
    rows = conn.execute(
        "SELECT gid FROM pg_prepared_xacts WHERE prepared >= %s", (started,)
    ).fetchall()
    by_pipeline: dict[str, list[str]] = {}
    mine: list[str] = []
    for (gid,) in rows:
        if not str(gid).startswith("twophase:"):
            mine.append(str(gid))
            continue
        try:  # twophase:<sink>:<part token>, as the PostgreSQL sink names them
            pipeline = PartId.parse(str(gid).split(":", 2)[2]).pipeline
        except (IndexError, ValueError):
            mine.append(str(gid))  # not a part's: as any other gid prepared during the test
            continue
        by_pipeline.setdefault(pipeline, []).append(str(gid))

    def one(query: str, args: tuple[Any, ...] = ()) -> Any:
        row = conn.execute(query, args).fetchone()
        return row[0] if row else None

    has_markers = one("SELECT to_regclass('twophase_parts') IS NOT NULL")
    for pipeline, gids in sorted(by_pipeline.items()):
        live = one(
            "SELECT count(*) FROM pg_stat_activity WHERE starts_with(application_name, %s)",
            (f"twophase/{pipeline}/",),
        )
        older = has_markers and one(
            "SELECT count(*) FROM (SELECT 1 FROM twophase_parts WHERE pipeline = %s"
            " AND pg_xact_commit_timestamp(xmin) < %s LIMIT 1) t",
            (pipeline, started),
        )
        # A pipeline with live sessions, or one that committed before the test began (a chaos
        # run between two kills), is not the test's: its parts are its own to decide.
        if not live and not older:
            mine += gids
    return sorted(mine)


def terminate(conn: psycopg.Connection[Any], pids: list[int]) -> int:
    """``pg_terminate_backend`` each pid; how many were signalled."""
    done = 0
    for pid in pids:
        row = conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()
        done += bool(row and row[0])
    return done


def fill_connections(dsn: str, limit: int) -> tuple[list[psycopg.Connection[Any]], str]:
    """Connections as ``dsn``'s user until PostgreSQL refuses one: the connections and the
    refusal. As a superuser this takes the reserved slots too."""
    conns: list[psycopg.Connection[Any]] = []
    for _ in range(limit + 10):
        try:
            conns.append(psycopg.connect(dsn, autocommit=True, application_name=FILLER_APP))
        except psycopg.OperationalError as exc:
            return conns, str(exc)
    for c in conns:
        c.close()
    raise AssertionError(f"PostgreSQL took {len(conns)} connections, more than max_connections")


class TmpfsRefused(RuntimeError):
    """``mount -t tmpfs`` was refused (not root, no mount namespace)."""


class Tmpfs:
    """A tmpfs mounted at ``path`` (which must be empty), resizable while in use."""

    def __init__(self, path: Path, size_bytes: int) -> None:
        self.path = path
        self.size = size_bytes
        path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0755", "tmpfs", str(path)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0 or not os.path.ismount(path):
            raise TmpfsRefused(
                f"cannot mount a tmpfs at {path} (rc {done.returncode}: {done.stderr.strip()}): "
                "a full disk needs root and `mount -t tmpfs`"
            )

    def used(self) -> int:
        st = os.statvfs(self.path)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def resize(self, size_bytes: int) -> None:
        """Set the size; shrinking below what it holds is refused by the kernel (EINVAL)."""
        done = subprocess.run(
            ["mount", "-o", f"remount,size={size_bytes}", str(self.path)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise OSError(f"remount {self.path} size={size_bytes}: {done.stderr.strip()}")
        self.size = size_bytes

    def fill(self, leave: int, tries: int = 20) -> int:
        """Shrink to what it holds plus about ``leave`` bytes (the writers fill the rest);
        the new size. Retries when a writer grew it between the measure and the remount."""
        page = os.sysconf("SC_PAGE_SIZE")
        last: OSError | None = None
        for _ in range(tries):
            target = (self.used() + leave + page - 1) // page * page
            try:
                self.resize(target)
                return target
            except OSError as exc:
                last = exc
        raise OSError(f"could not shrink {self.path} to what it holds: {last}")

    def unmount(self) -> None:
        if not os.path.ismount(self.path):
            return
        if subprocess.run(["umount", str(self.path)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(self.path)], check=False)  # a straggler
