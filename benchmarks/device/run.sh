#!/usr/bin/env bash
# The GPU check of issue 29 in one run: CUDA tests, `bench checkpoint` and `bench rollback` on the GPU, each
# step under its own `timeout`, every JSON written as it goes; all in at most TOTAL_S (480 s) from the start.
# From the repository root of a bare GPU machine, with the wheels of benchmarks/device/wheels.sh carried along:
#
#     bash benchmarks/device/run.sh [WHEELS_DIR]      (default .rollback/wheels; none there: use what is installed)
#
# Results go to $RESULTS, else $OUT (the lent machine's folder that comes back), else benchmarks/results:
# checkpoint-$PARAMS-$DEVICE.json and rollback-$SIZE-$DEVICE.json; beside them (with $OUT or $RESULTS; else in a
# temporary folder) a log per step and summary.txt: 7 files at most.
# A step that fails or runs out of time is reported and the next one runs; the exit status is 1 if any failed.
# Everything below can be set from the environment; DEVICE=cpu with tiny sizes runs the same steps on a CPU
# (tests/test_device_check.py), DRY_RUN=1 prints each step's command instead of running it.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2

WHEELS=${1:-${WHEELS:-.rollback/wheels}}
RESULTS=${RESULTS:-${OUT:-}}
LOGS=${LOGS:-${RESULTS:-$(mktemp -d /tmp/rbs-device-logs.XXXXXX)}}
RESULTS=${RESULTS:-benchmarks/results}
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
PARAMS=${PARAMS:-100M}                    # bench checkpoint --params
SIZE=${SIZE:-100M}                        # bench rollback --size
REPS=${REPS:-3}
OVERHEAD_STEPS=${OVERHEAD_STEPS:-100}
OVERHEAD_TIMEOUT_S=${OVERHEAD_TIMEOUT_S:-60}
TESTS=${TESTS:-tests/test_cuda.py}
TOTAL_S=${TOTAL_S:-480}                   # the whole run, the install included
T_INSTALL=${T_INSTALL:-60}                # measured on an H200 (FACTS.md): tests 65 s, checkpoint 100M 45 s
T_TESTS=${T_TESTS:-120}
T_CHECKPOINT=${T_CHECKPOINT:-90}
T_ROLLBACK=${T_ROLLBACK:-$TOTAL_S}        # what is left: its paths at 100M x 3, then the overhead phase
KILL_AFTER_S=${KILL_AFTER_S:-20}          # after a step's SIGTERM: the overhead phase stops its training first

mkdir -p "$RESULTS" "$LOGS"
SUMMARY="$LOGS/summary.txt"
: >"$SUMMARY"
FAILED=0

say() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME SECONDS COMMAND...: run COMMAND under `timeout` (SIGTERM to its process group, SIGKILL
# KILL_AFTER_S later), its output in $LOGS/NAME.log; note how it ended and go on whatever happened.
step() {
    local name=$1 limit=$2 log="$LOGS/$1.log" left rc verdict t0
    shift 2
    left=$((TOTAL_S - SECONDS - KILL_AFTER_S))
    if ((left < limit)); then limit=$left; fi
    if [[ -n ${DRY_RUN:-} ]]; then
        printf '+ '
        printf '%q ' "$@"
        echo
        return
    fi
    if ((left < 5)); then
        say "$name: SKIPPED, the run's ${TOTAL_S} s are spent"
        FAILED=1
        return
    fi
    echo "== $name (at most ${limit} s): $*"
    t0=$SECONDS
    timeout -k "$KILL_AFTER_S" "$limit" "$@" >"$log" 2>&1
    rc=$?
    case $rc in
        0) verdict=ok ;;
        124 | 137) verdict="TIMED OUT after ${limit} s" ;;
        *) verdict="FAILED (exit $rc)" ;;
    esac
    ((rc == 0)) || FAILED=1
    if ((rc == 0)); then  # its last word, the printed JSON left out
        grep -v '^[][{} "]' "$log" | tail -n 1 | sed 's/^/    /'
    else
        tail -n 15 "$log" | sed 's/^/    /'
    fi
    say "$name: $verdict in $((SECONDS - t0)) s; log $log"
}

export PYTHONUNBUFFERED=1 GIT_PYTHON_REFRESH=quiet
export PREFECT_HOME=${PREFECT_HOME:-$(mktemp -d /tmp/rbs-prefect.XXXXXX)}
export PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_SERVER_UI_ENABLED=false
export PREFECT_TELEMETRY_ENABLE_RESOURCE_METRICS=false PREFECT_LOGGING_LEVEL=WARNING
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=60

# The wheels go into a scratch folder put first on PYTHONPATH (the image's torch stays); the repository too,
# since nothing is pip-installed here: the CLI runs as `python -m supervisor.cli`.
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    SITE=$(mktemp -d /tmp/rbs-site.XXXXXX)
    step install "$T_INSTALL" "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    say "install: no wheels in $WHEELS; using the packages installed here"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

CLI=("$PYTHON" -m supervisor.cli)
step tests "$T_TESTS" "$PYTHON" -m pytest -q -p no:cacheprovider "$TESTS"
step checkpoint "$T_CHECKPOINT" "${CLI[@]}" bench checkpoint --params "$PARAMS" --reps "$REPS" \
    --device "$DEVICE" --json "$RESULTS/checkpoint-$PARAMS-$DEVICE.json"
step rollback "$T_ROLLBACK" "${CLI[@]}" bench rollback --size "$SIZE" --reps "$REPS" --device "$DEVICE" \
    --overhead-steps "$OVERHEAD_STEPS" --overhead-timeout-s "$OVERHEAD_TIMEOUT_S" \
    --json "$RESULTS/rollback-$SIZE-$DEVICE.json"
[[ -n ${DRY_RUN:-} ]] && exit 0

# What each result file holds, complete or not (a killed bench rollback keeps the phases it finished).
say "== summary after $SECONDS s"
for f in "$RESULTS/checkpoint-$PARAMS-$DEVICE.json" "$RESULTS/rollback-$SIZE-$DEVICE.json"; do
    "$PYTHON" - "$f" <<'PY' | tee -a "$SUMMARY"
import json, sys
path = sys.argv[1]
try:
    d = json.load(open(path))
except (OSError, ValueError) as exc:
    sys.exit(print(f"{path}: none ({exc.__class__.__name__})"))
done = d.get("phases_done")
state = "" if done is None else f" complete={d.get('complete')} phases {len(done)}/{len(d.get('phases_planned', []))}"
print(f"{path}:{state}{' error: ' + d['error'] if d.get('error') else ''}")
keys = ("torch_save_s", "blocking_save_s", "restore_disk_s", "in_process_s", "relaunch_s", "relaunch_standby_s",
        "relaunch_parked_s", "relaunch_preloaded_s", "naive_restart_s", "step_s", "supervisor_cpu_s")
figures = [f"{k}={d[k]:.4g}" for k in keys if isinstance(d.get(k), (int, float))]
if figures:
    print("  " + ", ".join(figures))
for name, t in d.get("targets", {}).items():
    value = "n/a" if t.get("value") is None else f"{t['value']:.4g}"
    print(f"  {name}: {value} (target {t.get('target')}, met {t.get('met')})")
cost = d.get("supervisor_cpu")
if cost:
    print(f"  overhead phase: {cost.get('steps')} steps, timed_out={cost.get('timed_out')}, wall {cost.get('wall_s', 0):.1f} s")
PY
done
exit "$FAILED"
