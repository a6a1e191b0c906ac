//! Leader failover in the middle of a 200-claim burst: every claim ends Bound, no volume holds
//! two claims, and nothing the first leader half-wrote is left inconsistent. And the standby
//! while it waits: warm (caches full, no writes) or cold (nothing held), then its takeover.

use std::collections::HashMap;
use std::time::Duration;

use futures::{StreamExt, stream};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::Api;
use kube::api::PostParams;
use stowage_testkit::binary::Running;
use stowage_testkit::builders::{pv, pvc};
use stowage_testkit::{ControlPlane, eventually};

const N: usize = 200;

fn replica(cp: &ControlPlane, id: &str, images: &std::path::Path) -> Running {
    replica_with(cp, id, images, &[])
}

/// `extra` may name another `--kubeconfig=` (a replica user's, for the audit log).
fn replica_with(cp: &ControlPlane, id: &str, images: &std::path::Path, extra: &[&str]) -> Running {
    let kubeconfig = extra
        .iter()
        .find(|a| a.starts_with("--kubeconfig="))
        .map(|a| a.to_string())
        .unwrap_or_else(|| format!("--kubeconfig={}", cp.kubeconfig().display()));
    let mut args = vec![
        kubeconfig,
        "--controllers=binder".into(),
        "--leader-elect-resource-namespace=default".into(),
        format!("--leader-elect-identity={id}"),
        "--leader-elect-lease-duration=4s".into(),
        "--leader-elect-renew-deadline=3s".into(),
        "--leader-elect-retry-period=1s".into(),
        // Slow enough that the kill lands mid-burst on any machine.
        "--kube-api-qps=40".into(),
        "--kube-api-burst=40".into(),
        format!("--image-dir={}", images.display()),
    ];
    args.extend(
        extra
            .iter()
            .filter(|a| !a.starts_with("--kubeconfig="))
            .map(|a| a.to_string()),
    );
    Running::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_stowage-controller")),
        &args,
        cp.dir(),
        id,
    )
    .unwrap()
}

fn leads(r: &Running) -> bool {
    gauge(r, "stowage_leader") == Some(1.0)
}

fn gauge(r: &Running, name: &str) -> Option<f64> {
    r.metrics().ok().and_then(|m| m.value(name))
}

/// Requests other than reads this replica sent (its client metrics, lease renewals included).
fn writes(r: &Running) -> f64 {
    let m = r.metrics().unwrap();
    ["POST", "PUT", "PATCH", "DELETE"]
        .iter()
        .map(|v| m.sum_where("rest_client_requests_total", &[("method", v)]))
        .sum()
}

/// A control plane of the test's own (the standbys' write counts are theirs alone), an image
/// dir, and the PV and claim APIs.
async fn world() -> (
    ControlPlane,
    tempfile::TempDir,
    kube::Client,
    Api<PersistentVolume>,
    Api<PersistentVolumeClaim>,
) {
    let cp = tokio::task::spawn_blocking(ControlPlane::start)
        .await
        .unwrap()
        .unwrap();
    let client = cp.client().await;
    let pvs = Api::all(client.clone());
    let claims = Api::namespaced(client.clone(), "default");
    (cp, tempfile::tempdir().unwrap(), client, pvs, claims)
}

/// N volumes and N claims of `class`, named `<pv>NNN` and `<claim>NNN`, 32 creates in flight.
async fn burst(
    pvs: &Api<PersistentVolume>,
    claims: &Api<PersistentVolumeClaim>,
    (pv_prefix, claim_prefix): (&str, &str),
    class: &str,
) {
    stream::iter(0..N)
        .map(|i| async move {
            let pp = PostParams::default();
            pvs.create(&pp, &pv(&format!("{pv_prefix}{i:03}")).class(class).build())
                .await
                .unwrap();
            claims
                .create(
                    &pp,
                    &pvc("default", &format!("{claim_prefix}{i:03}"))
                        .class(class)
                        .build(),
                )
                .await
                .unwrap();
        })
        .buffer_unordered(32)
        .collect::<Vec<_>>()
        .await;
}

/// How many claims are `Bound`.
async fn bound_count(claims: &Api<PersistentVolumeClaim>) -> Result<usize, String> {
    let list = claims
        .list(&Default::default())
        .await
        .map_err(|e| e.to_string())?;
    Ok(list
        .items
        .iter()
        .filter(|c| c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound"))
        .count())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_mid_burst_binds_every_claim_exactly_once() {
    let (cp, images, _client, pvs, claims) = world().await;
    let mut a = replica(&cp, "a", images.path());
    let mut b = replica(&cp, "b", images.path());
    eventually(Duration::from_secs(60), || async {
        if leads(&a) || leads(&b) {
            Ok(())
        } else {
            Err("no leader yet".to_string())
        }
    })
    .await;

    burst(&pvs, &claims, ("v", "c"), "burst").await;

    // Kill the leader once binding is under way but far from done.
    let at_kill = eventually(Duration::from_secs(120), || async {
        let n = bound_count(&claims).await?;
        if n >= 10 { Ok(n) } else { Err(format!("{n} bound")) }
    })
    .await;
    let (killed, survivor) = if leads(&a) { (&mut a, &b) } else { (&mut b, &a) };
    killed.sigkill();
    assert!(
        at_kill < N,
        "the kill must land mid-burst (bound at kill: {at_kill})"
    );

    eventually(Duration::from_secs(300), || async {
        let n = bound_count(&claims).await?;
        if n == N {
            Ok(())
        } else {
            Err(format!("{n}/{N} bound"))
        }
    })
    .await;
    assert!(leads(survivor), "the survivor leads:\n{}", survivor.log_text());

    // One-to-one: every claim's volume points back at that claim, and no volume is named twice.
    let claim_list = claims.list(&Default::default()).await.unwrap().items;
    let mut owner: HashMap<String, String> = HashMap::new();
    for c in &claim_list {
        let vol = c.spec.as_ref().unwrap().volume_name.clone().unwrap();
        assert!(
            owner
                .insert(vol.clone(), c.metadata.name.clone().unwrap())
                .is_none(),
            "{vol} bound twice"
        );
        let v = pvs.get(&vol).await.unwrap();
        assert_eq!(
            v.spec.unwrap().claim_ref.unwrap().uid,
            c.metadata.uid,
            "{vol} points elsewhere"
        );
        assert_eq!(v.status.unwrap().phase.as_deref(), Some("Bound"));
    }
}

/// The writes user `user` made, in the order the apiserver received them: (time, resource).
fn audited(cp: &ControlPlane, user: &str) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(cp.audit_log()).unwrap();
    let mut out: Vec<(String, String)> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["stage"] == "ResponseComplete" && e["user"]["username"] == user)
        .map(|e| {
            (
                e["requestReceivedTimestamp"].as_str().unwrap().to_string(),
                e["objectRef"]["resource"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    // RFC 3339 in UTC with a fixed precision: text order is time order.
    out.sort();
    out
}

/// SIGTERM to a leader mid-burst: its controllers stop before it releases the Lease, so the
/// release is the last write the apiserver receives from it, and the standby binds the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_told_to_stop_releases_the_lease_after_its_last_write() {
    let (cp, images, _client, pvs, claims) = world().await;
    let (kc_a, kc_b) = (
        cp.replica_kubeconfig(0).unwrap(),
        cp.replica_kubeconfig(1).unwrap(),
    );
    let (kc_a, kc_b) = (
        format!("--kubeconfig={}", kc_a.display()),
        format!("--kubeconfig={}", kc_b.display()),
    );
    let mut a = replica_with(&cp, "a", images.path(), &[kc_a.as_str()]);
    eventually(Duration::from_secs(60), || async {
        if leads(&a) {
            Ok(())
        } else {
            Err("a does not lead yet".to_string())
        }
    })
    .await;
    let b = replica_with(&cp, "b", images.path(), &[kc_b.as_str()]);
    burst(&pvs, &claims, ("g", "g"), "graceful").await;
    eventually(Duration::from_secs(120), || async {
        let n = bound_count(&claims).await?;
        if n >= 10 { Ok(n) } else { Err(format!("{n} bound")) }
    })
    .await;
    a.sigterm();
    assert_eq!(a.wait_exit(Duration::from_secs(30)), Some(0), "{}", a.log_text());
    assert!(a.log_text().contains("released leadership"), "{}", a.log_text());
    eventually(Duration::from_secs(300), || async {
        let n = bound_count(&claims).await?;
        if n == N {
            Ok(())
        } else {
            Err(format!("{n}/{N} bound"))
        }
    })
    .await;
    assert!(leads(&b), "b took over:\n{}", b.log_text());

    let a_writes = audited(&cp, "replica-0");
    let (last_at, last) = a_writes.last().expect("a wrote nothing").clone();
    assert_eq!(last, "leases", "a's last write is its release: {a_writes:?}");
    assert!(
        a_writes.iter().any(|(_, r)| r == "persistentvolumeclaims"),
        "a bound claims before it stopped: {a_writes:?}"
    );
    // b's first write other than the Lease came after a's release.
    let b_first = audited(&cp, "replica-1")
        .into_iter()
        .find(|(_, r)| r != "leases")
        .expect("b bound the rest");
    assert!(
        b_first.0 > last_at,
        "b wrote at {} before a released at {last_at}",
        b_first.0
    );
}

/// A standby's wait and its takeover: with `warm` its caches fill while it waits and it writes
/// nothing; without, it holds no cache until it leads. Either way it binds new work after the
/// leader dies.
async fn standby_then_takeover(warm: bool) {
    let (cp, images, client, pvs, claims) = world().await;
    let leases: Api<Lease> = Api::namespaced(client.clone(), "default");
    let pair = |i: usize| {
        let (pvs, claims) = (pvs.clone(), claims.clone());
        async move {
            let pp = PostParams::default();
            pvs.create(&pp, &pv(&format!("w{i:02}")).class("standby").build())
                .await
                .unwrap();
            claims
                .create(&pp, &pvc("default", &format!("w{i:02}")).class("standby").build())
                .await
                .unwrap();
        }
    };
    let bound = |name: String| {
        let claims = claims.clone();
        async move {
            eventually(Duration::from_secs(120), || async {
                let c = claims.get(&name).await.map_err(|e| e.to_string())?;
                match c.status.and_then(|s| s.phase).as_deref() {
                    Some("Bound") => Ok(()),
                    p => Err(format!("{name}: {p:?}")),
                }
            })
            .await
        }
    };
    for i in 0..20 {
        pair(i).await;
    }
    let mut a = replica(&cp, "a", images.path());
    eventually(Duration::from_secs(60), || async {
        if leads(&a) {
            Ok(())
        } else {
            Err("a does not lead yet".to_string())
        }
    })
    .await;
    bound("w19".into()).await;

    let flag = format!("--warm-standby={warm}");
    let b = replica_with(&cp, "b", images.path(), &[flag.as_str()]);
    // b has stood for the Lease through several of a's renewals.
    let renew_time = || async {
        leases
            .get("stowage-controller")
            .await
            .ok()
            .and_then(|l| l.spec)
            .and_then(|s| s.renew_time)
            .map(|t| t.0)
    };
    eventually(Duration::from_secs(60), || async {
        if gauge(&b, "stowage_leader") == Some(0.0) {
            Ok(())
        } else {
            Err("b serves no metrics yet".to_string())
        }
    })
    .await;
    let first = renew_time().await;
    eventually(Duration::from_secs(60), || async {
        let now = renew_time().await;
        let synced = gauge(&b, "stowage_caches_synced");
        match (now != first, synced) {
            (true, Some(s)) if s == f64::from(u8::from(warm)) => Ok(()),
            _ => Err(format!(
                "lease renewed: {}, b's caches_synced {synced:?}",
                now != first
            )),
        }
    })
    .await;
    assert!(!leads(&b), "a still leads");
    assert_eq!(writes(&b), 0.0, "a standby writes nothing:\n{}", b.log_text());
    assert_eq!(
        b.log_text().contains("standby: caches synced"),
        warm,
        "{}",
        b.log_text()
    );

    a.sigkill();
    pair(20).await;
    bound("w20".into()).await;
    assert!(leads(&b), "b took over:\n{}", b.log_text());
    assert_eq!(gauge(&b, "stowage_caches_synced"), Some(1.0));
    let log = b.log_text();
    let leading = log
        .lines()
        .find(|l| l.contains("leading: caches synced"))
        .unwrap_or_else(|| panic!("b never led:\n{log}"));
    assert!(
        leading.contains(&format!("warm={warm}")) || leading.contains(&format!("\"warm\":{warm}")),
        "{leading}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_standby_fills_its_caches_while_it_waits_writes_nothing_and_takes_over() {
    standby_then_takeover(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_standby_holds_no_cache_until_it_leads() {
    standby_then_takeover(false).await;
}
