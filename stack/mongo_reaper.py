"""The local stack's stand-in for mongod's background reaper of abandoned transactions.

mongod aborts a transaction that has been idle for ``transactionLifetimeLimitSeconds`` (60 s)
from a background thread, so a client killed with -9 in the middle of a transaction holds its
locks for at most a minute. SecantusDB (the stack's MongoDB-protocol test server) applies the
same lifetime, but only when a transaction statement reaches its transaction registry: a plain
write that meets the dead transaction's uncommitted write retries its write conflict without
ever getting there, so once every live writer waits like that the store stalls for good.

This process sends an empty transaction every ``TWOPHASE_MONGO_REAP_INTERVAL_S`` seconds
(default 5), which makes SecantusDB run its check: a dead client's transaction is aborted
between ``lifetime`` and ``lifetime + interval`` seconds after its last statement. The lifetime
itself is SecantusDB's (``TWOPHASE_MONGO_TXN_LIFETIME_S``, applied by ``stack/secantusd.py``).

``stack/stack.sh`` starts it with SecantusDB's own venv (pymongo comes with SecantusDB) and
stops it with SIGTERM. Twophase itself never needs it: a real MongoDB reaps by itself.

    python stack/mongo_reaper.py MONGO_URI
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

from pymongo import MongoClient
from pymongo.errors import PyMongoError

log = logging.getLogger("mongo-reaper")

# Often enough that a dead client's locks outlive the lifetime by a few seconds at most, rarely
# enough that the empty transactions cost SecantusDB nothing measurable.
DEFAULT_INTERVAL_S = 5.0


def interval_from_env() -> float:
    raw = os.environ.get("TWOPHASE_MONGO_REAP_INTERVAL_S", str(DEFAULT_INTERVAL_S))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.1 <= value <= 600:
        raise SystemExit(
            f"mongo-reaper: TWOPHASE_MONGO_REAP_INTERVAL_S={raw!r}: want seconds in [0.1, 600]"
        )
    return value


def run(uri: str, interval_s: float, stop: threading.Event) -> None:
    client: MongoClient[dict[str, Any]] = MongoClient(
        uri, serverSelectionTimeoutMS=3000, socketTimeoutMS=10_000, appname="stack-mongo-reaper"
    )
    lifetime = os.environ.get("TWOPHASE_MONGO_TXN_LIFETIME_S", "60")
    log.info(
        "started: an empty transaction every %ss on %s makes SecantusDB abort transactions "
        "idle for more than %ss",
        interval_s,
        uri,
        lifetime,
    )
    reachable = True
    while not stop.wait(interval_s):
        try:
            with client.start_session() as session, session.start_transaction():
                client["twophase_stack_reaper"]["nudge"].find_one({}, session=session)
        except PyMongoError as exc:
            # The store restarting, say: say so once, and once when it answers again.
            if reachable:
                log.warning("SecantusDB not answering (%s); retrying every %ss", exc, interval_s)
            reachable = False
            continue
        if not reachable:
            log.info("SecantusDB answers again")
        reachable = True
    client.close()
    log.info("stopped")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    run(argv[0], interval_from_env(), stop)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
