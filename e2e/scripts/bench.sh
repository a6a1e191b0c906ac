#!/usr/bin/env bash
# make bench: stowage-controller side by side with upstream kube-controller-manager on one real
# kube-apiserver + etcd, same workloads, one implementation at a time. Markdown on stdout (also
# e2e/results/latest.md), JSON and controller logs in e2e/results/ (gitignored).
#
# Environment (all optional; the binary's --help lists the same settings as flags):
#   BENCH_SIZES=full|small     full = the issue's sizes (static 1,000 + 10,000 pairs, burst 10,000,
#                              1,000 pods over 50 nodes, 500 expansions); small = N 200 (10 nodes)
#   BENCH_WORKLOADS=static,burst,attach,expand,agent,takeover   (agent: loop devices, needs root;
#                              takeover: two replicas of each side, the leader stopped, run last)
#   BENCH_IMPLS=floor,upstream,stowage   floor: the apiserver's write floor of each workload
#                              (a bare writer, no limit, no logic; run first, once per workload)
#   BENCH_FLOOR_CONCURRENCY=16,64,256  one floor row per value; the best one is the floor
#   BENCH_MODES=equal,defaults  also `lifted`: --kube-api-qps=100000 --kube-api-burst=100000 for both
#   BENCH_QPS=50 BENCH_BURST=100     client limits of both in mode `equal`
#   BENCH_STATIC_SIZES=1000,10000 BENCH_BURST_SIZE=10000,50000 (lists) BENCH_ATTACH_PODS BENCH_ATTACH_NODES BENCH_EXPAND_SIZE
#   BENCH_STALL_TIMEOUT=120s   a run gives up when nothing progresses for this long
#   BENCH_ROUNDS=1             run each workload's whole plan this many times in turn; the report
#                              adds each round's ratios against upstream and the floor, and medians
#   BENCH_TAKEOVER_SIZES=10000,50000 BENCH_TAKEOVER_PODS=1000 BENCH_TAKEOVER_NEW=100
#   BENCH_TAKEOVER_STOPS=kill,term   how the takeover's leader is stopped (one run per value and side)
#   BENCH_STOWAGE_ARGS="..."   extra flags for every stowage-controller run (space-separated)
#   BENCH_UPSTREAM_ARGS="..."  extra flags for every kube-controller-manager run (space-separated)
set -euo pipefail
top=$(cd "$(dirname "$0")/../.." && pwd)
cd "$top"
bench="$top/target/release/stowage-bench"
controller="$top/target/release/stowage-controller"
agent="$top/target/release/stowage-agent"
# The agent is only needed by workload `agent` (in the binary's default list, not in BENCH_WORKLOADS
# unless named).
need=(-p stowage-bench -p stowage-controller)
missing=0
{ [ -x "$bench" ] && [ -x "$controller" ]; } || missing=1
case ",${BENCH_WORKLOADS:-agent}," in
  *,agent,*) need+=(-p stowage-agent); [ -x "$agent" ] || missing=1 ;;
esac
if [ "$missing" = 1 ]; then
  echo "==> building the release binaries (${need[*]})" >&2
  cargo build --release "${need[@]}" >&2
fi
if [ ! -x "$top/e2e/bin/kube-controller-manager" ]; then
  echo "e2e/bin/kube-controller-manager not found: run \`make controlplane\` first" >&2
  exit 1
fi
# Both implementations share the machine with the apiserver and etcd: a busy machine skews every
# number, so say so up front rather than after an hour.
load=$(cut -d' ' -f1 /proc/loadavg)
if awk -v l="$load" 'BEGIN { exit !(l >= 1.0) }'; then
  echo "warning: load average is $load; numbers will be noisy (an idle machine is best)" >&2
fi
export BENCH_SIZES="${BENCH_SIZES:-full}"
mkdir -p e2e/results
echo "==> stowage-bench (sizes: $BENCH_SIZES); progress on stderr, table on stdout" >&2
"$bench" "$@" | tee e2e/results/latest.md
