#!/usr/bin/env bash
# The real-node scenarios against other Kubernetes minors: for each minor given (default: those
# whose e2e/versions/<minor>/go.mod names the kubelet), its kube-apiserver, kube-controller-manager,
# kube-scheduler and kubelet (build-controlplane-version.sh) run the one-node scenarios of
# crates/chart-tests/tests/realnode.rs (helm install of the image, pods on loop volumes, online
# grow, Delete and Retain); REALNODE_TESTS names the test files to run instead, e.g.
# REALNODE_TESTS="realnode realnode2" adds the two-node ones. Needs root, containerd and what
# `make test` installs. Logs in e2e/results/versions/<test>-<minor>.log; a table closes the
# output. Exits non-zero if any minor failed.
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
cd "$here"
cargo=${CARGO:-cargo}
minors=("$@")
if [ ${#minors[@]} = 0 ]; then
  for d in e2e/versions/*/; do
    grep -q 'k8s.io/kubernetes/cmd/kubelet$' "$d/go.mod" && minors+=("$(basename "$d")")
  done
fi
read -r -a tests <<<"${REALNODE_TESTS:-realnode}"
mkdir -p e2e/results/versions
# What the scenarios install: the image of the debug binaries and the pods' images (as make test).
"$cargo" build --workspace --bins || exit 1
STOWAGE_IMAGE_BIN_DIR=${CARGO_TARGET_DIR:-target}/debug ./e2e/scripts/image.sh || exit 1
./e2e/scripts/pod-images.sh || exit 1
status=0
summary=()
for m in "${minors[@]}"; do
  grep -q 'k8s.io/kubernetes/cmd/kubelet$' "e2e/versions/$m/go.mod" ||
    { summary+=("v$m: no kubelet pinned in e2e/versions/$m/go.mod"); status=1; continue; }
  ./e2e/scripts/build-controlplane-version.sh "$m" || { summary+=("v$m: build failed"); status=1; continue; }
  version=$("e2e/versions/$m/bin/kubelet" --version | awk '{print $2}')
  for t in "${tests[@]}"; do
    log="e2e/results/versions/$t-$m.log"
    start=$(date +%s)
    echo "test-versions-realnode: $version $t ($log)"
    STOWAGE_CONTROLPLANE_BIN="$here/e2e/versions/$m/bin" \
      "$cargo" test -p stowage-chart-tests --test "$t" -- --nocapture >"$log" 2>&1
    rc=$?
    [ "$rc" = 0 ] || status=1
    result=$(grep -oE '^test result: .*' "$log" | tail -1)
    summary+=("$version $t: ${result:-no result (rc $rc)} in $(( $(date +%s) - start ))s")
    [ "$rc" = 0 ] || grep -E '^test .* FAILED$|panicked at' "$log" | sed "s/^/  $version /"
  done
done
echo "test-versions-realnode: results"
printf '  %s\n' "${summary[@]}"
exit $status
