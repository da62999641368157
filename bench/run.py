"""``make bench``: the benchmark suite (pipeline throughput, the COPY ceiling, MongoDB, commit
latency by participant count, Spark) is not built yet. Until it is, this says so and fails,
rather than printing figures nobody measured. The Spark writer comparison exists already:
``python -m bench.spark_writer``."""

from __future__ import annotations

import sys


def main() -> int:
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
