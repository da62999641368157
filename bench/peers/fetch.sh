#!/usr/bin/env bash
# Fetches the jars of a benchmark peer with Maven (once; cached) and prints them on stdout,
# comma-separated, for spark.jars. The benchmarks call it themselves (bench/spark_writer.py for
# its `delta` side), so a peer always runs from the project's own descriptors.
#
#   bench/peers/fetch.sh delta      Delta Lake for Spark (bench/peers/delta/pom.xml)
#
# Environment (optional):
#   TWOPHASE_CACHE_DIR   maven repo and jars (default ~/.cache/twophase, shared with stack/stack.sh)
set -euo pipefail

PEERS_HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$PEERS_HERE/../.." && pwd)
# stack.sh's helpers and its Maven fetch (fetch_jars: cached, refetched when the pom changes),
# as stack/connect.sh uses them; sourcing it runs no command.
# shellcheck source=stack/stack.sh
source "$REPO/stack/stack.sh"

peer=${1:-}
case $peer in
  delta) ;;
  *) die "usage: $0 delta" ;;
esac
pom=$PEERS_HERE/$peer/pom.xml
dest=$CACHE_DIR/jars/$peer

# Delta releases are built for one Spark minor: 4.0.x for Spark 4.0. A pyspark pin moved to
# another minor needs another delta.version in the pom, not a jar that fails at run time.
spark_version=$(sed -n 's/^[^#]*"pyspark==\([^"]*\)".*/\1/p' "$REPO/pyproject.toml" | head -n1)
delta_version=$(sed -n 's|^ *<delta.version>\([^<]*\)</delta.version>.*|\1|p' "$pom" | head -n1)
[[ ${spark_version%.*} == "${delta_version%.*}" ]] ||
  die "pyspark==$spark_version is pinned but $pom has Delta $delta_version (Delta X.Y is built for Spark X.Y): change delta.version"

mkdir -p "$CACHE_DIR/jars"
# One fetch at a time: the benchmark and the tests may ask at once.
exec 8>"$CACHE_DIR/jars/.$peer.lock"
flock 8
fetch_jars "$pom" "$dest" >&2
jars=("$dest"/*.jar)
[[ -f ${jars[0]} ]] || die "no jars in $dest"
IFS=,
printf '%s\n' "${jars[*]}"
