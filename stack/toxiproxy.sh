#!/usr/bin/env bash
# Toxiproxy (network faults for `make chaos`), built from the Go module proxy like helm.sh.
#
#   bash stack/toxiproxy.sh               build (once) into $TWOPHASE_CACHE_DIR/bin, print the path
#   bash stack/toxiproxy.sh start PORT DIR   start the API on 127.0.0.1:PORT (pid, log in DIR)
#   bash stack/toxiproxy.sh stop DIR         stop the one started with that DIR
#
# No release tarball download: the Go module proxy is the one source we can rely on being
# reachable (and checksummed through sum.golang.org) on CI and dev machines. Idempotent: when the
# binary exists and reports the pinned version, building only prints its path.
set -euo pipefail

# Pinned: chaos/run.py and harness/toxiproxy.py speak this version's HTTP API.
TOXIPROXY_VERSION="v2.5.0"

cache_dir="${TWOPHASE_CACHE_DIR:-${HOME:-/root}/.cache/twophase}"
bin_dir="$cache_dir/bin"
toxiproxy_bin="$bin_dir/toxiproxy-server"

installed_version() {
  # Prints "toxiproxy-server version v2.5.0" (the version comes from the ldflags below).
  "$toxiproxy_bin" -version 2>/dev/null | awk '{print $NF}' || true
}

build() {
  if [[ -x "$toxiproxy_bin" && "$(installed_version)" == "$TOXIPROXY_VERSION" ]]; then
    return 0
  fi
  if ! command -v go >/dev/null 2>&1; then
    echo "stack/toxiproxy.sh: 'go' is not on PATH; install Go to build toxiproxy $TOXIPROXY_VERSION" >&2
    exit 1
  fi
  mkdir -p "$bin_dir"
  # Module and build caches under the cache dir, shared with helm.sh's: a warm CI cache makes
  # the rebuild cheap and nothing is written outside it.
  local gobin
  gobin="$(mktemp -d "$cache_dir/toxiproxy-build.XXXXXX")"
  export GOPATH="$cache_dir/go"
  export GOMODCACHE="$cache_dir/go/pkg/mod"
  export GOCACHE="$cache_dir/go-build"
  export GOBIN="$gobin"
  export CGO_ENABLED=0
  export GOFLAGS="-buildvcs=false -modcacherw"
  echo "building toxiproxy $TOXIPROXY_VERSION from the Go module proxy..." >&2
  local start=$SECONDS
  # Without the version in the ldflags `-version` says "git" and the check above would rebuild
  # every time.
  go install -ldflags "-s -w -X github.com/Shopify/toxiproxy/v2.Version=$TOXIPROXY_VERSION" \
    "github.com/Shopify/toxiproxy/v2/cmd/server@$TOXIPROXY_VERSION"
  # The module's command is named `server`; installed under the name everyone knows.
  mv -f "$gobin/server" "$toxiproxy_bin"
  rm -rf "$gobin"
  echo "built toxiproxy in $((SECONDS - start))s" >&2
  local got
  got="$(installed_version)"
  if [[ "$got" != "$TOXIPROXY_VERSION" ]]; then
    echo "stack/toxiproxy.sh: built toxiproxy reports version '$got', expected $TOXIPROXY_VERSION" >&2
    exit 1
  fi
}

live_pid() {
  local pid_file="$1/toxiproxy.pid" pid
  [[ -f "$pid_file" ]] || return 1
  pid="$(cat "$pid_file")"
  # The pid must still be our server, not a recycled number.
  [[ -n "$pid" ]] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "toxiproxy-server" \
    && echo "$pid"
}

start() {
  local port="$1" dir="$2" pid
  build
  mkdir -p "$dir"
  if pid="$(live_pid "$dir")"; then
    echo "toxiproxy already running (pid $pid)"
    return 0
  fi
  # setsid: the server is not in the caller's process group, so a Ctrl-C of the caller does not
  # take it down before the caller has restored every proxy; the caller stops it with `stop`.
  setsid "$toxiproxy_bin" -host 127.0.0.1 -port "$port" >>"$dir/toxiproxy.log" 2>&1 </dev/null &
  echo $! >"$dir/toxiproxy.pid"
  for _ in $(seq 1 100); do
    if curl -fsS "http://127.0.0.1:$port/version" >/dev/null 2>&1; then
      echo "toxiproxy $TOXIPROXY_VERSION on 127.0.0.1:$port (pid $(cat "$dir/toxiproxy.pid"))"
      return 0
    fi
    if ! live_pid "$dir" >/dev/null; then
      echo "stack/toxiproxy.sh: toxiproxy exited at start-up:" >&2
      tail -n 20 "$dir/toxiproxy.log" >&2
      exit 1
    fi
    sleep 0.1
  done
  echo "stack/toxiproxy.sh: toxiproxy did not answer on 127.0.0.1:$port within 10 s" >&2
  exit 1
}

stop() {
  local dir="$1" pid
  if pid="$(live_pid "$dir")"; then
    kill "$pid"
    for _ in $(seq 1 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
    echo "toxiproxy stopped (pid $pid)"
  fi
  rm -f "$dir/toxiproxy.pid"
}

case "${1:-build}" in
  build)
    build
    echo "$toxiproxy_bin"
    ;;
  start) start "${2:?port}" "${3:?dir}" ;;
  stop) stop "${2:?dir}" ;;
  *)
    echo "usage: $0 [build | start PORT DIR | stop DIR]" >&2
    exit 2
    ;;
esac
