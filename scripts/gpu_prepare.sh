#!/usr/bin/env bash
# On the CPU machine (network; after `make setup`): everything scripts/gpu_check.sh needs on a GPU machine with
# no network, in .gpu/ (ignored through .git/info/exclude; the device run carries it):
#   .gpu/wheels/  the CUDA llama-cpp-python wheel (`make cuda-wheel`, slimmed: one copy of each library) and the
#                 pure-Python / cp312 wheels kvagent needs that the GPU image lacks (pydantic, diskcache, gguf, ...)
#   .gpu/models/  SmolLM2-135M cut to its first 4 blocks, token embedding Q4_0 (`kvagent gpu truncate`): the
#                 KV mechanics on a file small enough to carry (the full GGUFs are 98 and 253 MB)
# and checks that the tree that travels stays under the device tool's 64 MiB.
# The CUDA wheel build is the slow part (nvcc, 2 cores): `make cuda-wheel` alone, at nice 19, first.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
PYVER=${GPU_PYTHON_VERSION:-3.12}   # the GPU image's python3 (/opt/torch/.venv, 3.12.3)

for d in /.wheels/ /.gpu/; do
    grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
make cuda-wheel
rm -rf .gpu/wheels && mkdir -p .gpu/wheels .gpu/models
$BIN/python scripts/gpu_slim_wheel.py .wheels/cuda/llama_cpp_python-*.whl .gpu/wheels
ver() { $BIN/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
# what kvagent and llama_cpp import that the GPU image (KINDS.md's list) does not have, at the versions tested here
$BIN/pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/wheels "pydantic==$(ver pydantic)" "pydantic-core==$(ver pydantic-core)" \
    "annotated-types==$(ver annotated-types)" "typing-inspection==$(ver typing-inspection)" \
    "typing-extensions==$(ver typing-extensions)" "diskcache==$(ver diskcache)" "gguf==$(ver gguf)"
[ -f .gpu/models/smollm2-135m-4l.gguf ] || \
    $BIN/kvagent gpu truncate smollm2-135m --layers 4 --embedding-type q4_0 --out .gpu/models/smollm2-135m-4l.gguf
tree=$(git ls-files -co --exclude-standard -z | du --files0-from=- -cb 2>/dev/null | tail -1 | cut -f1)
bundle=$(du -sb .gpu | cut -f1)
total=$(( (tree + bundle) / 1048576 ))
ls -la .gpu/wheels .gpu/models
echo "travels: working tree $(( tree / 1048576 )) MiB + .gpu $(( bundle / 1048576 )) MiB = $total MiB (limit 64)"
[ "$total" -lt 63 ] || { echo "too large for one device call: trim .gpu or the untracked files" >&2; exit 1; }
echo 'run: device tool run(command="bash scripts/gpu_check.sh", carry=[".gpu"], timeout_s=600)'
