#!/usr/bin/env bash
# Builds Helm (v3.22.0, the versions pinned by go.sum next to this file) once and prints the
# path of the binary. The chart test (tests/helm_chart.rs) calls this; .ci/run calls it up
# front. The binary is cached in $DUET_CACHE (default ~/.cache/duet), so later runs take no time.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${DUET_CACHE:-$HOME/.cache/duet}"
bin="$cache/helm-v3.22.0"
if [ ! -x "$bin" ]; then
    mkdir -p "$cache"
    echo "building Helm v3.22.0 into $bin (a few minutes, once)" >&2
    (cd "$here" && go build -o "$bin.tmp.$$" helm.sh/helm/v3/cmd/helm)
    mv "$bin.tmp.$$" "$bin"
fi
echo "$bin"
