#!/usr/bin/env bash
# Copy the chat templates llama.cpp ships for its own tests (vendor/llama.cpp/models/templates/*.jinja in the
# pinned llama-cpp-python sdist: the models' own templates as their tokenizer_config.json carries them, which
# is what llama.cpp's converter writes into a GGUF's tokenizer.chat_template) into OUT_DIR, for kvagent's
# tool-format tests (called by the Makefile; pip's cache keeps the sdist).
#
#   scripts/unpack_llama_templates.sh PIP VERSION OUT_DIR
set -euo pipefail
pip=$1 version=$2 out=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$pip" download --quiet --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version"
tar -xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work" --wildcards "*/vendor/llama.cpp/models/templates/*"
mkdir -p "$out.tmp"
cp "$work/llama_cpp_python-$version/vendor/llama.cpp/models/templates/"*.jinja "$out.tmp/"
rm -rf "$out" && mv "$out.tmp" "$out"
