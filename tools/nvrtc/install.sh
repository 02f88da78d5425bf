#!/usr/bin/env bash
# Fetches NVRTC (NVIDIA's runtime CUDA C compiler, the PyPI wheel nvidia-cuda-nvrtc-cu12
# 12.9.86, sha256-checked) once and prints the path of libnvrtc.so.12. NVRTC needs no GPU:
# the kernel test compiles Duet's CUDA kernels with it on any machine, so a kernel that does not
# compile fails CI here rather than on the first GPU machine. Cached in $DUET_CACHE (default
# ~/.cache/duet).
set -euo pipefail
version=12.9.86
sha=210cf05005a447e29214e9ce50851e83fc5f4358df8b453155d5e1918094dcb4
wheel="nvidia_cuda_nvrtc_cu12-$version-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl"
cache="${DUET_CACHE:-$HOME/.cache/duet}"
dir="$cache/nvrtc-$version"
lib="$dir/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
if [ ! -f "$lib" ]; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    echo "fetching NVRTC $version into $dir (90 MB, once)" >&2
    python3 -m pip download --quiet --no-deps --only-binary=:all: \
        --platform manylinux2010_x86_64 --python-version 3 \
        -d "$tmp" "nvidia-cuda-nvrtc-cu12==$version" >&2
    echo "$sha  $tmp/$wheel" | sha256sum --check --quiet
    python3 -m zipfile -e "$tmp/$wheel" "$tmp/x"
    mkdir -p "$cache"
    rm -rf "$dir"
    mv "$tmp/x" "$dir"
fi
echo "$lib"
