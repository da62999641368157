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

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
CACHE_DIR=$(realpath -m "${TWOPHASE_CACHE_DIR:-${HOME:-/root}/.cache/twophase}")
M2=$CACHE_DIR/m2

log() { printf 'peers: %s\n' "$*" >&2; }
die() { printf 'peers: error: %s\n' "$*" >&2; exit 1; }

peer=${1:-}
case $peer in
  delta) ;;
  *) die "usage: $0 delta" ;;
esac
pom=$HERE/$peer/pom.xml
dest=$CACHE_DIR/jars/$peer

# Delta releases are built for one Spark minor: 4.0.x for Spark 4.0. A pyspark pin moved to
# another minor needs another delta.version in the pom, not a jar that fails at run time.
spark_version=$(sed -n 's/^[^#]*"pyspark==\([^"]*\)".*/\1/p' "$REPO/pyproject.toml" | head -n1)
delta_version=$(sed -n 's|^ *<delta.version>\([^<]*\)</delta.version>.*|\1|p' "$pom" | head -n1)
[[ ${spark_version%.*} == "${delta_version%.*}" ]] ||
  die "pyspark==$spark_version is pinned but $pom has Delta $delta_version (Delta X.Y is built for Spark X.Y): change delta.version"

list() {
  local jars=("$dest"/*.jar)
  [[ -f ${jars[0]} ]] || die "no jars in $dest"
  local IFS=,
  printf '%s\n' "${jars[*]}"
}

# The stamp names the pom's content: an edited pom fetches again.
stamp="$dest/.complete-$(sha1sum <"$pom" | cut -c1-12)"
if [[ -f $stamp ]]; then
  list
  exit 0
fi

command -v mvn >/dev/null 2>&1 || die "mvn not found: Maven fetches the $peer jars (Debian: apt-get install maven)"
mkdir -p "$CACHE_DIR/jars"
# One fetch at a time: the benchmark and the tests may ask at once.
exec 9>"$CACHE_DIR/jars/.$peer.lock"
flock 9
if [[ ! -f $stamp ]]; then
  log "fetching $peer jars with Maven into $dest (first run only)"
  tmp="$dest.tmp.$$"
  mvn_log="$CACHE_DIR/jars/$peer-maven.log"
  rm -rf "$tmp"
  if ! mvn -B -Dstyle.color=never -f "$pom" -Dmaven.repo.local="$M2" \
      dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$tmp" >"$mvn_log" 2>&1; then
    rm -rf "$tmp"
    grep -E '^\[ERROR\]' "$mvn_log" | head -n 5 >&2 || true
    die "Maven could not fetch the jars for $pom (full output: $mvn_log)"
  fi
  rm -rf "$dest"
  mv "$tmp" "$dest"
  touch "$stamp"
fi
list
