//! The API client speaks HTTP/2 to the real apiserver, so a burst of requests shares one
//! connection instead of opening (and TLS-handshaking) one per request in flight.

use std::collections::HashSet;

use futures::{StreamExt, stream};
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use stowage_common::api::client::ApiArgs;
use stowage_common::api::ratelimit::Limit;
use stowage_testkit::ControlPlane;

/// Socket inodes of this process.
fn own_sockets() -> HashSet<u64> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            l.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
        })
        .collect()
}

/// Established TCP connections of this process to `port`.
fn connections_to(port: u16) -> usize {
    let ours = own_sockets();
    ["/proc/self/net/tcp", "/proc/self/net/tcp6"]
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .flat_map(|t| t.lines().skip(1).map(str::to_string).collect::<Vec<_>>())
        .filter(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let remote_port = f
                .get(2)
                .and_then(|r| r.rsplit(':').next())
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            let established = f.get(3) == Some(&"01");
            let inode = f.get(9).and_then(|i| i.parse::<u64>().ok());
            established && remote_port == Some(port) && inode.is_some_and(|i| ours.contains(&i))
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_requests_shares_one_http2_connection() {
    let cp = tokio::task::spawn_blocking(ControlPlane::start)
        .await
        .unwrap()
        .expect("control plane");
    let args = ApiArgs {
        kubeconfig: Some(cp.kubeconfig()),
        kube_api_qps: Some(0.0),
        kube_api_burst: 100,
        kube_api_content_type: stowage_common::api::client::ContentType::Json,
    };
    let client = args.client(Limit::Unlimited).await.expect("client");

    let res = client
        .send(
            http::Request::get("/version")
                .body(kube::client::Body::empty())
                .unwrap(),
        )
        .await
        .expect("GET /version");
    assert_eq!(
        res.version(),
        http::Version::HTTP_2,
        "the apiserver offers HTTP/2; the client must take it"
    );

    // 200 requests in flight at once: over HTTP/1.1 each would hold a connection of its own.
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let answered = stream::iter(0..200)
        .map(|_| {
            let api = namespaces.clone();
            async move { api.get("default").await.is_ok() }
        })
        .buffer_unordered(200)
        .filter(|ok| std::future::ready(*ok))
        .count()
        .await;
    assert_eq!(answered, 200);
    let open = connections_to(cp.port());
    assert!(
        (1..=2).contains(&open),
        "{open} connections to the apiserver after a burst of 200 requests (HTTP/2 multiplexes them on one)"
    );
}
