#!/usr/bin/env bash
# Run tests many times in a row and report each test's failures: a flaky test shows up as a count
# between 0 and N. Not part of CI (it takes N times as long as the tests it runs).
#
#   bash scripts/stress_tests.sh [-n N] [PYTEST ARGS ...]
#
# -n N: repetitions (default 20). Without pytest arguments it runs every test file that spawns
# processes or sends signals (gloo ranks, torchrun, subprocesses, signals); give files, `-k EXPR`
# or node ids to narrow it. Each repetition is one pytest run in the project's .venv (as
# scripts/test.sh sets it up); the per-test outcomes of all of them end in a table on stdout, and
# the failing runs' logs stay under $STRESS_DIR (default: a new temporary folder).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh" dev
bash scripts/get_assets.sh
reps=20
if [ "${1:-}" = "-n" ]; then reps="$2"; shift 2; fi
if [ $# -eq 0 ]; then
  mapfile -t files < <(grep -lE 'run_ranks|subprocess|torch\.distributed\.run|send_signal|os\.kill|mp\.spawn' tests/test_*.py)
  set -- "${files[@]}"
fi
out="${STRESS_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/megalite-stress.XXXXXX")}"
mkdir -p "$out"
export OMP_NUM_THREADS=1 WANDB_SILENT=true
echo "stress_tests.sh: $reps runs of: $*  (results in $out)"
for i in $(seq 1 "$reps"); do
  if python -m pytest -q -p no:cacheprovider --junitxml="$out/run_$i.xml" "$@" > "$out/run_$i.log" 2>&1; then
    echo "run $i/$reps: passed"
    rm -f "$out/run_$i.log"
  else
    echo "run $i/$reps: FAILED (log: $out/run_$i.log)"
  fi
done
python - "$out" "$reps" <<'PY'
import collections, glob, sys
import xml.etree.ElementTree as ET

out, reps = sys.argv[1], int(sys.argv[2])
runs, failures = collections.Counter(), collections.Counter()
for path in glob.glob(f"{out}/run_*.xml"):
    for case in ET.parse(path).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("skipped") is not None:
            continue
        runs[name] += 1
        failures[name] += case.find("failure") is not None or case.find("error") is not None
width = max(map(len, runs), default=10)
print(f"{'test':<{width}}  failures / runs")
for name in sorted(runs, key=lambda n: (-failures[n], n)):
    print(f"{name:<{width}}  {failures[name]} / {runs[name]}")
flaky = [n for n in runs if failures[n]]
print(f"{len(runs)} tests, {reps} repetitions: " + (f"{len(flaky)} failed at least once" if flaky else "no failure"))
sys.exit(1 if flaky else 0)
PY
