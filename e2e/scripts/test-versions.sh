#!/usr/bin/env bash
# The version matrix: the apiserver integration tests (the four controllers' and the controller
# binary's) against each Kubernetes minor given (default: every e2e/versions/<minor>),
# its kube-apiserver, kube-controller-manager and kubectl from build-controlplane-version.sh.
# Each run's output goes to e2e/results/versions/<minor>.log; a table of the test binaries'
# counts closes the output. Exits non-zero if any version failed.
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
cd "$here"
cargo=${CARGO:-cargo}
minors=("$@")
if [ ${#minors[@]} = 0 ]; then
  for d in e2e/versions/*/; do minors+=("$(basename "$d")"); done
fi
# The integration test targets only (--test '*'): unit tests do not touch the apiserver.
packages=(stowage-binder stowage-attachdetach stowage-expand stowage-protection stowage-controller)
args=()
for p in "${packages[@]}"; do args+=(-p "$p"); done
mkdir -p e2e/results/versions
"$cargo" build --workspace --bins
status=0
summary=()
for m in "${minors[@]}"; do
  ./e2e/scripts/build-controlplane-version.sh "$m" || { summary+=("v$m: build failed"); status=1; continue; }
  version=$("e2e/versions/$m/bin/kube-apiserver" --version | awk '{print $2}')
  log="e2e/results/versions/$m.log"
  start=$(date +%s)
  echo "test-versions: $version ($log)"
  # e2e/versions/<minor>/skip: tests whose oracle (that minor's kube-controller-manager) differs
  # from v1.36 by an upstream change; each is printed with its reason.
  skips=()
  if [ -f "e2e/versions/$m/skip" ]; then
    while read -r name reason; do
      case "$name" in '' | '#'*) continue ;; esac
      echo "test-versions: $version skips $name: $reason"
      skips+=(--skip "$name")
    done <"e2e/versions/$m/skip"
  fi
  STOWAGE_CONTROLPLANE_BIN="$here/e2e/versions/$m/bin" \
    "$cargo" test "${args[@]}" --no-fail-fast --test '*' -- "${skips[@]}" >"$log" 2>&1
  rc=$?
  [ "$rc" = 0 ] || status=1
  passed=$(grep -oE '^test result: .*' "$log" | grep -oE '[0-9]+ passed' | awk '{s+=$1} END {print s+0}')
  failed=$(grep -oE '^test result: .*' "$log" | grep -oE '[0-9]+ failed' | awk '{s+=$1} END {print s+0}')
  ignored=$(grep -oE '^test result: .*' "$log" | grep -oE '[0-9]+ ignored' | awk '{s+=$1} END {print s+0}')
  summary+=("$version: $passed passed, $failed failed, $ignored ignored in $(( $(date +%s) - start ))s")
  if [ "$rc" != 0 ]; then
    grep -E '^test .* FAILED$|^    [a-z_:]+$|error: test failed' "$log" | sed "s/^/  $version /"
  fi
done
echo "test-versions: results"
printf '  %s\n' "${summary[@]}"
exit $status
