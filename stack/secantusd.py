"""Starts SecantusDB (``secantusd-py``) with a transaction lifetime of our choosing.

SecantusDB 0.7's daemon has no flag for its transaction lifetime (mongod's
``transactionLifetimeLimitSeconds``) and always uses 60 s. The stack makes it settable through
``TWOPHASE_MONGO_TXN_LIFETIME_S`` so a test can ask for what a mongod deployment can configure;
the default stays mongod's 60 s. Run with SecantusDB's venv; every other argument goes to the
daemon unchanged.
"""

from __future__ import annotations

import functools
import os
import sys

from secantus import cli
from secantus.server import SecantusDBServer


def main() -> int:
    raw = os.environ.get("TWOPHASE_MONGO_TXN_LIFETIME_S", "60")
    try:
        lifetime = float(raw)
    except ValueError:
        lifetime = 0.0
    if lifetime <= 0:
        print(
            f"secantusd: TWOPHASE_MONGO_TXN_LIFETIME_S={raw!r}: want seconds > 0", file=sys.stderr
        )
        return 2
    # cli.main builds its server through this module-level name (SecantusDB 0.7, pinned in
    # stack.sh); a version that does not would silently ignore the lifetime, so refuse it.
    if getattr(cli, "SecantusDBServer", None) is not SecantusDBServer:
        print("secantusd: this SecantusDB cannot be given a transaction lifetime", file=sys.stderr)
        return 2
    cli.SecantusDBServer = functools.partial(  # type: ignore[misc]
        SecantusDBServer, transaction_lifetime_seconds=lifetime
    )
    return cli.main()


if __name__ == "__main__":
    sys.exit(main())
