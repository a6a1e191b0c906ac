//! The 3-minute soak profile, run by `cargo test --workspace` (so by `make test`): three
//! controller replicas, two kubelet-less agents, the seeded churn and every fault kind at least
//! once; no invariant violated, nothing leaked. `STOWAGE_SOAK_SEED` replays a run.

use std::path::Path;
use std::time::Duration;

use stowage_soak::faults::KINDS;

#[test]
fn three_minute_soak_keeps_every_invariant_and_leaks_nothing() {
    let seed = std::env::var("STOWAGE_SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let results = Path::new(env!("CARGO_MANIFEST_DIR")).join("../results");
    let opts = stowage_soak::Options::profile(seed, Duration::from_secs(180), results);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let summary = rt.block_on(stowage_soak::run(opts));
    rt.shutdown_timeout(Duration::from_secs(5));
    let text = summary.render();
    println!("{text}");
    assert!(summary.error.is_none(), "the soak could not run:\n{text}");
    let c = &summary.counters;
    // A process that exited on its own and a panic (in a log, or in the soak itself) are
    // violations too.
    assert!(c.violations.is_empty(), "invariants violated:\n{text}");
    assert!(c.leaks.is_empty(), "leaks:\n{text}");
    for kind in KINDS {
        assert!(
            c.faults.get(kind).copied().unwrap_or(0) >= 1,
            "fault {kind} was never injected:\n{text}"
        );
    }
    // The run did work worth judging: data written and read back across pod starts and moves,
    // volumes grown while mounted and followed to their new size, nodes drained and shut down
    // and partitioned (the workload forces the last four when the dice did not), and each
    // invariant evaluated.
    for op in [
        "create-claim",
        "start-pod",
        "pod-verified",
        "move-pod",
        "delete-claim",
        "expand-online",
        "expansion-finished",
        "drain",
        "out-of-service-taint",
        "partition",
    ] {
        assert!(
            c.operations.get(op).copied().unwrap_or(0) >= 1,
            "no {op}:\n{text}"
        );
    }
    for check in [
        "volume-claimed-once",
        "bound-claim-volume-points-back",
        "no-detach-while-in-use",
        "single-writer-attachment",
        "single-writer-mount",
        "single-writer-loop-device",
        "pattern-intact",
        "partition-fenced",
        "fs-uuid-unchanged",
        "fs-grown-with-claim",
        "expansion-reached-size",
        "retain-keeps-data",
        "no-leak-after-quiescence",
        "no-panic-in-logs",
    ] {
        assert!(
            c.checks.get(check).copied().unwrap_or(0) >= 1,
            "{check} never ran:\n{text}"
        );
    }
    assert!(
        c.restarts.values().sum::<u64>() >= 2,
        "killed processes were restarted by the soak:\n{text}"
    );
}
