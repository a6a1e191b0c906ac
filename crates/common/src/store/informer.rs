//! Shared informers: one watch per resource type feeds a reflector `Store` (for lookups) and a
//! broadcast of changes (to wake controllers). Every controller reads the same stores; no
//! controller lists on its own.
//!
//! kube-runtime's shared streams deliver applied objects only; controllers here also need
//! deletions (a deleted claim releases its volume), hence this small hub.

use std::fmt::Debug;
use std::hash::Hash;
use std::sync::Arc;

use futures::StreamExt;
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::broadcast;
use tokio::task::JoinSet;

use crate::api::lean::Lean;

/// One change seen by the watch.
#[derive(Debug, Clone)]
pub enum Change<K> {
    /// Created or updated (also every object of a relist).
    Applied(Arc<K>),
    /// Deleted (as last seen).
    Deleted(Arc<K>),
    /// A full relist finished: objects deleted while the watch was down were dropped from the
    /// store without a `Deleted`, so subscribers should re-examine everything.
    Resynced,
}

/// A store plus a change feed for one resource type.
pub struct Informer<K: Resource<DynamicType = ()> + 'static> {
    store: Store<K>,
    tx: broadcast::Sender<Change<K>>,
}

impl<K: Resource<DynamicType = ()> + 'static> Clone for Informer<K> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            tx: self.tx.clone(),
        }
    }
}

/// How many changes a slow subscriber may fall behind before it gets `Lagged` (and resyncs).
/// The ring buffer keeps that many changes alive (old versions included), so it stays modest.
const FEED_CAPACITY: usize = 4 * 1024;

impl<K> Informer<K>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Eq + Hash + Clone,
{
    /// Starts the cluster-wide watch on `tasks` (narrowed by `config`'s selectors). Objects are
    /// decoded without their managed fields (`Lean`); `strip` trims each one further before it
    /// is stored, to keep memory proportional to what controllers read.
    pub fn spawn(
        client: Client,
        config: watcher::Config,
        strip: fn(&mut K),
        tasks: &mut JoinSet<()>,
    ) -> Self {
        Self::spawn_on(Api::<Lean<K>>::all(client), config, strip, tasks)
    }

    /// As [`Informer::spawn`], for the objects of one namespace (a component whose Role grants
    /// reads there only).
    pub fn spawn_in(
        client: Client,
        namespace: &str,
        config: watcher::Config,
        strip: fn(&mut K),
        tasks: &mut JoinSet<()>,
    ) -> Self
    where
        K: Resource<Scope = kube::core::NamespaceResourceScope>,
    {
        Self::spawn_on(
            Api::<Lean<K>>::namespaced(client, namespace),
            config,
            strip,
            tasks,
        )
    }

    fn spawn_on(
        api: Api<Lean<K>>,
        config: watcher::Config,
        strip: fn(&mut K),
        tasks: &mut JoinSet<()>,
    ) -> Self {
        let (store, mut writer) = reflector::store();
        let reader = store.clone();
        let (tx, _) = broadcast::channel(FEED_CAPACITY);
        let feed = tx.clone();
        let kind = K::kind(&()).to_string();
        tasks.spawn(async move {
            let mut stream = watcher::watcher(api, config)
                .default_backoff()
                .map(|ev| ev.map(unlean))
                .modify(strip)
                .boxed();
            while let Some(item) = stream.next().await {
                let ev = match item {
                    Ok(ev) => ev,
                    Err(e) => {
                        // The backoff retries; the store keeps serving the last state meanwhile.
                        tracing::warn!(%kind, error = %e, "watch failed, retrying");
                        continue;
                    }
                };
                writer.apply_watcher_event(&ev);
                // Send errors only mean nobody subscribes yet.
                let _ = match ev {
                    // Hand out the store's own Arc: one copy of each object in memory, however
                    // many controllers cache it.
                    Event::Apply(o) => {
                        let shared = reader
                            .get(&ObjectRef::from_obj(&o))
                            .unwrap_or_else(|| Arc::new(o));
                        feed.send(Change::Applied(shared))
                    }
                    Event::Delete(o) => feed.send(Change::Deleted(Arc::new(o))),
                    // A relist is announced once, when the store holds it; subscribers re-read
                    // the store rather than receive a second copy of every object.
                    Event::InitDone => feed.send(Change::Resynced),
                    Event::Init | Event::InitApply(_) => Ok(0),
                };
            }
        });
        Self { store, tx }
    }
}

impl<K: Resource<DynamicType = ()> + Clone + 'static> Informer<K>
where
    K::DynamicType: Eq + Hash + Clone,
{
    pub fn store(&self) -> &Store<K> {
        &self.store
    }

    /// A feed of changes from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<Change<K>> {
        self.tx.subscribe()
    }

    /// A feed of changes from now on, with lag folded into `Resynced`.
    pub fn feed(&self) -> Feed<K> {
        Feed {
            rx: self.tx.subscribe(),
            kind: K::kind(&()).to_string(),
        }
    }

    /// Waits until the first full list is in the store.
    pub async fn ready(&self) {
        // The writer lives as long as the watch task; an error only means the task ended.
        let _ = self.store.wait_until_ready().await;
    }
}

fn unlean<K>(ev: Event<Lean<K>>) -> Event<K> {
    match ev {
        Event::Apply(o) => Event::Apply(o.0),
        Event::Delete(o) => Event::Delete(o.0),
        Event::Init => Event::Init,
        Event::InitApply(o) => Event::InitApply(o.0),
        Event::InitDone => Event::InitDone,
    }
}

/// The `strip` of an informer whose objects are stored as decoded (`Lean` already left out the
/// managed fields).
pub fn as_decoded<K>(_: &mut K) {}

/// The cheap way to compare versions of one object: resourceVersions of one object are
/// increasing integers in etcd-backed apiservers; anything unparsable compares as "not newer".
pub fn is_newer(candidate: Option<&str>, known: Option<&str>) -> bool {
    match (
        candidate.and_then(|c| c.parse::<u64>().ok()),
        known.and_then(|k| k.parse::<u64>().ok()),
    ) {
        (Some(c), Some(k)) => c > k,
        (Some(_), None) => true,
        _ => false,
    }
}

/// A change feed for a controller's event loop: a subscriber that fell behind gets `Resynced`
/// (it must re-read the stores either way), and a feed whose watch task ended is an error that
/// names the resource.
pub struct Feed<K> {
    rx: broadcast::Receiver<Change<K>>,
    kind: String,
}

impl<K: Clone> Feed<K> {
    /// A feed over any change channel; `kind` names it when it ends.
    pub fn new(rx: broadcast::Receiver<Change<K>>, kind: &str) -> Self {
        Self {
            rx,
            kind: kind.to_string(),
        }
    }

    pub async fn next(&mut self) -> anyhow::Result<Change<K>> {
        match self.rx.recv().await {
            Ok(c) => Ok(c),
            Err(broadcast::error::RecvError::Lagged(_)) => Ok(Change::Resynced),
            Err(broadcast::error::RecvError::Closed) => Err(anyhow::anyhow!("the {} watch ended", self.kind)),
        }
    }

    /// The next change if one is waiting (`None` when none is), with lag folded in the same way.
    pub fn try_next(&mut self) -> anyhow::Result<Option<Change<K>>> {
        use broadcast::error::TryRecvError;
        match self.rx.try_recv() {
            Ok(c) => Ok(Some(c)),
            Err(TryRecvError::Empty) => Ok(None),
            Err(TryRecvError::Lagged(_)) => Ok(Some(Change::Resynced)),
            Err(TryRecvError::Closed) => Err(anyhow::anyhow!("the {} watch ended", self.kind)),
        }
    }

    /// Empties the feed: for a loop whose next pass reads the stores whatever changed.
    pub fn drain(&mut self) -> anyhow::Result<()> {
        while self.try_next()?.is_some() {}
        Ok(())
    }
}
