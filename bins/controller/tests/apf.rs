//! The controller under a tight API Priority and Fairness priority level: with its default
//! (adaptive) client limiter it backs off when the apiserver answers 429, so 429s stay a small
//! share of its requests and there is no retry storm, and every claim still binds. The same
//! workload with the limiter lifted draws a larger share of 429s: the back-off is the limiter's.

use std::time::Duration;

use futures::{StreamExt, stream};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::flowcontrol::v1::{FlowSchema, PriorityLevelConfiguration};
use kube::Api;
use kube::api::PostParams;
use stowage_testkit::binary::Running;
use stowage_testkit::builders::{pv, pvc};
use stowage_testkit::{ControlPlane, eventually};

/// Pairs per run: enough that start-up lists are a small part of the traffic.
const N: usize = 300;
const SA: (&str, &str) = ("kube-system", "stowage-controller");
/// How long the comparison run without a limiter gets.
const LIFTED_WINDOW: Duration = Duration::from_secs(60);

/// One seat-share among the defaults' ~245 gives 3 seats of the apiserver's 600; no borrowing
/// and Reject, so every request over 3 at once is answered 429 at once.
async fn tight_priority_level(client: kube::Client) {
    let pp = PostParams::default();
    let level: PriorityLevelConfiguration = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "stowage-tight"},
        "spec": {"type": "Limited", "limited": {
            "nominalConcurrencyShares": 1, "lendablePercent": 0, "borrowingLimitPercent": 0,
            "limitResponse": {"type": "Reject"}}},
    }))
    .unwrap();
    Api::<PriorityLevelConfiguration>::all(client.clone())
        .create(&pp, &level)
        .await
        .unwrap();
    let schema: FlowSchema = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "stowage-tight"},
        "spec": {
            "priorityLevelConfiguration": {"name": "stowage-tight"},
            "matchingPrecedence": 100,
            "distinguisherMethod": {"type": "ByUser"},
            "rules": [{
                "subjects": [{"kind": "ServiceAccount",
                              "serviceAccount": {"namespace": SA.0, "name": SA.1}}],
                "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                                   "clusterScope": true, "namespaces": ["*"]}],
                "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
            }],
        },
    }))
    .unwrap();
    let schemas: Api<FlowSchema> = Api::all(client);
    schemas.create(&pp, &schema).await.unwrap();
    // The apiserver's configuration controller marks the schema once it has taken it in.
    eventually(Duration::from_secs(60), || async {
        let s = schemas.get("stowage-tight").await.map_err(|e| e.to_string())?;
        let dangling = s
            .status
            .and_then(|st| st.conditions)
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.type_.as_deref() == Some("Dangling"))
            .and_then(|c| c.status);
        if dangling.as_deref() == Some("False") {
            Ok(())
        } else {
            Err(format!("flow schema not taken in yet (Dangling={dangling:?})"))
        }
    })
    .await;
}

struct Outcome {
    requests: f64,
    throttled: f64,
    cuts: f64,
    /// Updates the apiserver accepted (PUT 200).
    puts: f64,
    /// Where the requests went, and the binder's own counts: what a failed bound is read from.
    breakdown: String,
}

impl Outcome {
    fn share(&self) -> f64 {
        self.throttled / self.requests.max(1.0)
    }
}

/// Creates N fresh pairs, runs the binder as the service account until all of them are Bound,
/// and returns what its own client saw. Without `must_converge` (the comparison run with the
/// limiter lifted, whose rejected writes fall into minutes-long per-object backoff), the run ends
/// after `LIFTED_WINDOW` whatever is bound by then: only its share of 429s is compared.
async fn bind_batch(
    cp: &ControlPlane,
    kubeconfig: &std::path::Path,
    prefix: &str,
    limit: &[&str],
    must_converge: bool,
) -> Outcome {
    let client = cp.client().await;
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "default");
    let class = format!("{prefix}-class");
    stream::iter(0..N)
        .map(|i| {
            let (pvs, claims, class) = (pvs.clone(), claims.clone(), class.clone());
            async move {
                let pp = PostParams::default();
                pvs.create(&pp, &pv(&format!("{prefix}-v{i:03}")).class(&class).build())
                    .await
                    .unwrap();
                claims
                    .create(
                        &pp,
                        &pvc("default", &format!("{prefix}-c{i:03}")).class(&class).build(),
                    )
                    .await
                    .unwrap();
            }
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await;

    let images = tempfile::tempdir().unwrap();
    let mut args = vec![
        format!("--kubeconfig={}", kubeconfig.display()),
        "--controllers=binder".into(),
        "--leader-elect=false".into(),
        format!("--image-dir={}", images.path().display()),
    ];
    args.extend(limit.iter().map(|s| s.to_string()));
    let mut controller = Running::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_stowage-controller")),
        &args,
        cp.dir(),
        prefix,
    )
    .unwrap();
    let window = if must_converge {
        Duration::from_secs(300)
    } else {
        LIFTED_WINDOW
    };
    let deadline = std::time::Instant::now() + window;
    loop {
        let list = claims.list(&Default::default()).await.unwrap();
        let bound = list
            .items
            .iter()
            .filter(|c| c.metadata.name.as_deref().is_some_and(|n| n.starts_with(prefix)))
            .filter(|c| c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound"))
            .count();
        if bound == N {
            break;
        }
        if std::time::Instant::now() > deadline && !must_converge {
            break;
        }
        if std::time::Instant::now() > deadline {
            let m = controller.metrics().unwrap_or_default();
            let log = controller.log_text();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            panic!(
                "{bound}/{N} bound ({prefix}) after 300 s; requests {:?}, cuts {}, window {:?}\n{}",
                m.samples.get("rest_client_requests_total"),
                m.sum("stowage_api_client_limit_cuts_total"),
                m.value("stowage_api_client_concurrency_limit"),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let m = controller.metrics().unwrap();
    controller.sigkill();
    let series = m
        .samples
        .get("rest_client_requests_total")
        .cloned()
        .unwrap_or_default();
    let throttled = series
        .iter()
        .filter(|(l, _)| l.get("code").map(String::as_str) == Some("429"))
        .map(|(_, v)| v)
        .sum();
    let mut breakdown: Vec<String> = series
        .iter()
        .map(|(l, v)| {
            let label = |k: &str| l.get(k).map(String::as_str).unwrap_or("?").to_string();
            format!("{} {}: {v}", label("method"), label("code"))
        })
        .collect();
    for family in [
        "stowage_binder_reconcile_total",
        "stowage_binder_reconcile_errors_total",
        "stowage_binder_warning_events_total",
    ] {
        for (l, v) in m.samples.get(family).into_iter().flatten() {
            let labels: Vec<String> = l.iter().map(|(k, x)| format!("{k}={x}")).collect();
            breakdown.push(format!("{family}{{{}}}: {v}", labels.join(",")));
        }
    }
    Outcome {
        requests: m.sum("rest_client_requests_total"),
        throttled,
        cuts: m.sum("stowage_api_client_limit_cuts_total"),
        puts: m.sum_where(
            "rest_client_requests_total",
            &[("method", "PUT"), ("code", "200")],
        ),
        breakdown: breakdown.join("\n"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_tight_priority_level_the_adaptive_limiter_backs_off_and_every_claim_binds() {
    let cp = tokio::task::spawn_blocking(ControlPlane::start)
        .await
        .unwrap()
        .unwrap();
    let kubeconfig = cp.service_account_kubeconfig(SA.0, SA.1).await.unwrap();
    tight_priority_level(cp.client().await).await;

    let adaptive = bind_batch(&cp, &kubeconfig, "adaptive", &[], true).await;
    let lifted = bind_batch(&cp, &kubeconfig, "lifted", &["--kube-api-qps=0"], false).await;
    eprintln!(
        "adaptive: {} requests, {} answered 429 ({:.1} %), {} cuts; lifted: {} requests, {} answered 429 ({:.1} %)",
        adaptive.requests,
        adaptive.throttled,
        100.0 * adaptive.share(),
        adaptive.cuts,
        lifted.requests,
        lifted.throttled,
        100.0 * lifted.share()
    );

    // The level did throttle the controller, and the limiter answered by cutting its rate.
    assert!(
        adaptive.cuts >= 1.0,
        "the tight level never throttled the controller"
    );
    assert!(
        adaptive.share() <= 0.04,
        "429s are a small share with the adaptive limiter: {:.1} %",
        100.0 * adaptive.share()
    );
    // No storm. A fresh pair is at most 6 writes: its volume's first sync marks it Available,
    // its claim's first sync finds no Available volume yet (the claims waiting to bind are synced
    // first) and records Pending, as upstream's does, and the bind is 4. No write is repeated, and
    // lists, watches, events and the throttled requests' retries stay within 200 more in all.
    assert!(
        adaptive.puts <= (6 * N) as f64,
        "{} successful updates for {N} binds (a write repeated):\n{}",
        adaptive.puts,
        adaptive.breakdown
    );
    assert!(
        adaptive.requests <= (6 * N + 200) as f64,
        "{} requests for {N} binds:\n{}",
        adaptive.requests,
        adaptive.breakdown
    );
    assert_eq!(lifted.cuts, 0.0, "a lifted limit never adapts");
    assert!(
        lifted.share() > adaptive.share(),
        "without the limiter's back-off the level rejects a larger share ({:.1} % vs {:.1} %)",
        100.0 * lifted.share(),
        100.0 * adaptive.share()
    );
}
