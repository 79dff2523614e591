#!/usr/bin/env bash
# One call on a bare GPU machine (docs/benchmarks.md, "On a bare GPU machine"): install the
# carried wheels, run the GPU tests, then `infer bench gpu`; every phase under its own timeout so
# the whole script ends inside GPU_CHECK_BUDGET seconds.
#
#   bash scripts/gpu_check.sh        # from the repository root, with .whl/ carried alongside
#                                    # (made here, before the call, by scripts/gpu_wheels.sh)
#
# Results land in $OUT (default bench-results/gpu-check): tests.log, report.log, bench.log,
# gpu.md, gpu.json, side.tgz (server logs, py-spy profiles) and integration.log: at most seven. Environment (defaults in brackets):
#   GPU_CHECK_BUDGET [400]           seconds for the whole script; the bench gets what is left
#   GPU_CHECK_TESTS [1]              0 skips the GPU test files
#   GPU_CHECK_TEST_FILES             [tests/*/test_*cuda*.py tests/*/test_*triton*.py]
#   GPU_CHECK_PYTEST_ARGS            [-q -rfE --maxfail=5]
#   GPU_CHECK_TEST_TIMEOUT [180]
#   GPU_CHECK_INTEGRATION [0]        1: also `pytest tests/integration --device cuda` (minutes)
#   GPU_CHECK_INTEGRATION_ARGS []    e.g. "--attention-backend torch --enforce-eager"
#   GPU_CHECK_INTEGRATION_PATHS [tests/integration]  what the integration run collects
#   GPU_CHECK_INTEGRATION_TIMEOUT [240]
#   GPU_CHECK_OMP_THREADS [2]        torch threads of each integration test process
#   GPU_CHECK_BENCH [1]              0 skips infer bench gpu
#   GPU_CHECK_BENCH_ARGS []          e.g. "--quick", "--skip-hf", "--modes graphs,torch-eager"
#   GPU_CHECK_BENCH_MIN [60]         seconds the bench needs at least, else it is skipped
#   GPU_CHECK_BENCH_FIRST [0]        1: the bench before the tests, for GPU_CHECK_BENCH_LIMIT [240] s
#   GPU_CHECK_PER_TEST_TIMEOUT [90]  pytest-timeout per test: a hung test fails with its traceback
#   GPU_CHECK_SAVE_TRITON_CACHE [0]  1: $OUT/triton-cache.tgz, Triton's compiled kernels; unpacked
#                                    into .triton-cache/ and carried, the next machine skips the
#                                    compiles (kernels whose source changed compile again)
# Each test's outcome, duration and traceback go to $OUT/report.log as it finishes (tests/gpu_report.py),
# so a phase cut short by its timeout still says what failed.
set -u
cd "$(dirname "$0")/.."
START=$(date +%s)
OUT=${OUT:-$PWD/bench-results/gpu-check}
mkdir -p "$OUT"
BUDGET=${GPU_CHECK_BUDGET:-400}
elapsed() { echo $(($(date +%s) - START)); }
phase() { echo "== [$(elapsed)s] $*"; }
TESTS_RC=- INTEGRATION_RC=- BENCH_RC=-

phase "machine"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader ||
    echo "nvidia-smi failed"
command -v g++ >/dev/null || echo "no g++: infer's C++ CPU kernels fall back to torch"

phase "wheels"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | grep -v "WARNING: Running pip as" ||
        true
else
    echo "no .whl/ here: make it with scripts/gpu_wheels.sh, name it in the call's carry (fastapi, uvicorn, openai, ... are missing)"
fi
export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TRITON_CACHE_DIR=$PWD/.triton-cache INFER_TEST_REPORT=$OUT/report.log
mkdir -p "$TRITON_CACHE_DIR"
echo "Triton cache: $(find "$TRITON_CACHE_DIR" -type f | wc -l) files carried"
PYTEST_PLUGINS=(-p no:cacheprovider -p tests.gpu_report)
if python3 -c "import pytest_timeout" 2>/dev/null; then
    PYTEST_PLUGINS+=(--timeout "${GPU_CHECK_PER_TEST_TIMEOUT:-90}")
fi
python3 - <<'EOF'
import importlib
versions = []
for name in ("torch", "triton", "transformers", "fastapi", "pydantic", "openai", "llguidance"):
    try:
        versions.append(f"{name} {importlib.import_module(name).__version__}")
    except Exception as e:  # noqa: BLE001
        versions.append(f"{name} MISSING ({type(e).__name__})")
import torch
print(", ".join(versions), "| CUDA", torch.version.cuda, "| available:", torch.cuda.is_available())
EOF

run_tests() {
    if [ "${GPU_CHECK_TESTS:-1}" = 1 ]; then
        shopt -s nullglob
        # shellcheck disable=SC2206  # the globs are meant to expand
        files=(${GPU_CHECK_TEST_FILES:-tests/*/test_*cuda*.py tests/*/test_*triton*.py})
        shopt -u nullglob
        phase "GPU tests: ${files[*]}"
        # shellcheck disable=SC2086
        timeout -k 10 "${GPU_CHECK_TEST_TIMEOUT:-180}" python3 -m pytest "${PYTEST_PLUGINS[@]}" \
            ${GPU_CHECK_PYTEST_ARGS:--q -rfE --maxfail=5} "${files[@]}" >"$OUT/tests.log" 2>&1
        TESTS_RC=$?
        tail -n 25 "$OUT/tests.log"
        phase "GPU tests: rc=$TESTS_RC"
    fi
}

run_integration() {
    if [ "${GPU_CHECK_INTEGRATION:-0}" = 1 ]; then
        phase "integration tests on cuda ${GPU_CHECK_INTEGRATION_ARGS:-}"
        # Few threads a process: with xdist's workers, torch's CPU threads (the transformers oracle,
        # the CPU-only tests) would oversubscribe the cores many times over (45 s tests).
        # shellcheck disable=SC2086
        OMP_NUM_THREADS=${GPU_CHECK_OMP_THREADS:-2} \
            timeout -k 10 "${GPU_CHECK_INTEGRATION_TIMEOUT:-240}" python3 -m pytest "${PYTEST_PLUGINS[@]}" \
            -q -rfE ${GPU_CHECK_INTEGRATION_PATHS:-tests/integration} --device cuda \
            ${GPU_CHECK_INTEGRATION_ARGS:-} \
            >"$OUT/integration.log" 2>&1
        INTEGRATION_RC=$?
        tail -n 15 "$OUT/integration.log"
        phase "integration tests: rc=$INTEGRATION_RC"
    fi
}

run_bench() {
    if [ "${GPU_CHECK_BENCH:-1}" = 1 ]; then
        left=$((BUDGET - $(elapsed) - 5))
        if [ "${GPU_CHECK_BENCH_FIRST:-0}" = 1 ] && [ "$left" -gt "${GPU_CHECK_BENCH_LIMIT:-240}" ]; then
            left=${GPU_CHECK_BENCH_LIMIT:-240}
        fi
        if [ "$left" -lt "${GPU_CHECK_BENCH_MIN:-60}" ]; then
            phase "bench skipped: ${left}s left of GPU_CHECK_BUDGET=$BUDGET"
        else
            phase "infer bench gpu ${GPU_CHECK_BENCH_ARGS:-} (limit ${left}s)"
            # SIGTERM at the limit: the bench writes what it measured, then its summary.
            set -o pipefail
            # shellcheck disable=SC2086
            timeout -s TERM -k 20 "$left" python3 -m infer.cli bench gpu --out "$OUT" \
                ${GPU_CHECK_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
            BENCH_RC=$?
            set +o pipefail
        fi
    fi
}

# The bench first when its figures matter most (GPU_CHECK_BENCH_FIRST=1, at most
# GPU_CHECK_BENCH_LIMIT seconds); else the tests, whose failures decide what the figures mean.
if [ "${GPU_CHECK_BENCH_FIRST:-0}" = 1 ]; then
    run_bench
    run_tests
    run_integration
else
    run_tests
    run_integration
    run_bench
fi

# The bench's side files (each HTTP mode's server log, py-spy profiles) in one archive: a lent
# machine sends back at most eight files (these seven, and triton-cache.tgz when asked for).
side=$(cd "$OUT" && ls http_server_*.log pyspy_*.txt 2>/dev/null)
if [ -n "$side" ]; then
    # shellcheck disable=SC2086  # one name a word
    (cd "$OUT" && tar -czf side.tgz $side && rm -f $side)
fi
if [ "${GPU_CHECK_SAVE_TRITON_CACHE:-0}" = 1 ]; then
    tar -czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" . && ls -l "$OUT/triton-cache.tgz"
fi
[ -f "$OUT/report.log" ] && grep -c "^passed" "$OUT/report.log" | sed 's/^/report: passed /' &&
    grep -E "^(failed|error)" "$OUT/report.log"
ls -l "$OUT"
phase "done: tests rc=$TESTS_RC, integration rc=$INTEGRATION_RC, bench rc=$BENCH_RC"
