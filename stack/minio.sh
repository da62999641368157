#!/usr/bin/env bash
# Builds a pinned MinIO server from the Go module proxy into
# $TWOPHASE_CACHE_DIR/minio/<version>/minio: the local stack's S3 (stack.sh starts it).
# No release download: the Go module proxy is the one source we can rely on being reachable
# (and checksummed through sum.golang.org) on CI and dev machines, as for stack/helm.sh.
# MinIO is AGPLv3: it runs unmodified, as a separate test service, and is never linked into or
# shipped with twophase.
# Idempotent: when the binary exists and reports the pinned build, it only prints it.
set -euo pipefail

# Pinned. MinIO tags releases RELEASE.<date>, which is not semver, so the proxy serves its
# commits as pseudo-versions only; this is master of 2026-02-12 (`@latest` in November 2026).
MINIO_VERSION="v0.0.0-20260212201848-7aac2a2c5b7c"

cache_dir="${TWOPHASE_CACHE_DIR:-${HOME:-/root}/.cache/twophase}"
bin_dir="$cache_dir/minio/$MINIO_VERSION"
minio_bin="$bin_dir/minio"

# What MinIO's own Makefile stamps into a build from source (buildscripts/gen-ldflags.go):
# Version = the commit's time, ReleaseTag = DEVELOPMENT.<that time>, the commit id. Without
# them the binary says DEVELOPMENT.GOGET and the check below could not tell builds apart.
pseudo='^v0\.0\.0-([0-9]{4})([0-9]{2})([0-9]{2})([0-9]{2})([0-9]{2})([0-9]{2})-([0-9a-f]{12})$'
if [[ ! $MINIO_VERSION =~ $pseudo ]]; then
  echo "stack/minio.sh: MINIO_VERSION=$MINIO_VERSION is not a Go pseudo-version" >&2
  exit 1
fi
m=("${BASH_REMATCH[@]}")
commit_time="${m[1]}-${m[2]}-${m[3]}T${m[4]}:${m[5]}:${m[6]}Z"
release_tag="DEVELOPMENT.${m[1]}-${m[2]}-${m[3]}T${m[4]}-${m[5]}-${m[6]}Z"
commit_id="${m[7]}"
expected="minio version $release_tag (commit-id=$commit_id)"

installed_version() {
  "$minio_bin" --version 2>/dev/null | head -n1 || true
}

if [[ -x "$minio_bin" && "$(installed_version)" == "$expected" ]]; then
  echo "minio $MINIO_VERSION at $minio_bin"
  exit 0
fi

if ! command -v go >/dev/null 2>&1; then
  echo "stack/minio.sh: 'go' is not on PATH; install Go >= 1.24 to build MinIO $MINIO_VERSION" >&2
  exit 1
fi

mkdir -p "$bin_dir"
# Several stacks on one machine share the cache: one build at a time, and the one that waited
# finds the binary made.
exec 8>"$cache_dir/minio/.build.lock"
flock 8
if [[ -x "$minio_bin" && "$(installed_version)" == "$expected" ]]; then
  echo "minio $MINIO_VERSION at $minio_bin"
  exit 0
fi

# Module and build caches shared with stack/helm.sh, under the cache dir.
export GOPATH="$cache_dir/go"
export GOMODCACHE="$cache_dir/go/pkg/mod"
export GOCACHE="$cache_dir/go-build"
export GOBIN="$bin_dir"
export CGO_ENABLED=0
export GOFLAGS="-buildvcs=false -modcacherw"
ldflags="-s -w"
ldflags+=" -X github.com/minio/minio/cmd.Version=$commit_time"
ldflags+=" -X github.com/minio/minio/cmd.CopyrightYear=${m[1]}"
ldflags+=" -X github.com/minio/minio/cmd.ReleaseTag=$release_tag"
ldflags+=" -X github.com/minio/minio/cmd.CommitID=$commit_id"
ldflags+=" -X github.com/minio/minio/cmd.ShortCommitID=$commit_id"

echo "building minio $MINIO_VERSION from the Go module proxy (~6 min on 2 cores, cold cache)..." >&2
start=$SECONDS
# nice: the build takes both cores for minutes, next to services and tests that time out.
# -tags kqueue -trimpath: as MinIO's Makefile builds (kqueue matters on BSD/macOS only).
nice -n 10 go install -tags kqueue -trimpath -ldflags "$ldflags" "github.com/minio/minio@$MINIO_VERSION"
echo "built minio in $((SECONDS - start))s" >&2

got="$(installed_version)"
if [[ "$got" != "$expected" ]]; then
  echo "stack/minio.sh: built minio reports '$got', expected '$expected'" >&2
  exit 1
fi
echo "minio $MINIO_VERSION at $minio_bin"
