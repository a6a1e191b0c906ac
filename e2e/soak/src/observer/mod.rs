//! The observer: watches claims, volumes, VolumeAttachments and Nodes itself (it never reads the
//! controllers' metrics) and checks the storage invariants on what it saw.
//!
//! Every object keeps its history as `(resourceVersion, state)`. Within one watch stream events
//! arrive in resourceVersion order, and all kinds share etcd's revision counter, so the state of
//! any object at any revision is known once every stream involved has delivered past it (its
//! *frontier*). Checks that span two kinds (a claim and its volume, an attachment and its node)
//! are only decided up to the lowest frontier involved, so a watch that simply lags behind another
//! is never mistaken for a violation. When a watch had to list again (after an apiserver or etcd
//! restart), what happened in the gap is unknown and is not judged.
//!
//! `history` keeps what each watch saw, `snap` reads the objects, `checks` holds the claim and
//! attachment invariants, `detach` the in-use rule for deleted attachments.

mod checks;
mod detach;
mod history;
mod snap;
#[cfg(test)]
mod test_support;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, Resource, ResourceExt};

pub use history::{St, Stream, state_at};
pub use snap::{ClaimSnap, NodeSnap, OUT_OF_SERVICE, PvSnap, VaSnap};
use snap::{claim_snap, node_snap, pv_snap, rv_of, va_snap};

use crate::report::Record;

#[derive(Default)]
pub struct Seen {
    pub claims: Stream<ClaimSnap>,
    pub pvs: Stream<PvSnap>,
    pub vas: Stream<VaSnap>,
    pub nodes: Stream<NodeSnap>,
    /// Attachments whose deletion was already judged.
    judged_va: HashSet<String>,
    /// Bound claims were judged for every revision up to this one.
    bound_judged_to: u64,
}

pub struct Observer {
    pub seen: Mutex<Seen>,
    record: Arc<Record>,
}

impl Observer {
    pub fn new(record: Arc<Record>) -> Arc<Self> {
        Arc::new(Self {
            seen: Mutex::new(Seen::default()),
            record,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every watch has listed once.
    pub fn synced(&self) -> bool {
        let s = self.lock();
        s.claims.synced && s.pvs.synced && s.vas.synced && s.nodes.synced
    }

    /// The `<driver>^<handle>` of volume `pv`, from any state seen.
    pub fn unique_of(&self, pv: &str) -> Option<String> {
        let s = self.lock();
        s.pvs.hist.get(pv).and_then(|h| {
            h.iter().rev().find_map(|(_, st)| match st {
                St::Present(p) => p.unique.clone(),
                _ => None,
            })
        })
    }

    /// The highest revision every stream has delivered.
    pub fn frontier(&self) -> u64 {
        let s = self.lock();
        s.claims.frontier.min(s.pvs.frontier).min(s.nodes.frontier)
    }

    /// Starts the four watches; they retry with backoff through apiserver and etcd outages.
    pub fn spawn(self: &Arc<Self>, client: Client) -> Vec<tokio::task::JoinHandle<()>> {
        let mut tasks = Vec::new();
        {
            let me = self.clone();
            let api: Api<PersistentVolumeClaim> = Api::all(client.clone());
            tasks.push(tokio::spawn(async move {
                me.watch(api, "pvc", |me, ev| me.on_claim(ev)).await
            }));
        }
        {
            let me = self.clone();
            let api: Api<PersistentVolume> = Api::all(client.clone());
            tasks.push(tokio::spawn(async move {
                me.watch(api, "pv", |me, ev| me.on_pv(ev)).await
            }));
        }
        {
            let me = self.clone();
            let api: Api<VolumeAttachment> = Api::all(client.clone());
            tasks.push(tokio::spawn(async move {
                me.watch(api, "va", |me, ev| me.on_va(ev)).await
            }));
        }
        {
            let me = self.clone();
            let api: Api<Node> = Api::all(client);
            tasks.push(tokio::spawn(async move {
                me.watch(api, "node", |me, ev| me.on_node(ev)).await
            }));
        }
        tasks
    }

    async fn watch<K>(self: Arc<Self>, api: Api<K>, kind: &str, handle: fn(&Self, Event<K>))
    where
        K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
        K::DynamicType: Default,
    {
        let mut stream = watcher::watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        while let Some(ev) = stream.next().await {
            match ev {
                Ok(ev) => handle(&self, ev),
                Err(e) => self.record.log(
                    "watch-error",
                    serde_json::json!({"kind": kind, "error": e.to_string()}),
                ),
            }
        }
    }

    fn on_claim(&self, ev: Event<PersistentVolumeClaim>) {
        let mut s = self.lock();
        match ev {
            Event::Init => s.claims.begin_list(),
            Event::InitDone => {
                s.claims.end_list();
                self.check_claim_names(&s);
            }
            Event::InitApply(c) | Event::Apply(c) => {
                let snap = claim_snap(&c);
                let rv = rv_of(&c);
                if !s.claims.listing() && !c.name_any().starts_with("soak-ticker") {
                    self.record.log(
                        "pvc",
                        serde_json::json!({"rv": rv, "name": snap.name, "phase": snap.phase, "volume": snap.volume, "deleting": c.metadata.deletion_timestamp.is_some()}),
                    );
                }
                s.claims.apply(&c.uid().unwrap_or_default(), rv, snap);
                if !s.claims.listing() {
                    self.check_claim_names(&s);
                }
            }
            Event::Delete(c) => {
                let rv = rv_of(&c);
                self.record.log(
                    "pvc-deleted",
                    serde_json::json!({"rv": rv, "name": format!("{}/{}", c.namespace().unwrap_or_default(), c.name_any())}),
                );
                s.claims.delete(&c.uid().unwrap_or_default(), rv);
            }
        }
    }

    fn on_pv(&self, ev: Event<PersistentVolume>) {
        let mut s = self.lock();
        match ev {
            Event::Init => s.pvs.begin_list(),
            Event::InitDone => s.pvs.end_list(),
            Event::InitApply(p) | Event::Apply(p) => {
                let snap = pv_snap(&p);
                let rv = rv_of(&p);
                if !s.pvs.listing() && !p.name_any().starts_with("soak-ticker") {
                    self.record.log(
                        "pv",
                        serde_json::json!({"rv": rv, "name": p.name_any(), "phase": snap.phase, "claim": snap.claim}),
                    );
                }
                s.pvs.apply(&p.name_any(), rv, snap);
            }
            Event::Delete(p) => {
                let rv = rv_of(&p);
                self.record
                    .log("pv-deleted", serde_json::json!({"rv": rv, "name": p.name_any()}));
                s.pvs.delete(&p.name_any(), rv);
            }
        }
    }

    fn on_va(&self, ev: Event<VolumeAttachment>) {
        let mut s = self.lock();
        match ev {
            Event::Init => s.vas.begin_list(),
            Event::InitDone => {
                s.vas.end_list();
                self.check_single_writer(&s);
            }
            Event::InitApply(v) | Event::Apply(v) => {
                let snap = va_snap(&v);
                let rv = rv_of(&v);
                if !s.vas.listing() {
                    self.record.log(
                        "va",
                        serde_json::json!({"rv": rv, "name": snap.name, "node": snap.node, "pv": snap.pv, "attached": snap.attached, "deleting": snap.deleting}),
                    );
                }
                s.vas.apply(&v.uid().unwrap_or_default(), rv, snap);
                if !s.vas.listing() {
                    self.check_single_writer(&s);
                }
            }
            Event::Delete(v) => {
                let rv = rv_of(&v);
                self.record
                    .log("va-deleted", serde_json::json!({"rv": rv, "name": v.name_any()}));
                s.vas.delete(&v.uid().unwrap_or_default(), rv);
            }
        }
    }

    fn on_node(&self, ev: Event<Node>) {
        let mut s = self.lock();
        match ev {
            Event::Init => s.nodes.begin_list(),
            Event::InitDone => s.nodes.end_list(),
            Event::InitApply(n) | Event::Apply(n) => {
                let snap = node_snap(&n);
                let rv = rv_of(&n);
                let changed = s
                    .nodes
                    .hist
                    .get(&n.name_any())
                    .and_then(|h| h.last())
                    .is_none_or(|(_, st)| *st != St::Present(snap.clone()));
                if changed && !s.nodes.listing() && !n.name_any().starts_with("soak-ticker") {
                    self.record.log(
                        "node",
                        serde_json::json!({"rv": rv, "name": n.name_any(), "volumesInUse": snap.in_use, "volumesAttached": snap.attached, "outOfService": snap.out_of_service}),
                    );
                }
                s.nodes.apply(&n.name_any(), rv, snap);
            }
            Event::Delete(n) => {
                let rv = rv_of(&n);
                s.nodes.delete(&n.name_any(), rv);
            }
        }
    }
}
