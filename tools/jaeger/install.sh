#!/usr/bin/env bash
# Builds Jaeger (v1.76.0, the versions pinned by go.sum next to this file) once and prints the
# path of the binary. Tests that need a real Jaeger call this; .ci/run calls it up front.
# The binary is cached in $DUET_CACHE (default ~/.cache/duet), so later runs take no time.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${DUET_CACHE:-$HOME/.cache/duet}"
bin="$cache/jaeger-v1.76.0"
if [ ! -x "$bin" ]; then
    mkdir -p "$cache"
    echo "building Jaeger v1.76.0 into $bin (several minutes, once)" >&2
    (cd "$here" && go build -o "$bin.tmp.$$" github.com/jaegertracing/jaeger/cmd/jaeger)
    mv "$bin.tmp.$$" "$bin"
fi
echo "$bin"
