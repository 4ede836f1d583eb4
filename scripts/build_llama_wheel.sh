#!/usr/bin/env bash
# Build llama-cpp-python with kvagent's llama.cpp patches into a wheel (called by the Makefile).
#
#   scripts/build_llama_wheel.sh PIP VERSION LOCAL_VERSION OUT_DIR [PIP_WHEEL_ARGS...]
#
# Fetches the llama-cpp-python VERSION sdist (pip's cache keeps it), applies every native/patches/*.patch to
# its vendored llama.cpp (fails loudly when a patch no longer applies), sets the package version to
# LOCAL_VERSION (VERSION+kvagent.<patch hash>: still satisfies `llama-cpp-python==VERSION`, and a changed
# patch gets a new wheel), and builds the wheel into OUT_DIR with $CMAKE_ARGS.
set -euo pipefail
pip=$1 version=$2 local_version=$3 out=$4
shift 4
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$pip" download --quiet --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version"
tar -xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
src="$work/llama_cpp_python-$version"
for p in "$root"/native/patches/*.patch; do
    echo "applying $(basename "$p")"
    patch -d "$src/vendor/llama.cpp" -p1 --forward --batch < "$p"
done
sed -i "s/^__version__ = \"$version\"/__version__ = \"$local_version\"/" "$src/llama_cpp/__init__.py"
grep -q "^__version__ = \"$local_version\"" "$src/llama_cpp/__init__.py"
mkdir -p "$out"
"$pip" wheel --no-deps --no-cache-dir -w "$out" "$@" "$src"
