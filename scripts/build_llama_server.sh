#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` from the same patched tree as kvagent's llama-cpp-python wheel
# (called by the Makefile's `llama-server` target).
#
#   scripts/build_llama_server.sh PIP VERSION OUT_FILE
#
# Unpacks the pinned sdist with native/patches/*.patch applied (unpack_llama_sdist.sh), configures its
# vendored llama.cpp with $CMAKE_ARGS (the wheel's portable flags) plus a static, server-only build (no web UI
# download, no tests or examples), builds only the llama-server target with $CMAKE_BUILD_PARALLEL_LEVEL jobs
# and copies the binary to OUT_FILE. Nothing is downloaded but the sdist from the package index.
set -euo pipefail
pip=$1 version=$2 out=$3
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
bash "$root/scripts/unpack_llama_sdist.sh" "$pip" "$version" "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
# shellcheck disable=SC2086  # CMAKE_ARGS is a list of flags
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF ${CMAKE_ARGS:-}
cmake --build "$work/build" --target llama-server --parallel "${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
mkdir -p "$(dirname "$out")"
cp "$work/build/bin/llama-server" "$out.tmp"
mv "$out.tmp" "$out"
"$out" --version
