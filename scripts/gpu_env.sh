# Sourced by the device scripts (gpu_check.sh, gpu_nan_probe.sh): the CUDA wheel and the packages the GPU image
# lacks, installed from $BUNDLE/wheels into $SITE; kvagent from the tree ($ROOT); libcudart / libcublas on the
# loader's path (the toolkit's lib64, or the nvidia-* wheels beside torch); the common environment.
# Needs PY, SITE, BUNDLE, ROOT; SKIP_INSTALL=1 keeps an existing $SITE. Returns non-zero when the install fails.
gpu_env_setup() {
    if [ "${SKIP_INSTALL:-0}" != 1 ]; then
        ls "$BUNDLE"/wheels/*.whl >/dev/null 2>&1 || { echo "no $BUNDLE/wheels: run scripts/gpu_prepare.sh here and carry .gpu"; return 1; }
        rm -rf "$SITE"
        $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$BUNDLE"/wheels/*.whl || { echo "FAIL install"; return 1; }
    fi
    export PYTHONPATH=$SITE:$ROOT:$ROOT/adapters/bench
    local libs
    libs=$($PY - <<'PYEOF'
import glob, os, site
dirs = ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]
for sp in site.getsitepackages():
    dirs += sorted(glob.glob(os.path.join(sp, "nvidia", "*", "lib")))
print(":".join(d for d in dirs if glob.glob(os.path.join(d, "libcublas.so*")) or glob.glob(os.path.join(d, "libcudart.so*"))))
PYEOF
)
    export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    export KVAGENT_CACHE_DIR=/tmp/kvagent-cache PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
    MODEL=${GPU_CHECK_MODEL:-$BUNDLE/models/smollm2-135m-4l.gguf}
}
