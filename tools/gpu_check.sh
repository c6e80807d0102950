#!/usr/bin/env bash
# The GPU validation of a commit, on the GPU host: the full GPU test suite, then compute-sanitizer memcheck on a
# representative subset (every KV format; split + combine and direct; flat and paged; MTP causal; 64 heads; the
# plan entry point). Writes logs to ${OUT:-/tmp}/; exit status: non-zero if anything failed.
#   bash tools/gpu_check.sh            # tests + sanitizer
#   bash tools/gpu_check.sh sanitizer  # sanitizer only
set -u
out=${OUT:-/tmp}
status=0
if [ "${1:-all}" != sanitizer ]; then
  python -m pytest -q -p no:cacheprovider --timeout 600 tests \
    --ignore=tests/test_gfx942.py --ignore=tests/test_compile.py --ignore=tests/test_bench_cpu.py \
    > "$out/gpu-tests.log" 2>&1 || status=1
  tail -n 25 "$out/gpu-tests.log"
fi
run_memcheck() {
  local log="$out/memcheck-$(echo "$*" | tr ' -' '__').log"
  if compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 python tools/one_call.py "$@" --reps 1 > "$log" 2>&1; then
    echo "memcheck clean: one_call.py $* ($(grep -m1 'ERROR SUMMARY' "$log"))"
  else
    echo "memcheck FAILED (rc $?): one_call.py $*"; tail -n 30 "$log"; status=1
  fi
}
run_memcheck bf16 4 1024
run_memcheck fp8 64 1024 --splits 1
run_memcheck a8w8 4 1024 --q-len 8 --causal
run_memcheck mxfp4 4 1024 16
run_memcheck mxfp4 8 700 64 --splits 5
run_memcheck fp8 4 1024 64 --heads 64 --q-len 8 --causal --plan
run_memcheck bf16 4 777 1 --plan
exit $status
