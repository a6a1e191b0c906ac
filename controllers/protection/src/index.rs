//! Pods by claim: which pods of the shared store refer to a claim, so a sync reads a few pods, not
//! every pod of the cluster. Kept from the pod change feed by the one task that owns it.

use std::collections::{BTreeSet, HashMap};

use stowage_common::store::StoredPod;

use crate::core::claim_names;

/// `(namespace, name)` of a claim or a pod.
pub type Key = (String, String);

pub fn key_of(meta: &kube::api::ObjectMeta) -> Key {
    (
        meta.namespace.clone().unwrap_or_default(),
        meta.name.clone().unwrap_or_default(),
    )
}

#[derive(Debug, Default)]
pub struct PodsByClaim {
    by_claim: HashMap<Key, BTreeSet<String>>,
    /// What each pod was last indexed under, to undo it on change or deletion.
    by_pod: HashMap<Key, Vec<String>>,
}

impl PodsByClaim {
    /// Indexes a created or updated pod; returns the claims whose users may have changed (those
    /// it refers to now and those it referred to before).
    pub fn apply(&mut self, pod: &StoredPod) -> Vec<Key> {
        let pod_key = key_of(pod.meta());
        let claims = claim_names(pod);
        let mut touched = self.remove_key(&pod_key);
        for c in &claims {
            self.by_claim
                .entry((pod_key.0.clone(), c.clone()))
                .or_default()
                .insert(pod_key.1.clone());
            touched.push((pod_key.0.clone(), c.clone()));
        }
        if !claims.is_empty() {
            self.by_pod.insert(pod_key, claims);
        }
        touched.sort();
        touched.dedup();
        touched
    }

    /// Drops a deleted pod; returns the claims it referred to.
    pub fn delete(&mut self, pod: &StoredPod) -> Vec<Key> {
        self.remove_key(&key_of(pod.meta()))
    }

    fn remove_key(&mut self, pod_key: &Key) -> Vec<Key> {
        let Some(claims) = self.by_pod.remove(pod_key) else {
            return Vec::new();
        };
        claims
            .into_iter()
            .map(|c| {
                let k = (pod_key.0.clone(), c);
                if let Some(set) = self.by_claim.get_mut(&k) {
                    set.remove(&pod_key.1);
                    if set.is_empty() {
                        self.by_claim.remove(&k);
                    }
                }
                k
            })
            .collect()
    }

    /// Rebuilds from a full list (after a relist or a lagged feed).
    pub fn rebuild<'a>(&mut self, pods: impl IntoIterator<Item = &'a StoredPod>) {
        *self = Self::default();
        for p in pods {
            self.apply(p);
        }
    }

    /// Names of the pods (in the claim's namespace) that refer to `claim`.
    pub fn pods_of(&self, claim: &Key) -> impl Iterator<Item = &str> {
        self.by_claim.get(claim).into_iter().flatten().map(String::as_str)
    }

    #[cfg(test)]
    fn snapshot(&self) -> Vec<(Key, Vec<String>)> {
        let mut v: Vec<_> = self
            .by_claim
            .iter()
            .map(|(k, s)| (k.clone(), s.iter().cloned().collect()))
            .collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PersistentVolumeClaimVolumeSource, Pod as FullPod, PodSpec, Volume};
    use kube::api::ObjectMeta;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn pod(ns: &str, name: &str, claims: &[String]) -> StoredPod {
        StoredPod::from_pod(&FullPod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(ns.into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                volumes: Some(
                    claims
                        .iter()
                        .map(|c| Volume {
                            name: format!("v-{c}"),
                            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                                claim_name: c.clone(),
                                read_only: None,
                            }),
                            ..Default::default()
                        })
                        .collect(),
                ),
                ..Default::default()
            }),
            status: None,
        })
        .unwrap()
    }

    #[test]
    fn update_moves_a_pod_between_claims() {
        let mut ix = PodsByClaim::default();
        let touched = ix.apply(&pod("ns", "p", &["a".into()]));
        assert_eq!(touched, vec![("ns".into(), "a".into())]);
        // Same name, different volumes (deleted and recreated between two events).
        let touched = ix.apply(&pod("ns", "p", &["b".into()]));
        assert_eq!(
            touched,
            vec![("ns".into(), "a".into()), ("ns".into(), "b".into())]
        );
        assert_eq!(ix.pods_of(&("ns".into(), "a".into())).count(), 0);
        assert_eq!(
            ix.pods_of(&("ns".into(), "b".into())).collect::<Vec<_>>(),
            vec!["p"]
        );
        assert_eq!(ix.pods_of(&("other".into(), "b".into())).count(), 0);
        assert_eq!(ix.delete(&pod("ns", "p", &[])), vec![("ns".into(), "b".into())]);
        assert!(ix.snapshot().is_empty());
    }

    proptest! {
        /// After any sequence of applies and deletes the index equals one built from the final
        /// set of pods, and every change reports the claims it touched.
        #[test]
        fn incremental_equals_rebuild(ops in proptest::collection::vec((any::<bool>(), 0u8..2, 0u8..4, proptest::collection::vec(0u8..4, 0..3)), 0..100)) {
            let mut ix = PodsByClaim::default();
            let mut live: BTreeMap<(String, String), StoredPod> = BTreeMap::new();
            for (del, ns, name, claims) in ops {
                let claims: Vec<String> = claims.iter().map(|c| format!("c{c}")).collect();
                let p = pod(&format!("ns{ns}"), &format!("p{name}"), &claims);
                let k = key_of(p.meta());
                let before: BTreeSet<Key> = ix.by_claim.iter().filter(|(_, s)| s.contains(&k.1)).map(|(c, _)| c.clone()).filter(|c| c.0 == k.0).collect();
                let touched: BTreeSet<Key> = if del { live.remove(&k); ix.delete(&p).into_iter().collect() } else { live.insert(k.clone(), p.clone()); ix.apply(&p).into_iter().collect() };
                let after: BTreeSet<Key> = ix.by_claim.iter().filter(|(_, s)| s.contains(&k.1)).map(|(c, _)| c.clone()).filter(|c| c.0 == k.0).collect();
                for c in before.symmetric_difference(&after) { prop_assert!(touched.contains(c)); }
                let mut fresh = PodsByClaim::default();
                fresh.rebuild(live.values());
                prop_assert_eq!(ix.snapshot(), fresh.snapshot());
            }
        }
    }
}
