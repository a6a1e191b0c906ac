//! The CSI server records every call it answers in `csi_sidecar_operations_seconds`, the CSI
//! sidecars' family: real gRPC over the unix socket, a real stage on a loop device (run as root),
//! then a scrape of the agent's metrics endpoint.

use std::collections::BTreeMap;
use std::path::Path;

use hyper_util::rt::TokioIo;
use stowage_common::observe::serve::Health;
use stowage_loopdriver::csi::metrics::{BUCKETS, NAME};
use stowage_loopdriver::csi::server::{self, Endpoint, NodeSettings};
use stowage_loopdriver::csi::v1::controller_client::ControllerClient;
use stowage_loopdriver::csi::v1::group_controller_client::GroupControllerClient;
use stowage_loopdriver::csi::v1::identity_client::IdentityClient;
use stowage_loopdriver::csi::v1::node_client::NodeClient;
use stowage_loopdriver::csi::v1::volume_capability::access_mode::Mode;
use stowage_loopdriver::csi::v1::volume_capability::{AccessMode, AccessType, MountVolume};
use stowage_loopdriver::csi::v1::*;
use stowage_testkit::host::Cleanup;
use stowage_testkit::unique;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;
use tonic::transport::Channel;

async fn channel(socket: &Path) -> Channel {
    let socket = socket.to_path_buf();
    // The URI is not used: every connection goes to the socket.
    tonic::transport::Endpoint::from_static("http://csi.invalid")
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(socket).await?)) }
        }))
        .await
        .expect("connect to the CSI socket")
}

/// `GET /metrics` over plain HTTP/1.0.
async fn scrape(addr: std::net::SocketAddr) -> String {
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: agent\r\n\r\n")
        .await
        .unwrap();
    let mut text = String::new();
    conn.read_to_string(&mut text).await.unwrap();
    assert!(
        text.starts_with("HTTP/1.0 200") || text.starts_with("HTTP/1.1 200"),
        "{text}"
    );
    text
}

/// The samples of `name` (e.g. `..._count`), each by its labels.
fn samples(text: &str, name: &str) -> Vec<(BTreeMap<String, String>, f64)> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let Some((labels, value)) = rest.strip_prefix('{').and_then(|r| r.rsplit_once("} ")) else {
            continue;
        };
        let labels = labels
            .split("\",")
            .filter(|kv| !kv.is_empty())
            .map(|kv| {
                let (k, v) = kv.split_once("=\"").expect("label=\"value\"");
                (k.to_string(), v.trim_end_matches('"').to_string())
            })
            .collect();
        out.push((labels, value.parse().expect("a number")));
    }
    out
}

fn count(text: &str, method: &str, code: &str) -> f64 {
    let matching: Vec<_> = samples(text, &format!("{NAME}_count"))
        .into_iter()
        .filter(|(l, _)| l["method_name"] == method && l["grpc_status_code"] == code)
        .collect();
    for (l, _) in &matching {
        assert_eq!(l["driver_name"], "loop.stowage.dev", "{l:?}");
        assert_eq!(l.len(), 3, "no label beyond the sidecars' three: {l:?}");
    }
    matching.iter().map(|(_, v)| v).sum()
}

fn mount_capability() -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Mount(MountVolume::default())),
    }
}

#[tokio::test]
async fn every_csi_call_is_counted_by_method_and_grpc_code_on_the_metrics_endpoint() {
    let base = std::env::temp_dir().join(unique("stowage-csi-metrics"));
    let images = base.join("images");
    std::fs::create_dir_all(&images).unwrap();
    stowage_loopdriver::ImageStore::new(&images).init().unwrap();
    let base = std::fs::canonicalize(&base).unwrap();
    let images = std::fs::canonicalize(&images).unwrap();
    let _cleanup = Cleanup {
        base: base.clone(),
        images: images.clone(),
    };

    // As the agent's `run` builds them: one registry, the CSI histogram in it, served on /metrics.
    let registry = stowage_common::observe::metrics::registry("stowage-agent");
    let metrics = stowage_agent::metrics::Metrics::new(&registry);
    let addr = stowage_common::observe::serve::spawn("127.0.0.1:0".parse().unwrap(), Health::new(registry))
        .await
        .unwrap();
    let socket = base.join("csi.sock");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(server::serve(
        Endpoint {
            driver: stowage_loopdriver::DRIVER.into(),
            socket: socket.clone(),
            images: stowage_loopdriver::ImageStore::new(images.clone()),
            node: Some(NodeSettings {
                node_id: "metrics-node".into(),
                state_dir: base.join("root/csi"),
                max_volumes: 0,
                local: false,
            }),
            controller: true,
            metrics: Some(metrics.csi.clone()),
        },
        async move {
            let _ = stopped.await;
        },
    ));
    while !socket.exists() {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let ch = channel(&socket).await;
    let mut identity = IdentityClient::new(ch.clone());
    let mut node = NodeClient::new(ch.clone());
    let mut ctrl = ControllerClient::new(ch.clone());

    // Before any call the family has no series.
    assert_eq!(samples(&scrape(addr).await, &format!("{NAME}_count")), vec![]);

    identity.get_plugin_info(GetPluginInfoRequest {}).await.unwrap();
    ctrl.create_volume(CreateVolumeRequest {
        name: "v".into(),
        capacity_range: Some(CapacityRange {
            required_bytes: 64 << 20,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![mount_capability()],
        ..Default::default()
    })
    .await
    .unwrap();
    let stage = |id: &str| NodeStageVolumeRequest {
        volume_id: id.into(),
        staging_target_path: base.join("stage").display().to_string(),
        volume_capability: Some(mount_capability()),
        ..Default::default()
    };
    // Bad requests: no volume id (InvalidArgument, twice), a volume with no image (NotFound).
    for _ in 0..2 {
        let e = node.node_stage_volume(stage("")).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    }
    let e = node.node_stage_volume(stage("missing")).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    // A real stage: loop device, mkfs, mount.
    node.node_stage_volume(stage("v")).await.unwrap();
    node.node_unstage_volume(NodeUnstageVolumeRequest {
        volume_id: "v".into(),
        staging_target_path: base.join("stage").display().to_string(),
    })
    .await
    .unwrap();
    ctrl.delete_volume(DeleteVolumeRequest {
        volume_id: "v".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    // Not implemented by a served service: counted. A service not served: not a CSI call here.
    let e = ctrl
        .list_volumes(ListVolumesRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented);
    let e = GroupControllerClient::new(ch.clone())
        .group_controller_get_capabilities(GroupControllerGetCapabilitiesRequest {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented);

    let text = scrape(addr).await;
    let counted = |method: &str, code: &str| count(&text, method, code);
    assert_eq!(counted("/csi.v1.Identity/GetPluginInfo", "OK"), 1.0);
    assert_eq!(counted("/csi.v1.Controller/CreateVolume", "OK"), 1.0);
    assert_eq!(counted("/csi.v1.Node/NodeStageVolume", "InvalidArgument"), 2.0);
    assert_eq!(counted("/csi.v1.Node/NodeStageVolume", "NotFound"), 1.0);
    assert_eq!(counted("/csi.v1.Node/NodeStageVolume", "OK"), 1.0);
    assert_eq!(counted("/csi.v1.Node/NodeUnstageVolume", "OK"), 1.0);
    assert_eq!(counted("/csi.v1.Controller/DeleteVolume", "OK"), 1.0);
    assert_eq!(counted("/csi.v1.Controller/ListVolumes", "Unimplemented"), 1.0);
    let all = samples(&text, &format!("{NAME}_count"));
    assert_eq!(
        all.len(),
        8,
        "one series per (method, code) called, none else: {all:?}"
    );

    // The sidecars' buckets, and the stage's time in them.
    let buckets: Vec<_> = samples(&text, &format!("{NAME}_bucket"))
        .into_iter()
        .filter(|(l, _)| l["method_name"] == "/csi.v1.Node/NodeStageVolume" && l["grpc_status_code"] == "OK")
        .collect();
    let les: Vec<String> = buckets.iter().map(|(l, _)| l["le"].clone()).collect();
    let mut want: Vec<String> = BUCKETS.iter().map(|b| b.to_string()).collect();
    want.push("+Inf".into());
    assert_eq!(les, want);
    assert_eq!(buckets.last().unwrap().1, 1.0);
    let sum = samples(&text, &format!("{NAME}_sum"))
        .into_iter()
        .find(|(l, _)| l["method_name"] == "/csi.v1.Node/NodeStageVolume" && l["grpc_status_code"] == "OK")
        .unwrap()
        .1;
    assert!(sum > 0.0, "a mkfs and a mount take time: {sum}");

    drop(ch);
    let _ = stop.send(());
    served.await.unwrap().unwrap();
}
