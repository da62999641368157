"""The stack's MongoDB aborts a dead client's transaction, as mongod does (stack/mongo_reaper.py).

A client killed with -9 while its transaction holds a document must not stall the writers that
meet that document for longer than the transaction lifetime (mongod: 60 s) plus the reaper's
interval. Without the reaper, SecantusDB retries the writer's conflict for as long as the writer
waits (minutes), which stalled `make demo`.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest
from pymongo import MongoClient

from tests.conftest import REPO

pytestmark = pytest.mark.stack

# A holder that writes a document inside a transaction, says so, and waits to be killed.
HOLDER = textwrap.dedent(
    """
    import sys, time
    from pymongo import MongoClient
    client = MongoClient(sys.argv[1])
    coll = client[sys.argv[2]]["docs"]
    session = client.start_session()
    session.start_transaction()
    coll.update_one({"_id": 1}, {"$set": {"by": "dead client"}}, session=session)
    print("holding", flush=True)
    time.sleep(3600)
    """
)

# Slack over lifetime + reap interval for a shared, busy 2-core machine.
SLACK_S = 45.0


def test_stack_status_shows_the_reaper() -> None:
    out = subprocess.run(
        ["bash", str(REPO / "stack" / "stack.sh"), "status"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(line for line in out.splitlines() if line.startswith("reaper"))
    assert " up " in line and "mongo-reaper.log" in line, out


def test_a_killed_clients_transaction_is_aborted_after_its_lifetime(
    mongo_uri: str, unique_name: str, stack_env: dict[str, str]
) -> None:
    lifetime = float(stack_env.get("TWOPHASE_MONGO_TXN_LIFETIME_S", "60"))
    db = f"reaper_{unique_name}".replace("-", "_")[:60]
    client: MongoClient[dict[str, object]] = MongoClient(mongo_uri, socketTimeoutMS=600_000)
    coll = client[db]["docs"]
    coll.insert_one({"_id": 1, "by": "nobody"})
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, mongo_uri, db], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "holding"
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
        killed = time.monotonic()
        # A plain write meeting the dead transaction's write: it blocks until that is aborted.
        coll.update_one({"_id": 1}, {"$set": {"by": "live client"}})
        waited = time.monotonic() - killed
        assert coll.find_one({"_id": 1}) == {"_id": 1, "by": "live client"}
    finally:
        if holder.poll() is None:
            holder.kill()
        client.drop_database(db)
        client.close()
    assert waited < lifetime + 5 + SLACK_S, f"the write waited {waited:.0f}s"
