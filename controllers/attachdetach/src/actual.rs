//! Actual state of the world: what is attached where, as VolumeAttachments (and, right after a
//! start, the nodes' own `status.volumesAttached`) say, plus what this controller has in flight.
//! No I/O.

use std::collections::BTreeMap;
use tokio::time::Instant;

use stowage_common::runtime::backoff::Backoff;

use crate::read::VaState;
use crate::vecmap::VecMap;

/// An API operation in flight for one (volume, node).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Attach,
    Detach,
}

/// What is known of one (volume, node) pair and what this controller has under way for it:
/// its VolumeAttachment as last seen, a node's report, the operation in flight and its backoff.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PairState {
    pub driver: String,
    pub handle: String,
    /// The VolumeAttachment as last seen (or written) by this controller.
    pub va: Option<VaState>,
    /// Device path from the node's `status.volumesAttached`, for attachments carried over from
    /// before a restart whose VolumeAttachment has not been confirmed yet.
    pub reported: Option<String>,
    pub op: Option<Op>,
    /// When the detach was first wanted (upstream's detachRequestedTime).
    pub detach_requested: Option<Instant>,
    /// When the attach now under way was requested (end-to-end latency).
    pub attach_started: Option<Instant>,
    /// When the detach now under way started.
    pub detach_started: Option<Instant>,
    /// Failed operations in a row, and when the next may start.
    pub backoff: Backoff,
    pub retry_at: Option<Instant>,
}

impl PairState {
    /// Something is or may be attached: a VolumeAttachment, a node report, or a create in flight.
    pub fn exists(&self) -> bool {
        self.va.is_some() || self.reported.is_some() || self.op == Some(Op::Attach)
    }

    /// Confirmed attached (an uncertain one, still attaching, is not).
    pub fn attached(&self) -> bool {
        match &self.va {
            Some(va) => va.attached && !va.deleting,
            None => self.reported.is_some(),
        }
    }

    /// The device path to report in node status, if this attachment belongs there: confirmed
    /// and not being detached.
    pub fn report(&self) -> Option<&str> {
        if !self.attached() || self.op == Some(Op::Detach) {
            return None;
        }
        Some(match &self.va {
            Some(va) => va.device_path.as_str(),
            None => self.reported.as_deref().unwrap_or(""),
        })
    }

    pub fn deleting(&self) -> bool {
        self.va.as_ref().is_some_and(|v| v.deleting)
    }

    pub fn backing_off(&self, now: Instant) -> bool {
        self.retry_at.is_some_and(|t| now < t)
    }

    /// Nothing left worth remembering.
    fn is_empty(&self, now: Instant) -> bool {
        !self.exists() && self.op.is_none() && !self.backing_off(now)
    }

    /// Records a failure: the shared backoff (500 ms doubling to about 2 min, as upstream's
    /// executor).
    pub fn failed(&mut self, now: Instant) {
        self.retry_at = Some(now + self.backoff.failed());
    }

    pub fn succeeded(&mut self) {
        self.backoff.reset();
        self.retry_at = None;
    }
}

/// (unique volume name, node name).
pub type Key = (String, String);

/// Entries by volume, then node: the same order as by (volume, node), and lookups by `&str`
/// allocate nothing (a pass looks up every desired pair). A volume's nodes are a `VecMap`: one
/// node nearly always.
#[derive(Debug, Clone, Default)]
pub struct Actual {
    entries: BTreeMap<String, VecMap<PairState>>,
    len: usize,
}

impl Actual {
    pub fn get(&self, volume: &str, node: &str) -> Option<&PairState> {
        self.entries.get(volume)?.get(node)
    }

    pub fn get_mut(&mut self, volume: &str, node: &str) -> Option<&mut PairState> {
        self.entries.get_mut(volume)?.get_mut(node)
    }

    /// The entry for (volume, node), created with `driver`/`handle` if missing.
    pub fn entry(&mut self, volume: &str, node: &str, driver: &str, handle: &str) -> &mut PairState {
        if self.get(volume, node).is_none() {
            self.len += 1;
        }
        // Looked up by `&str` first: the volume's name is copied only for a new volume.
        if !self.entries.contains_key(volume) {
            self.entries.insert(volume.to_string(), VecMap::default());
        }
        let nodes = self.entries.get_mut(volume).expect("inserted above");
        nodes.get_or_insert_with(node, || PairState {
            driver: driver.to_string(),
            handle: handle.to_string(),
            ..Default::default()
        })
    }

    /// Drops the entry if nothing is left in it.
    pub fn tidy(&mut self, volume: &str, node: &str, now: Instant) {
        let Some(nodes) = self.entries.get_mut(volume) else {
            return;
        };
        if nodes.get(node).is_some_and(|e| e.is_empty(now)) {
            nodes.remove(node);
            self.len -= 1;
            if nodes.is_empty() {
                self.entries.remove(volume);
            }
        }
    }

    /// Drops every entry with nothing left in it.
    pub fn tidy_all(&mut self, now: Instant) {
        for nodes in self.entries.values_mut() {
            nodes.retain(|_, e| !e.is_empty(now));
        }
        self.entries.retain(|_, nodes| !nodes.is_empty());
        self.len = self.entries.values().map(VecMap::len).sum();
    }

    /// Every ((volume, node), entry), ordered by volume then node.
    pub fn iter(&self) -> impl Iterator<Item = ((&String, &String), &PairState)> {
        self.entries
            .iter()
            .flat_map(|(v, nodes)| nodes.iter().map(move |(n, e)| ((v, n), e)))
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = ((&String, &String), &mut PairState)> {
        self.entries
            .iter_mut()
            .flat_map(|(v, nodes)| nodes.iter_mut().map(move |(n, e)| ((&*v, n), e)))
    }

    /// Nodes other than `node` where `volume` is or may be attached.
    pub fn other_nodes<'a>(&'a self, volume: &'a str, node: &'a str) -> impl Iterator<Item = &'a str> {
        self.entries
            .get(volume)
            .into_iter()
            .flat_map(VecMap::iter)
            .filter(move |(n, e)| *n != node && e.exists())
            .map(|(n, _)| n.as_str())
    }

    /// Attachments of one node, for the status updater.
    pub fn on_node<'a>(&'a self, node: &'a str) -> impl Iterator<Item = (&'a str, &'a PairState)> {
        self.entries
            .iter()
            .filter_map(move |(v, nodes)| nodes.get(node).map(|e| (v.as_str(), e)))
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}
