#!/usr/bin/env bash
# The A/B measurement docs/benchmarks.md asks of a change to the read path or the controllers'
# loops: stowage-controller built (release) at two commits, run alternately on the same machine
# (the side that runs first alternating by round), same harness (the bench binary of this tree),
# stowage only, static-10000 and attach-1000x50 with client limits lifted; then the medians of
# each build and whether the change stays within 5 % of throughput and 10 % of CPU per object of
# the build before; beside them the reads per object and the apiserver's time per object (the
# same harness on both sides, so a difference is the build's).
#
#   e2e/scripts/ab-bench.sh <before> [after=HEAD]
#   AB_ROUNDS=3 (runs per build, alternating)  AB_WORKLOADS=static,attach
#
# Each commit's binary is built once in a worktree under the user's cache dir and kept there,
# keyed by the commit. Needs `make controlplane` (the bench's apiserver) and an idle machine.
set -euo pipefail
top=$(cd "$(dirname "$0")/../.." && pwd)
cd "$top"
before=$(git rev-parse --verify "${1:?usage: ab-bench.sh <before> [after]}^{commit}")
after=$(git rev-parse --verify "${2:-HEAD}^{commit}")
rounds=${AB_ROUNDS:-3}
workloads=${AB_WORKLOADS:-static,attach}
cache="${XDG_CACHE_HOME:-$HOME/.cache}/stowage/ab"
# The bench's apiserver and etcd: this tree's (a harness built elsewhere would look beside its
# own sources).
export STOWAGE_CONTROLPLANE_BIN=${STOWAGE_CONTROLPLANE_BIN:-$top/e2e/bin}
mkdir -p "$cache"

# build <commit>: prints the path of that commit's release stowage-controller.
build() {
  local commit=$1 bin="$cache/bin/$1/stowage-controller"
  if [ ! -x "$bin" ]; then
    local wt="$cache/src-$commit"
    [ -d "$wt" ] || git worktree add -q --detach "$wt" "$commit" >&2
    # One target dir for both builds: the dependencies compile once.
    (cd "$wt" && CARGO_TARGET_DIR="$cache/target" cargo build --release -p stowage-controller >&2)
    mkdir -p "$(dirname "$bin")"
    cp "$cache/target/release/stowage-controller" "$bin"
    git worktree remove --force "$wt" >&2
  fi
  echo "$bin"
}

echo "==> building $before and $after (cached by commit)" >&2
bin_before=$(build "$before")
bin_after=$(build "$after")

out="e2e/results/ab-$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  # The side that runs first alternates: a machine that drifts within a round (caches, load)
  # then favours neither build.
  order="before after"
  (( round % 2 == 0 )) && order="after before"
  for side in $order; do
    bin=$bin_before
    [ "$side" = after ] && bin=$bin_after
    echo "==> round $round: $side" >&2
    BENCH_STOWAGE_BIN=$bin BENCH_IMPLS=stowage BENCH_WORKLOADS=$workloads \
      BENCH_STATIC_SIZES=10000 BENCH_MODES=lifted BENCH_OUT_DIR="$out/$side-$round" \
      ./e2e/scripts/bench.sh >/dev/null
  done
done

python3 - "$out" "$before" "$after" <<'EOF'
import glob, json, statistics, sys
out, before, after = sys.argv[1:]
rows = {}
for side in ("before", "after"):
    for f in glob.glob(f"{out}/{side}-*/bench-*.json"):
        for r in json.load(open(f))["results"]:
            if r["implementation"] != "stowage" or not r["converged"]:
                continue
            key = (r["workload"], side)
            n = max(r["done"], 1)
            # Reads (the bench's own included: the same harness on both sides) other than
            # watches, and the apiserver's time on all requests but watches, per object.
            reads = sum(v for k, v in r.get("reads_by_resource", {}).items() if " WATCH " not in k)
            served = sum(r.get("request_seconds_by_resource", {}).values())
            rows.setdefault(key, []).append((r["throughput_per_s"], r["cpu_s"] / n, reads / n, served / n))
print(f"| workload | build | runs | objects/s (median) | CPU ms per object (median) | reads per object | apiserver ms per object |")
print("| --- | --- | --- | --- | --- | --- | --- |")
verdict = True
for w in sorted({k[0] for k in rows}):
    med = {}
    for side, commit in (("before", before), ("after", after)):
        runs = rows.get((w, side), [])
        if not runs:
            print(f"| {w} | {side} {commit[:7]} | 0 | — | — | — | — |")
            verdict = False
            continue
        t = statistics.median(x[0] for x in runs)
        c = statistics.median(x[1] for x in runs)
        rd = statistics.median(x[2] for x in runs)
        sv = statistics.median(x[3] for x in runs)
        med[side] = (t, c, rd, sv)
        print(f"| {w} | {side} {commit[:7]} | {len(runs)} | {t:.1f} | {c * 1000:.3f} | {rd:.2f} | {sv * 1000:.3f} |")
    if len(med) == 2:
        dt = med["after"][0] / med["before"][0]
        dc = med["after"][1] / med["before"][1]
        ok = dt >= 0.95 and dc <= 1.10
        verdict &= ok
        dr = med["after"][2] / med["before"][2] if med["before"][2] else float("nan")
        ds = med["after"][3] / med["before"][3] if med["before"][3] else float("nan")
        print(f"| {w} | after/before | | {dt:.3f}× | {dc:.3f}× {'ok' if ok else 'OUT OF BOUNDS'} | {dr:.3f}× | {ds:.3f}× |")
print()
print("within bounds (throughput ≥ 0.95×, CPU per object ≤ 1.10×):", "yes" if verdict else "no")
sys.exit(0 if verdict else 1)
EOF
