#!/usr/bin/env bash
# Build llama-cpp-python with kvagent's llama.cpp patches into a wheel (called by the Makefile).
#
#   scripts/build_llama_wheel.sh PIP VERSION LOCAL_VERSION OUT_DIR [PIP_WHEEL_ARGS...]
#
# Unpacks the llama-cpp-python VERSION sdist with every native/patches/*.patch applied to its vendored
# llama.cpp (unpack_llama_sdist.sh), sets the package version to
# LOCAL_VERSION (VERSION+kvagent.<patch hash>: still satisfies `llama-cpp-python==VERSION`, and a changed
# patch gets a new wheel), and builds the wheel into OUT_DIR with $CMAKE_ARGS.
set -euo pipefail
pip=$1 version=$2 local_version=$3 out=$4
shift 4
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
bash "$root/scripts/unpack_llama_sdist.sh" "$pip" "$version" "$work"
src="$work/llama_cpp_python-$version"
sed -i "s/^__version__ = \"$version\"/__version__ = \"$local_version\"/" "$src/llama_cpp/__init__.py"
grep -q "^__version__ = \"$local_version\"" "$src/llama_cpp/__init__.py"
mkdir -p "$out"
"$pip" wheel --no-deps --no-cache-dir -w "$out" "$@" "$src"
