//! The volume index: free volumes ordered by size within each (class, access-mode set) group, and
//! volumes pre-bound to a claim by claim key. A claim's best match is found by walking the groups
//! whose mode set covers the claim's (fewest modes first, as upstream) from the requested size
//! upward — never by scanning every volume.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use k8s_openapi::api::core::v1::PersistentVolume;
use kube::ResourceExt;

use crate::pv::{being_deleted, claim_ref, pv_capacity, pv_class, pv_modes, pv_phase};

pub type ModeSet = BTreeSet<String>;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    Free {
        class: String,
        modes: ModeSet,
        size: u128,
    },
    Prebound {
        claim: String,
    },
}

#[derive(Debug, Default, Clone)]
pub struct VolumeIndex {
    free: BTreeMap<String, BTreeMap<ModeSet, BTreeSet<(u128, String)>>>,
    prebound: HashMap<String, BTreeSet<String>>,
    entries: HashMap<String, Entry>,
}

/// Where a volume belongs in the index, if anywhere.
fn entry_for(pv: &PersistentVolume) -> Option<Entry> {
    if being_deleted(pv) {
        return None;
    }
    match claim_ref(pv) {
        Some((ns, name, _)) => Some(Entry::Prebound {
            claim: format!("{ns}/{name}"),
        }),
        // Only Available volumes are offered to claims that did not ask for them by name; a new
        // volume enters once its own sync has marked it Available.
        None if pv_phase(pv) == "Available" => Some(Entry::Free {
            class: pv_class(pv).to_string(),
            modes: pv_modes(pv),
            size: pv_capacity(pv)?,
        }),
        None => None,
    }
}

impl VolumeIndex {
    pub fn upsert(&mut self, pv: &PersistentVolume) {
        let name = pv.name_any();
        let entry = entry_for(pv);
        if self.entries.get(&name) == entry.as_ref() {
            return;
        }
        self.remove(&name);
        match &entry {
            Some(Entry::Free { class, modes, size }) => {
                self.free
                    .entry(class.clone())
                    .or_default()
                    .entry(modes.clone())
                    .or_default()
                    .insert((*size, name.clone()));
            }
            Some(Entry::Prebound { claim }) => {
                self.prebound
                    .entry(claim.clone())
                    .or_default()
                    .insert(name.clone());
            }
            None => return,
        }
        if let Some(e) = entry {
            self.entries.insert(name, e);
        }
    }

    pub fn remove(&mut self, name: &str) {
        match self.entries.remove(name) {
            Some(Entry::Free { class, modes, size }) => {
                if let Some(groups) = self.free.get_mut(&class) {
                    if let Some(set) = groups.get_mut(&modes) {
                        set.remove(&(size, name.to_string()));
                        if set.is_empty() {
                            groups.remove(&modes);
                        }
                    }
                    if groups.is_empty() {
                        self.free.remove(&class);
                    }
                }
            }
            Some(Entry::Prebound { claim }) => {
                if let Some(set) = self.prebound.get_mut(&claim) {
                    set.remove(name);
                    if set.is_empty() {
                        self.prebound.remove(&claim);
                    }
                }
            }
            None => {}
        }
    }

    /// Volumes whose claimRef names claim `key` ("namespace/name").
    pub fn prebound_to(&self, key: &str) -> impl Iterator<Item = &str> {
        self.prebound.get(key).into_iter().flatten().map(String::as_str)
    }

    /// Groups of free volumes of `class` whose modes cover `modes`, fewest modes first; within a
    /// group, volumes of at least `min` bytes, smallest first (ties by name).
    pub fn groups<'a>(
        &'a self,
        class: &str,
        modes: &ModeSet,
        min: u128,
    ) -> Vec<impl Iterator<Item = (u128, &'a str)> + 'a> {
        let mut groups: Vec<(&ModeSet, &BTreeSet<(u128, String)>)> = self
            .free
            .get(class)
            .into_iter()
            .flat_map(|g| g.iter())
            .filter(|(m, _)| m.is_superset(modes))
            .collect();
        groups.sort_by_key(|(m, _)| m.len());
        groups
            .into_iter()
            .map(move |(_, set)| set.range((min, String::new())..).map(|(s, n)| (*s, n.as_str())))
            .collect()
    }

    /// For explaining why a claim found nothing: how many free volumes the class has, and, in
    /// each access-mode group, up to `k` volumes just below `size` and `k` from `size` up.
    pub fn near(&self, class: &str, size: u128, k: usize) -> (usize, Vec<(u128, &str)>) {
        let mut total = 0;
        let mut out = Vec::new();
        for set in self.free.get(class).into_iter().flat_map(|g| g.values()) {
            total += set.len();
            let below = set.range(..(size, String::new())).rev().take(k);
            let above = set.range((size, String::new())..).take(k);
            out.extend(below.chain(above).map(|(s, n)| (*s, n.as_str())));
        }
        (total, out)
    }
}

/// Whether two indexes hold the same entries (for tests of incremental maintenance).
impl PartialEq for VolumeIndex {
    fn eq(&self, other: &Self) -> bool {
        self.entries == other.entries && self.free == other.free && self.prebound == other.prebound
    }
}
