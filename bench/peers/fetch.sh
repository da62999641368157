#!/usr/bin/env bash
# Fetches the jars of a benchmark peer with Maven (once; cached) and prints them on stdout. The
# benchmarks call it themselves (bench/spark_writer.py for its `delta` side, bench/flink_peer.py),
# so a peer always runs from the project's own descriptors.
#
#   bench/peers/fetch.sh delta      Delta Lake for Spark (bench/peers/delta/pom.xml): the jars,
#                                   comma-separated, for spark.jars
#   bench/peers/fetch.sh flink      Flink 2.0 + its JDBC and Kafka connectors, and the peer's job
#                                   compiled from bench/peers/flink/src (bench/peers/flink/pom.xml):
#                                   the classpath for `java -cp`, colon-separated
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
  delta | flink) ;;
  *) die "usage: $0 delta|flink" ;;
esac
pom=$PEERS_HERE/$peer/pom.xml
dest=$CACHE_DIR/jars/$peer
mvn_args=()

if [[ $peer == delta ]]; then
  # Delta releases are built for one Spark minor: 4.0.x for Spark 4.0. A pyspark pin moved to
  # another minor needs another delta.version in the pom, not a jar that fails at run time.
  spark_version=$(sed -n 's/^[^#]*"pyspark==\([^"]*\)".*/\1/p' "$REPO/pyproject.toml" | head -n1)
  delta_version=$(sed -n 's|^ *<delta.version>\([^<]*\)</delta.version>.*|\1|p' "$pom" | head -n1)
  [[ ${spark_version%.*} == "${delta_version%.*}" ]] ||
    die "pyspark==$spark_version is pinned but $pom has Delta $delta_version (Delta X.Y is built for Spark X.Y): change delta.version"
else
  # The job is compiled in the same Maven run, its jar written beside the dependencies (the pom
  # sends maven-jar-plugin to copy-dependencies' -DoutputDirectory). The sources' digest is
  # an argument so that fetch_jars' stamp, which covers the pom and the arguments, also
  # rebuilds when only the job changed; the classes go under the cache, not the source tree.
  command -v javac >/dev/null 2>&1 ||
    die "javac not found: the Flink peer's job is compiled here (Debian: apt-get install openjdk-17-jdk-headless)"
  src_sha=$(find "$PEERS_HERE/flink/src" -type f -print0 | sort -z | xargs -0 cat | sha1sum | cut -c1-12)
  mvn_args=(-Dpeer.sources="$src_sha" -Dpeer.build.dir="$CACHE_DIR/build/flink" package)
fi

mkdir -p "$CACHE_DIR/jars"
# One fetch at a time: the benchmark and the tests may ask at once.
exec 8>"$CACHE_DIR/jars/.$peer.lock"
flock 8
fetch_jars "$pom" "$dest" "${mvn_args[@]}" >&2
jars=("$dest"/*.jar)
[[ -f ${jars[0]} ]] || die "no jars in $dest"
if [[ $peer == flink ]]; then
  [[ -f $dest/peer-flink-0.jar ]] || die "the Flink peer's job jar is missing from $dest"
  IFS=:
else
  IFS=,
fi
printf '%s\n' "${jars[*]}"
