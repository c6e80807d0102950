#!/usr/bin/env bash
# The fp8 ring's untimed opt-ins (persistent_ctas, q_loop_rows; docs/perf.md run 62): their checks, the persistent
# ring's watchdog case and an A/B through the op against the default ring and the one-copy ring, in one GPU call.
#
#   MLA_TARGET=sm_90a TILELANG_CACHE_DIR=DIR bash tools/ws_opt_ins.sh prebuild   # CPU box: compile what "run" launches
#   bash tools/ws_opt_ins.sh run OUT_DIR                                          # GPU host (TILELANG_CACHE_DIR set)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?prebuild or run}
out=${2:-.}
ring() {  # the default ring's fields of the mode, in one copy (dynamic_stage)
  if [ "$1" = fp8 ]; then echo "fp8_mma=1,p_split=1,q_stack=1,p_stack=1,dynamic_stage=1"
  else echo "fp8_mma=1,p_split=1,p_stack=1,dynamic_stage=1"; fi
}
variants() {
  local f; f=$(ring "$1")
  echo "ring:ws=1;dyn:ws=1,$f;pc:ws=1,$f,persistent_ctas=132;ql:ws=1,$f,q_loop_rows=2;pcql:ws=1,$f,persistent_ctas=132,q_loop_rows=2"
}
checks() {
  if [ "$1" = fp8 ]; then echo "f8mmaqpstdynpc,f8mmaqpstdynpc5,f8mmaqpstdynql2,f8mmaqpstdynpcql2"
  else echo "f8mmapstdynpc,f8mmapstdynpc5,f8mmapstdynql2,f8mmapstdynpcql2"; fi
}
if [ "$mode" = prebuild ]; then
  for m in fp8 a8w8; do
    python tools/override_ab.py --prebuild --modes "$m" --variants "$(variants "$m")"
    python tools/ws_check.py --prebuild --check --no-old --modes "$m" --variants "$(checks "$m")"
  done
  python -c "
import sys; sys.path[:0] = ['.', 'tests']
from mla import jit
from mla.target import spec_for_name
import test_ws_gpu
spec = spec_for_name('sm_90a')
for cfg in test_ws_gpu.watchdog_configs(spec, ['a8w8-pc5', 'fp8-pc5']):
    jit.get_kernel(cfg, spec)
"
  exit 0
fi
for m in fp8 a8w8; do
  python tools/ws_check.py --check --no-old --modes "$m" --variants "$(checks "$m")" --json "$out/ws_check_$m.json" 2>&1 | grep -E "^check" | tail -6
done
timeout 300 python -m pytest -q tests/test_ws_gpu.py -k pc5 2>&1 | tail -3
for pass in 1 2; do
  for m in fp8 a8w8; do
    python tools/override_ab.py --modes "$m" --variants "$(variants "$m")" --json "$out/ab_${m}_$pass.json" 2>&1 | tail -14
  done
done
