#!/usr/bin/env bash
# Unpack the pinned llama-cpp-python sdist with kvagent's llama.cpp patches applied (used by
# build_llama_wheel.sh and build_llama_server.sh, so the wheel and llama-server come from the same tree).
#
#   scripts/unpack_llama_sdist.sh PIP VERSION WORK_DIR
#
# Fetches the llama-cpp-python VERSION sdist into WORK_DIR (pip's cache keeps it), unpacks it there and
# applies every native/patches/*.patch to its vendored llama.cpp (fails loudly when a patch no longer
# applies). The tree is WORK_DIR/llama_cpp_python-VERSION.
set -euo pipefail
pip=$1 version=$2 work=$3
root=$(cd "$(dirname "$0")/.." && pwd)
"$pip" download --quiet --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version"
tar -xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
src="$work/llama_cpp_python-$version"
for p in "$root"/native/patches/*.patch; do
    echo "applying $(basename "$p")"
    patch -d "$src/vendor/llama.cpp" -p1 --forward --batch < "$p"
done
