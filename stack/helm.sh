#!/usr/bin/env bash
# Builds a pinned helm from the Go module proxy into $TWOPHASE_CACHE_DIR/bin.
# No release tarball download: the Go module proxy is the one source we can rely on
# being reachable (and checksummed through sum.golang.org) on CI and dev machines.
# Idempotent: when the binary exists and reports the pinned version, it only prints it.
set -euo pipefail

# Pinned: the chart tests assert behaviour of this exact helm (schema error wording, lint).
HELM_VERSION="v3.21.4"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache_dir="${TWOPHASE_CACHE_DIR:-${HOME:-/root}/.cache/twophase}"
bin_dir="$cache_dir/bin"
helm_bin="$bin_dir/helm"

installed_version() {
  "$helm_bin" version --template '{{.Version}}' 2>/dev/null || true
}

if [[ -x "$helm_bin" && "$(installed_version)" == "$HELM_VERSION" ]]; then
  echo "helm $HELM_VERSION at $helm_bin"
  exit 0
fi

if ! command -v go >/dev/null 2>&1; then
  echo "stack/helm.sh: 'go' is not on PATH; install Go >= 1.26 to build helm $HELM_VERSION" >&2
  exit 1
fi

mkdir -p "$bin_dir"
# Module and build caches live under the cache dir so a warm CI cache makes rebuilds cheap
# and nothing is written outside the repo's cache.
export GOPATH="$cache_dir/go"
export GOMODCACHE="$cache_dir/go/pkg/mod"
export GOCACHE="$cache_dir/go-build"
export GOBIN="$bin_dir"
export CGO_ENABLED=0
export GOFLAGS="-buildvcs=false -modcacherw"
# Same ldflags as helm's own release Makefile. Without the version, `helm version` says "v3.21"
# and the check above would rebuild every time; without the Kubernetes version, the default
# .Capabilities.KubeVersion of `helm template` would be v1.20 instead of the client-go
# version this helm release is built against (k8s.io/client-go v0.36 -> Kubernetes 1.36).
HELM_K8S_MINOR="36"
ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
ldflags+=" -X helm.sh/helm/v3/internal/version.metadata="
for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
  ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$HELM_K8S_MINOR"
done

echo "building helm $HELM_VERSION from the Go module proxy (a few minutes on a cold cache)..." >&2
start=$SECONDS
go install -ldflags "$ldflags" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
echo "built helm in $((SECONDS - start))s" >&2

got="$(installed_version)"
if [[ "$got" != "$HELM_VERSION" ]]; then
  echo "stack/helm.sh: built helm reports version '$got', expected $HELM_VERSION" >&2
  exit 1
fi
echo "helm $HELM_VERSION at $helm_bin"
