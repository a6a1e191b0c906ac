#!/usr/bin/env bash
# `make e2e-storage`: every storage e2e run this project keeps, one after another on fresh
# real-node clusters (e2e/scripts/e2e-storage.sh), and one summary of them:
#   1. loop.stowage.dev under stowage: the External Storage suites and the storage controllers'
#      own tests (E2E_SUITES=all);
#   2. the controllers' tests on the loop driver as a third-party driver behind the upstream
#      sidecars (ext.loop.stowage.dev), once under stowage's controllers and once under
#      kube-controller-manager's (stowage's scaled to zero): the same driver and sidecars, so a
#      test that ends differently is the controllers' doing;
#   3. e2e/results/storage-all-<time>/summary.md: each run's summary, then the two controller
#      runs side by side (e2e-summary.py --compare).
# E2E_STORE, E2E_NODES, E2E_PROCS and E2E_FOCUS apply to every run. Exit status: 0 when every run
# passed.
set -euo pipefail
top=$(cd "$(dirname "$0")/../.." && pwd)
cd "$top"
out=${E2E_RESULTS:-$top/e2e/results/storage-all-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$out"
rc=0
run() { # run <name> <env...>
  local name=$1
  shift
  echo "==> e2e-storage: $name"
  env "$@" E2E_RESULTS="$out/$name" ./e2e/scripts/e2e-storage.sh || rc=1
}
run loop-stowage E2E_SUITES=all
run ext-stowage E2E_SUITES=controllers E2E_DRIVER=ext.loop.stowage.dev
run ext-kcm E2E_SUITES=controllers E2E_DRIVER=ext.loop.stowage.dev E2E_CONTROLLERS=kcm

scope=()
while read -r line; do scope+=("--scope=$line"); done < <(grep -v '^#' e2e/storage/controllers.txt)
{
  for name in loop-stowage ext-stowage ext-kcm; do
    echo "## $name"
    echo
    cat "$out/$name/summary.md" 2>/dev/null || echo "(no summary: the run did not finish)"
    echo
  done
  echo "## The storage controllers' tests: stowage and kube-controller-manager side by side"
  echo
  python3 e2e/scripts/e2e-summary.py "${scope[@]}" --compare \
    stowage="$out/ext-stowage" kcm="$out/ext-kcm"
} >"$out/summary.md"
sed -n '/^## The storage controllers/,$p' "$out/summary.md"
echo "e2e-storage: every run's summary in $out/summary.md"
exit $rc
