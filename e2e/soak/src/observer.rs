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

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, Resource, ResourceExt};

use crate::report::Record;

#[derive(Clone, Debug, PartialEq)]
pub enum St<T> {
    Present(T),
    Gone,
    /// The watch had a gap: the object may have changed in ways not seen.
    Unknown,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ClaimSnap {
    pub name: String,
    pub volume: Option<String>,
    pub phase: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct PvSnap {
    pub claim_uid: Option<String>,
    pub claim: Option<String>,
    pub phase: Option<String>,
    /// `<driver>^<handle>` for CSI volumes.
    pub unique: Option<String>,
    pub read_only: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct VaSnap {
    pub name: String,
    pub node: String,
    pub pv: Option<String>,
    pub attached: bool,
    pub deleting: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct NodeSnap {
    pub in_use: BTreeSet<String>,
    /// `status.volumesAttached` names (written by the attach/detach controller).
    pub attached: BTreeSet<String>,
    pub out_of_service: bool,
}

/// One kind's histories, keyed by UID (claims, attachments) or name (volumes, nodes).
pub struct Stream<T> {
    pub hist: HashMap<String, Vec<(u64, St<T>)>>,
    /// Every change with a resourceVersion up to this one has been seen.
    pub frontier: u64,
    listing: Option<HashMap<String, (u64, T)>>,
    /// The first list is complete.
    pub synced: bool,
    /// Revision ranges the watch did not see (lost, then relisted): an object created and deleted
    /// inside one is in no history at all.
    gaps: Vec<(u64, u64)>,
    /// A gap still open: from here until the first change after the relist.
    open_gap: Option<u64>,
}

impl<T: Clone + PartialEq> Default for Stream<T> {
    fn default() -> Self {
        Self {
            hist: HashMap::new(),
            frontier: 0,
            listing: None,
            synced: false,
            gaps: Vec::new(),
            open_gap: None,
        }
    }
}

impl<T: Clone + PartialEq> Stream<T> {
    fn push(&mut self, key: &str, rv: u64, st: St<T>) {
        let h = self.hist.entry(key.to_string()).or_default();
        if h.last().is_some_and(|(r, s)| *r >= rv && *s == st) {
            return;
        }
        h.push((rv, st));
    }

    pub fn apply(&mut self, key: &str, rv: u64, snap: T) {
        if let Some(list) = self.listing.as_mut() {
            list.insert(key.to_string(), (rv, snap));
            return;
        }
        self.close_gap(rv);
        self.push(key, rv, St::Present(snap));
        self.frontier = self.frontier.max(rv);
    }

    pub fn delete(&mut self, key: &str, rv: u64) {
        self.close_gap(rv);
        self.push(key, rv, St::Gone);
        self.frontier = self.frontier.max(rv);
    }

    /// The first change after a relist: the watch saw everything from its list on, so nothing
    /// between the list and this change was missed (the list's own revision is not known here).
    fn close_gap(&mut self, rv: u64) {
        if let Some(g) = self.open_gap.take() {
            self.gaps.push((g, rv.saturating_sub(1)));
        }
    }

    /// Whether every revision in `[from, until)` fell in a gap (nothing can be said of them).
    pub fn unseen(&self, from: u64, until: u64) -> bool {
        let mut x = from;
        while x < until {
            if self.open_gap.is_some_and(|g| g <= x) {
                return true;
            }
            match self
                .gaps
                .iter()
                .filter(|(a, b)| *a <= x && x <= *b)
                .map(|(_, b)| *b)
                .max()
            {
                Some(end) => x = end.saturating_add(1),
                None => return false,
            }
        }
        true
    }

    pub fn begin_list(&mut self) {
        self.listing = Some(HashMap::new());
        // Changes after the last one seen may be missing until the relist is followed.
        self.open_gap.get_or_insert(self.frontier + 1);
    }

    /// A fresh list replaces what is known: objects that changed or vanished while the watch was
    /// away are Unknown from just after their last seen version.
    pub fn end_list(&mut self) {
        let Some(list) = self.listing.take() else {
            return;
        };
        self.synced = true;
        let mut newest = self.frontier;
        for (key, h) in self.hist.iter_mut() {
            let last = h.last().map(|(r, _)| *r).unwrap_or(0);
            let still_gone = matches!(h.last(), Some((_, St::Gone))) && !list.contains_key(key);
            let same = list.get(key).is_some_and(|(rv, _)| *rv == last);
            if !still_gone && !same && !matches!(h.last(), Some((_, St::Unknown))) {
                h.push((last + 1, St::Unknown));
            }
        }
        // An object first seen in this list may have existed, in other states, since the watch
        // was lost: unknown from then until the version listed.
        let gap_start = self.frontier + 1;
        for (key, (rv, snap)) in list {
            newest = newest.max(rv);
            let h = self.hist.entry(key).or_default();
            if h.is_empty() && gap_start < rv {
                h.push((gap_start, St::Unknown));
            }
            let last = h.last().map(|(r, _)| *r).unwrap_or(0);
            if rv > last || h.is_empty() {
                h.push((rv, St::Present(snap)));
            }
        }
        self.frontier = newest;
    }

    pub fn listing(&self) -> bool {
        self.listing.is_some()
    }

    /// The latest state of every object.
    pub fn current(&self) -> impl Iterator<Item = (&String, &St<T>)> {
        self.hist
            .iter()
            .filter_map(|(k, h)| h.last().map(|(_, s)| (k, s)))
    }
}

/// Whether the run of node revisions up to `rv` that list `volume` in `volumesInUse` began at
/// one that also listed it in `volumesAttached` (or cannot be told apart: an unknown stretch, or
/// the history's start, count as listed).
fn in_use_while_listed(h: &[(u64, St<NodeSnap>)], rv: u64, volume: &str) -> bool {
    let mut start: Option<&NodeSnap> = None;
    for (_, st) in h
        .iter()
        .take_while(|(r, _)| *r <= rv)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
    {
        match st {
            St::Present(n) if n.in_use.contains(volume) => start = Some(n),
            St::Present(_) => break,
            St::Gone | St::Unknown => return true,
        }
    }
    start.is_none_or(|n| n.attached.contains(volume))
}

/// The state of history `h` at revision `rv`: `None` when nothing was known then.
pub fn state_at<T>(h: &[(u64, St<T>)], rv: u64) -> Option<&St<T>> {
    h.iter().take_while(|(r, _)| *r <= rv).last().map(|(_, s)| s)
}

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

fn rv_of<K: Resource>(o: &K) -> u64 {
    o.meta()
        .resource_version
        .as_deref()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0)
}

pub const OUT_OF_SERVICE: &str = "node.kubernetes.io/out-of-service";

fn claim_snap(c: &PersistentVolumeClaim) -> ClaimSnap {
    ClaimSnap {
        name: format!("{}/{}", c.namespace().unwrap_or_default(), c.name_any()),
        volume: c
            .spec
            .as_ref()
            .and_then(|s| s.volume_name.clone())
            .filter(|v| !v.is_empty()),
        phase: c.status.as_ref().and_then(|s| s.phase.clone()),
    }
}

fn pv_snap(p: &PersistentVolume) -> PvSnap {
    let spec = p.spec.as_ref();
    let cref = spec.and_then(|s| s.claim_ref.as_ref());
    let modes = spec.and_then(|s| s.access_modes.clone()).unwrap_or_default();
    let csi = spec.and_then(|s| s.csi.as_ref());
    PvSnap {
        claim_uid: cref.and_then(|r| r.uid.clone()),
        claim: cref.map(|r| {
            format!(
                "{}/{}",
                r.namespace.clone().unwrap_or_default(),
                r.name.clone().unwrap_or_default()
            )
        }),
        phase: p.status.as_ref().and_then(|s| s.phase.clone()),
        unique: csi.map(|c| format!("{}^{}", c.driver, c.volume_handle)),
        read_only: csi.and_then(|c| c.read_only).unwrap_or(false)
            || (!modes.is_empty() && modes.iter().all(|m| m == "ReadOnlyMany")),
    }
}

fn va_snap(v: &VolumeAttachment) -> VaSnap {
    VaSnap {
        name: v.name_any(),
        node: v.spec.node_name.clone(),
        pv: v.spec.source.persistent_volume_name.clone(),
        attached: v.status.as_ref().is_some_and(|s| s.attached),
        deleting: v.metadata.deletion_timestamp.is_some(),
    }
}

fn node_snap(n: &Node) -> NodeSnap {
    NodeSnap {
        in_use: n
            .status
            .as_ref()
            .and_then(|s| s.volumes_in_use.clone())
            .unwrap_or_default()
            .into_iter()
            .collect(),
        attached: n
            .status
            .iter()
            .flat_map(|s| s.volumes_attached.iter().flatten())
            .map(|v| v.name.clone())
            .collect(),
        out_of_service: n
            .spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .is_some_and(|t| t.iter().any(|t| t.key == OUT_OF_SERVICE)),
    }
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

    /// No volume is named by two claims at once (checked on every claim change: one stream, so
    /// the cache after each event is the exact state at that revision).
    fn check_claim_names(&self, s: &Seen) {
        let mut by_volume: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (_, st) in s.claims.current() {
            if let St::Present(c) = st
                && let Some(v) = &c.volume
            {
                by_volume.entry(v).or_default().push(&c.name);
            }
        }
        self.record.checks("volume-claimed-once", 1);
        for (v, names) in by_volume {
            if names.len() > 1 {
                self.record.violation(
                    &format!("twice:{v}:{names:?}"),
                    "volume bound to two claims",
                    format!(
                        "{v} is spec.volumeName of {names:?} at revision {}",
                        s.claims.frontier
                    ),
                );
            }
        }
    }

    /// No two nodes hold the same writable volume attached at once (the attachment stream alone,
    /// exact at every event).
    fn check_single_writer(&self, s: &Seen) {
        let mut nodes: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
        for (_, st) in s.vas.current() {
            if let St::Present(v) = st
                && v.attached
                && let Some(pv) = &v.pv
            {
                nodes.entry(pv).or_default().insert(&v.node);
            }
        }
        self.record.checks("single-writer-attachment", 1);
        for (pv, ns) in nodes {
            if ns.len() < 2 {
                continue;
            }
            let read_only = s
                .pvs
                .hist
                .get(pv)
                .and_then(|h| h.last())
                .is_some_and(|(_, st)| matches!(st, St::Present(p) if p.read_only));
            if !read_only {
                self.record.violation(
                    &format!("multi:{pv}:{ns:?}"),
                    "volume attached read-write on two nodes",
                    format!(
                        "{pv} has attached VolumeAttachments on {ns:?} at revision {}",
                        s.vas.frontier
                    ),
                );
            }
        }
    }

    /// The cross-kind checks, decided up to the frontiers; run periodically and once at the end.
    pub fn judge(&self) {
        let mut s = self.lock();
        let n_bound = self.judge_bound_claims(&mut s);
        self.record.checks("bound-claim-volume-points-back", n_bound);
        let n_va = self.judge_detaches(&mut s);
        self.record.checks("no-detach-while-in-use", n_va);
    }

    /// While a claim is Bound to a volume, that volume's claimRef names the claim's UID.
    fn judge_bound_claims(&self, s: &mut Seen) -> u64 {
        let limit = s.claims.frontier.min(s.pvs.frontier);
        let done = s.bound_judged_to;
        if limit <= done {
            return 0;
        }
        s.bound_judged_to = limit;
        let mut checked = 0;
        for (uid, h) in &s.claims.hist {
            for (i, (from, st)) in h.iter().enumerate() {
                let St::Present(c) = st else { continue };
                // A Bound claim needs its volume to point back; a claim that only names its
                // volume (the bind's status writes still to come) needs it not to point at
                // another claim: the binder writes the volume's claimRef first.
                let Some(vol) = c.volume.as_deref() else { continue };
                let bound = c.phase.as_deref() == Some("Bound");
                if *from > limit {
                    break;
                }
                let until = h.get(i + 1).map(|(r, _)| *r).unwrap_or(u64::MAX).min(limit + 1);
                // Only the part of the interval not judged before.
                let from = &(*from).max(done + 1);
                if *from >= until {
                    continue;
                }
                let Some(ph) = s.pvs.hist.get(vol) else {
                    // A volume made and deleted while the volume watch was lost is in no
                    // history: nothing can be said of it then.
                    if !bound || s.pvs.unseen(*from, until) {
                        continue;
                    }
                    checked += 1;
                    self.record.violation(
                        &format!("nopv:{uid}:{from}"),
                        "claim bound to a volume that does not exist",
                        format!(
                            "{} Bound to {vol} at revision {from}, never seen that volume",
                            c.name
                        ),
                    );
                    continue;
                };
                // The volume's states over [from, until): the one in force at `from` and every
                // change inside the interval.
                let mut states: Vec<(u64, &St<PvSnap>)> = Vec::new();
                match state_at(ph, *from) {
                    Some(st) => states.push((*from, st)),
                    None => states.push((*from, &St::Gone)),
                }
                states.extend(
                    ph.iter()
                        .filter(|(r, _)| *r > *from && *r < until)
                        .map(|(r, st)| (*r, st)),
                );
                for (at, pst) in states {
                    checked += 1;
                    let bad = match pst {
                        St::Unknown => None,
                        St::Gone if !bound => None,
                        St::Gone => Some("does not exist".to_string()),
                        St::Present(p) if p.claim_uid.as_deref() == Some(uid.as_str()) => None,
                        St::Present(p) if !bound && p.claim_uid.is_none() => None,
                        St::Present(p) => Some(format!("points at {:?} (uid {:?})", p.claim, p.claim_uid)),
                    };
                    if let Some(why) = bad {
                        self.record.violation(
                            &format!("elsewhere:{uid}:{vol}:{at}"),
                            "claim's volume points elsewhere",
                            format!(
                                "{} (uid {uid}, {}) names {vol} at revision {at}, but the volume {why}",
                                c.name,
                                c.phase.as_deref().unwrap_or("no phase")
                            ),
                        );
                    }
                }
            }
        }
        checked
    }

    /// An attachment is deleted (deletionTimestamp set, or removed outright) only when its node no
    /// longer lists the volume in `volumesInUse`, unless the node has the out-of-service taint
    /// then (the documented forced detach). The protocol (upstream's, and stowage's) leaves one
    /// race: the controller takes the volume out of `volumesAttached`, reads `volumesInUse`, then
    /// deletes; a pod arriving after that read makes the node list the volume in use before the
    /// delete lands. A node then must not mount it (it is no longer in `volumesAttached`), so
    /// that is no violation: the in-use listing must have begun while `volumesAttached` still
    /// listed the volume, and lasted until the delete, for the controller to have been wrong.
    fn judge_detaches(&self, s: &mut Seen) -> u64 {
        let limit = s.vas.frontier.min(s.nodes.frontier);
        let mut decided = Vec::new();
        for (uid, h) in &s.vas.hist {
            if s.judged_va.contains(uid) {
                continue;
            }
            // The first revision the attachment was asked to go, with its node and volume.
            let mut at = None;
            let mut prev: Option<&VaSnap> = None;
            for (rv, st) in h {
                match st {
                    St::Present(v) if v.deleting => {
                        at = Some((*rv, v.clone()));
                        break;
                    }
                    St::Present(v) => prev = Some(v),
                    St::Gone => {
                        at = prev.map(|v| (*rv, v.clone()));
                        break;
                    }
                    St::Unknown => {
                        // Deleted somewhere in a gap: cannot be judged.
                        if !matches!(h.last(), Some((_, St::Present(_)))) {
                            decided.push(uid.clone());
                        }
                        at = None;
                        break;
                    }
                }
            }
            let Some((rv, va)) = at else { continue };
            if rv > limit {
                continue;
            }
            decided.push(uid.clone());
            let Some(pv) = va.pv.as_deref() else { continue };
            let unique = s.pvs.hist.get(pv).and_then(|h| {
                h.iter().rev().find_map(|(_, st)| match st {
                    St::Present(p) => p.unique.clone(),
                    _ => None,
                })
            });
            let Some(unique) = unique else { continue };
            let name = format!("kubernetes.io/csi/{unique}");
            let Some(nh) = s.nodes.hist.get(&va.node) else {
                continue;
            };
            let node = state_at(nh, rv);
            let Some(St::Present(n)) = node else { continue };
            if !n.in_use.contains(&name) || n.out_of_service {
                continue;
            }
            if in_use_while_listed(nh, rv, &name) {
                self.record.violation(
                    &format!("inuse:{uid}"),
                    "attachment deleted while the volume is in use",
                    format!(
                        "VolumeAttachment {} ({pv} on {}) deleted at revision {rv} while {} listed {name} in volumesInUse",
                        va.name, va.node, va.node
                    ),
                );
            } else {
                // Counted, so a run shows how often the protocol's race was met.
                self.record.note(
                    "detach-raced-a-new-pod",
                    &format!("{} ({pv} on {}) at revision {rv}", va.name, va.node),
                );
            }
        }
        let n = decided.len() as u64;
        s.judged_va.extend(decided);
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(vol: Option<&str>, phase: &str) -> ClaimSnap {
        ClaimSnap {
            name: "ns/c".into(),
            volume: vol.map(String::from),
            phase: Some(phase.into()),
        }
    }

    fn pv(uid: Option<&str>) -> PvSnap {
        PvSnap {
            claim_uid: uid.map(String::from),
            claim: uid.map(|_| "ns/c".into()),
            phase: None,
            unique: Some("loop.stowage.dev^h".into()),
            read_only: false,
        }
    }

    fn observer() -> (Arc<Observer>, Arc<Record>, tempfile::TempDir) {
        let d = tempfile::tempdir().unwrap();
        let r = Arc::new(Record::new(d.path()).unwrap());
        (Observer::new(r.clone()), r, d)
    }

    #[test]
    fn state_at_picks_the_last_change_not_after() {
        let h = vec![(5, St::Present(1)), (9, St::Gone)];
        assert_eq!(state_at(&h, 4), None);
        assert_eq!(state_at(&h, 5), Some(&St::Present(1)));
        assert_eq!(state_at(&h, 8), Some(&St::Present(1)));
        assert_eq!(state_at(&h, 9), Some(&St::Gone));
    }

    #[test]
    fn a_bind_in_progress_is_not_a_violation_but_a_foreign_claim_ref_is() {
        let (o, r, _d) = observer();
        {
            let mut s = o.lock();
            // Upstream order: the volume's claimRef first (rv 10), then the claim (11, 12).
            s.pvs.apply("v", 3, pv(None));
            s.pvs.apply("v", 10, pv(Some("u1")));
            s.claims.apply("u1", 2, claim(None, "Pending"));
            s.claims.apply("u1", 11, claim(Some("v"), "Pending"));
            s.claims.apply("u1", 12, claim(Some("v"), "Bound"));
        }
        o.judge();
        assert!(r.snapshot().violations.is_empty());
        {
            let mut s = o.lock();
            s.pvs.apply("v", 20, pv(Some("other")));
        }
        o.judge();
        // Not judged before the claim watch has delivered past revision 20 too.
        assert!(r.snapshot().violations.is_empty());
        o.lock().claims.apply(
            "ticker",
            21,
            ClaimSnap {
                name: "t/t".into(),
                volume: None,
                phase: None,
            },
        );
        o.judge();
        let v = r.snapshot().violations;
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].what.contains("points elsewhere"));
    }

    #[test]
    fn a_claim_naming_a_volume_of_another_claim_is_a_violation_even_before_bound() {
        let (o, r, _d) = observer();
        {
            let mut s = o.lock();
            s.pvs.apply("v", 3, pv(Some("u2")));
            s.claims.apply("u1", 4, claim(Some("v"), "Pending"));
            s.claims.apply(
                "t",
                5,
                ClaimSnap {
                    name: "t/t".into(),
                    volume: None,
                    phase: None,
                },
            );
            s.pvs.apply("t", 6, pv(None));
        }
        o.judge();
        assert_eq!(r.snapshot().violations.len(), 1);
    }

    #[test]
    fn a_lagging_stream_is_not_judged_past_its_frontier() {
        let (o, r, _d) = observer();
        {
            let mut s = o.lock();
            s.pvs.apply("v", 3, pv(None));
            // The claim stream is ahead: the volume's claimRef write (rv 10) has not arrived yet.
            s.claims.apply("u1", 11, claim(Some("v"), "Bound"));
        }
        o.judge();
        assert!(r.snapshot().violations.is_empty());
    }

    /// The volume watch was lost and relisted; a volume created and deleted meanwhile is in no
    /// history. A claim bound to it then is not judged; one bound to an unknown volume while the
    /// watch saw everything is a violation.
    #[test]
    fn a_volume_unseen_in_a_watch_gap_is_not_judged() {
        let (o, r, _d) = observer();
        {
            let mut s = o.lock();
            s.pvs.apply("v", 3, pv(None));
            s.pvs.begin_list();
            s.pvs.apply("v", 3, pv(None));
            s.pvs.end_list();
            s.pvs.apply("v", 30, pv(None));
            s.claims.apply("u1", 11, claim(Some("gone"), "Bound"));
            s.claims.apply("u1", 25, claim(None, "Pending"));
            s.claims.apply("u1", 31, claim(Some("never"), "Bound"));
            s.claims.apply("u1", 32, claim(None, "Pending"));
            s.pvs.apply("v", 40, pv(None));
        }
        o.judge();
        let v = r.snapshot().violations;
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(format!("{v:?}").contains("never"), "{v:?}");
    }

    #[test]
    fn gaps_cover_only_what_was_missed() {
        let mut st: Stream<PvSnap> = Stream::default();
        st.apply("v", 5, pv(None));
        st.begin_list();
        st.end_list();
        assert!(st.unseen(6, 100), "open until the first change after the list");
        st.apply("v", 20, pv(None));
        assert!(st.unseen(6, 20));
        assert!(!st.unseen(6, 21));
        assert!(!st.unseen(3, 10));
    }

    #[test]
    fn two_claims_naming_one_volume_is_a_violation() {
        let (o, r, _d) = observer();
        let mut s = o.lock();
        s.claims.apply("u1", 5, claim(Some("v"), "Bound"));
        s.claims.apply(
            "u2",
            6,
            ClaimSnap {
                name: "ns/d".into(),
                ..claim(Some("v"), "Pending")
            },
        );
        o.check_claim_names(&s);
        assert_eq!(r.snapshot().violations.len(), 1);
    }

    fn va(node: &str, attached: bool, deleting: bool) -> VaSnap {
        VaSnap {
            name: format!("va-{node}"),
            node: node.into(),
            pv: Some("v".into()),
            attached,
            deleting,
        }
    }

    /// A node listing `in_use` as in use and as attached.
    fn node(in_use: &[&str], oos: bool) -> NodeSnap {
        NodeSnap {
            in_use: in_use.iter().map(|s| s.to_string()).collect(),
            attached: in_use.iter().map(|s| s.to_string()).collect(),
            out_of_service: oos,
        }
    }

    /// A pod that arrives after the controller took the volume out of `volumesAttached` (and read
    /// `volumesInUse`) lists it in use before the delete lands: the protocol's race, not a
    /// violation. In use since before it left `volumesAttached`: a violation.
    #[test]
    fn in_use_that_began_after_volumes_attached_dropped_it_is_the_protocols_race() {
        let name = "kubernetes.io/csi/loop.stowage.dev^h";
        for (listed_when_in_use_began, want) in [(false, 0), (true, 1)] {
            let (o, r, _d) = observer();
            {
                let mut s = o.lock();
                s.pvs.apply("v", 1, pv(Some("u1")));
                s.vas.apply("x", 2, va("a", true, false));
                s.nodes.apply("a", 3, node(&[], false));
                let mut began = node(&[name], false);
                if !listed_when_in_use_began {
                    began.attached.clear();
                }
                s.nodes.apply("a", 4, began.clone());
                began.attached.clear();
                s.nodes.apply("a", 5, began);
                s.vas.apply("x", 6, va("a", true, true));
                s.nodes.apply("a", 7, node(&[], false));
            }
            o.judge();
            let snap = r.snapshot();
            assert_eq!(
                snap.violations.len(),
                want,
                "volumesAttached listed it when in use began: {listed_when_in_use_began}"
            );
            let raced = snap.notes.get("detach-raced-a-new-pod").copied().unwrap_or(0);
            assert_eq!(raced, 1 - want as u64, "the race is counted, not hidden");
        }
    }

    #[test]
    fn detach_while_in_use_unless_out_of_service() {
        let name = "kubernetes.io/csi/loop.stowage.dev^h";
        for (oos, want) in [(false, 1), (true, 0)] {
            let (o, r, _d) = observer();
            {
                let mut s = o.lock();
                s.pvs.apply("v", 1, pv(Some("u1")));
                s.nodes.apply("a", 2, node(&[name], oos));
                s.vas.apply("x", 3, va("a", true, false));
                s.vas.apply("x", 4, va("a", true, true));
                s.nodes.apply("a", 5, node(&[], oos));
            }
            o.judge();
            assert_eq!(r.snapshot().violations.len(), want, "oos {oos}");
        }
        // The node dropped the volume before the deletion: fine.
        let (o, r, _d) = observer();
        {
            let mut s = o.lock();
            s.pvs.apply("v", 1, pv(Some("u1")));
            s.nodes.apply("a", 2, node(&[name], false));
            s.vas.apply("x", 3, va("a", true, false));
            s.nodes.apply("a", 4, node(&[], false));
            s.vas.apply("x", 5, va("a", true, true));
            s.vas.delete("x", 6);
        }
        o.judge();
        assert!(r.snapshot().violations.is_empty());
    }

    #[test]
    fn two_attached_writers_is_a_violation() {
        let (o, r, _d) = observer();
        let mut s = o.lock();
        s.pvs.apply("v", 1, pv(Some("u1")));
        s.vas.apply("x", 3, va("a", true, true));
        s.vas.apply("y", 4, va("b", false, false));
        o.check_single_writer(&s);
        assert!(r.snapshot().violations.is_empty());
        s.vas.apply("y", 5, va("b", true, false));
        o.check_single_writer(&s);
        assert_eq!(r.snapshot().violations.len(), 1);
    }

    #[test]
    fn a_relist_marks_the_gap_unknown() {
        let mut st: Stream<u32> = Stream::default();
        st.apply("a", 5, 1);
        st.apply("b", 6, 1);
        st.begin_list();
        st.apply("a", 9, 2);
        st.end_list();
        assert_eq!(
            st.hist["a"],
            vec![(5, St::Present(1)), (6, St::Unknown), (9, St::Present(2))]
        );
        assert_eq!(st.hist["b"], vec![(6, St::Present(1)), (7, St::Unknown)]);
        assert_eq!(st.frontier, 9);
        // Created while the watch was away: unknown since the watch was lost.
        st.begin_list();
        st.apply("a", 9, 2);
        st.apply("c", 12, 3);
        st.end_list();
        assert_eq!(st.hist["c"], vec![(10, St::Unknown), (12, St::Present(3))]);
    }
}
