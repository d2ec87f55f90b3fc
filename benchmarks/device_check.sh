#!/usr/bin/env bash
# The whole device run (parity tests, benchmark table, sweep) as one command, for a GPU or NPU machine
# that is lent for minutes:
#
#     bash benchmarks/device_check.sh [OUT_DIR]        # default: $OUT if set, else ./device_results
#
# Stages, in order of value, each under its own time limit (seconds; set 0 to skip a stage) so that a slow
# stage costs only itself and whatever finished is already written to OUT_DIR:
#   1. environment: versions, device name                                    (always)
#   2. device parity and host-read tests on every backend there             TESTS_S=120
#   3. step-time table, all columns incl. torch.compile, JSON per model     TABLE_S=240
#   4. scaling sweep: batch size, number of graphed modules                  SWEEP_S=120
#   5. host work per step with replays stubbed out (mlp, tf; mlp per block)  HOST_S=60
#   6. eager (plain, capturable), whole_step, hand-written whole step, AdamW fused  FUSED_S=60
#   7. the whole CPU suite under this machine's torch (needs omegaconf)      SUITE_S=0
#
# Nothing is installed into the machine's environment: npugraph_train is imported from this source tree.
# omegaconf/hydra are only needed for stage 7 (and the main job). Where the image lacks them, build pure
# Python wheels on a machine with an index and bring them along in .whl/ (ignored by git):
#     python3 -m pip wheel --no-deps -w .whl omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 hydra-core==1.3.8
# (antlr4-python3-runtime 4.9.3 is published as a source archive only, hence `pip wheel`, not `pip download`.)
# This script puts them on PYTHONPATH from a scratch folder when it finds them.
set -u
cd "$(dirname "$0")/.."
out=${1:-${OUT:-device_results}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
status=0

if compgen -G ".whl/*.whl" >/dev/null; then
  site=$(mktemp -d)
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:$site"
fi

stage() {  # stage NAME LIMIT_S COMMAND...: run with a time limit, log to OUT_DIR/NAME.log, keep going on failure
  local name=$1 limit=$2; shift 2
  if [[ $limit -le 0 ]]; then echo "== $name: skipped"; return; fi
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS rc
  timeout --signal=INT --kill-after=15 "$limit" "$@" 2>&1 | tee "$out/$name.log"
  rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0))s$([[ $rc -eq 124 || $rc -eq 137 ]] && echo ' (time limit)')"
  [[ $rc -eq 0 ]] || status=1
}

stage env 60 "$py" -c "
import platform, torch, lightning, npugraph_train.graphed as ng
print('python', platform.python_version(), '| torch', torch.__version__, '| lightning', lightning.__version__)
print('backend', ng.get_backend().name)
if torch.cuda.is_available():
    print('cuda', torch.version.cuda, '|', torch.cuda.get_device_name())
for mod in ('omegaconf', 'hydra'):
    try:
        __import__(mod); print(mod, 'importable')
    except ImportError:
        print(mod, 'missing: stage suite and the main job need it (see the header of this script)')
"
stage devices "${TESTS_S:-120}" "$py" -m pytest -q -s -p no:cacheprovider tests/test_devices.py tests/test_host_reads.py
stage table "${TABLE_S:-240}" "$py" benchmarks/step_time.py --compile --json "$out/table.json"
stage sweep "${SWEEP_S:-120}" "$py" benchmarks/step_time.py --sweep --json "$out/sweep.json"
stage host_work "${HOST_S:-60}" bash -c "$py benchmarks/step_time.py --host-work --models mlp,tf --repeats 2 \
  --json $out/host_work.json && $py benchmarks/step_time.py --host-work --models mlp --granularity blocks \
  --json $out/host_work_blocks.json"
stage fused "${FUSED_S:-60}" "$py" benchmarks/step_time.py --optimizer fused --models mlp,tf \
  --columns eager,eager_capturable,whole_step,whole_graph --json "$out/table_fused.json"
stage suite "${SUITE_S:-0}" "$py" -m pytest -q -p no:cacheprovider
exit $status
