#!/usr/bin/env bash
# Builds Prometheus (v3.16: module version v0.316.0, every dependency pinned by go.sum next to
# this file) once and prints the path of the binary. The test that scrapes a cluster and
# checks the Grafana dashboard's queries calls this; .ci/run calls it up front. Built with
# `remove_all_sd` (no cloud service discovery: the tests list their targets), which halves
# the build. Cached in $DUET_CACHE (default ~/.cache/duet), so later runs take no time.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${DUET_CACHE:-$HOME/.cache/duet}"
bin="$cache/prometheus-v0.316.0"
if [ ! -x "$bin" ]; then
    mkdir -p "$cache"
    echo "building Prometheus v0.316.0 into $bin (a few minutes, once)" >&2
    (cd "$here" && go build -tags remove_all_sd -o "$bin.tmp.$$" github.com/prometheus/prometheus/cmd/prometheus)
    mv "$bin.tmp.$$" "$bin"
fi
echo "$bin"
