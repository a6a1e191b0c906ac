//! Property tests of the pure state machine: random volumes and claims, synced in random orders
//! with every action applied to an in-memory model of the objects, must converge without ever
//! binding a claim to a volume that does not satisfy it or two claims to one volume.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::ResourceExt;
use proptest::prelude::*;
use stowage_testkit::builders::{pv, pvc};

use crate::core::{self, Action, Cache, Env};
use crate::index::VolumeIndex;
use crate::pv::*;

#[derive(Debug, Clone)]
struct World {
    pvs: BTreeMap<String, PersistentVolume>,
    claims: BTreeMap<String, PersistentVolumeClaim>,
    rv: u64,
}

impl World {
    fn bump<K: ResourceExt>(&mut self, o: &mut K) {
        self.rv += 1;
        o.meta_mut().resource_version = Some(self.rv.to_string());
    }

    fn cache(&self) -> Cache {
        let mut c = Cache::default();
        for p in self.pvs.values() {
            c.put_pv(Arc::new(p.clone()));
        }
        for cl in self.claims.values() {
            c.put_claim(Arc::new(cl.clone()));
        }
        c
    }

    fn put_pv(&mut self, mut p: PersistentVolume) {
        self.bump(&mut p);
        self.pvs.insert(p.name_any(), p);
    }

    fn put_claim(&mut self, mut c: PersistentVolumeClaim) {
        self.bump(&mut c);
        self.claims.insert(claim_key(&c), c);
    }

    /// Applies one action as the executor would, against the model's current objects.
    fn apply(&mut self, a: &Action) {
        match a {
            Action::Bind { pv, claim } => {
                let (Some(mut v), Some(mut c)) = (self.pvs.get(pv).cloned(), self.claims.get(claim).cloned())
                else {
                    return;
                };
                if let Some(n) = core::bound_pv_spec(&v, &c) {
                    self.put_pv(n);
                    v = self.pvs[pv].clone();
                }
                if let Some(n) = core::bound_pv_status(&v) {
                    self.put_pv(n);
                    v = self.pvs[pv].clone();
                }
                if let Some(n) = core::bound_claim_spec(&c, pv) {
                    self.put_claim(n);
                    c = self.claims[claim].clone();
                }
                if let Some(n) = core::bound_claim_status(&c, &v) {
                    self.put_claim(n);
                }
            }
            Action::ClaimPhase { claim, phase } => {
                if let Some(n) = self
                    .claims
                    .get(claim)
                    .and_then(|c| core::with_claim_phase(c, phase))
                {
                    self.put_claim(n);
                }
            }
            Action::VolumePhase { pv, phase, message } => {
                if let Some(v) = self.pvs.get(pv) {
                    let n = core::with_pv_phase(v, phase, message);
                    self.put_pv(n);
                }
            }
            Action::ClaimCondition {
                claim,
                reason,
                message,
            } => {
                if let Some(c) = self.claims.get(claim) {
                    let n = core::with_pending_condition(
                        c,
                        reason,
                        message,
                        k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
                    );
                    self.put_claim(n);
                }
            }
            Action::Release { pv } => {
                if let Some(v) = self.pvs.get(pv) {
                    let n = core::with_pv_phase(v, "Released", "");
                    self.put_pv(n);
                }
            }
            Action::Unbind { pv } => {
                if let Some(v) = self.pvs.get(pv) {
                    let n = core::with_pv_phase(&core::unbound_pv(v), "Available", "");
                    self.put_pv(n);
                }
            }
            _ => {}
        }
    }
}

fn no_class(_: &str) -> Option<Arc<k8s_openapi::api::storage::v1::StorageClass>> {
    None
}

fn env() -> Env<'static> {
    super::env_with(&no_class)
}

const SIZES: [&str; 4] = ["1Gi", "2Gi", "5Gi", "10Gi"];
const MODES: [&[&str]; 4] = [
    &["ReadWriteOnce"],
    &["ReadOnlyMany"],
    &["ReadWriteOnce", "ReadWriteMany"],
    &["ReadWriteMany"],
];

prop_compose! {
    fn volume(i: usize, claims: usize)(size in 0..4usize, modes in 0..4usize, class in 0..2usize, tier in proptest::bool::ANY, pre in proptest::option::weighted(0.2, 0..claims.max(1)), block in proptest::bool::weighted(0.15)) -> PersistentVolume {
        let mut b = pv(&format!("pv{i}")).capacity(SIZES[size]).access_modes(MODES[modes]).class(["", "a"][class]);
        if tier { b = b.label("tier", "gold"); }
        if block { b = b.block(); }
        if let Some(c) = pre { b = b.claim_ref("ns", &format!("c{c}"), ""); }
        b.build()
    }
}

prop_compose! {
    fn claim(i: usize, pvs: usize)(size in 0..4usize, modes in 0..2usize, class in 0..2usize, sel in proptest::bool::weighted(0.2), named in proptest::option::weighted(0.15, 0..pvs.max(1)), block in proptest::bool::weighted(0.15)) -> PersistentVolumeClaim {
        let mut b = pvc("ns", &format!("c{i}")).request(SIZES[size]).access_modes(MODES[modes]).class(["", "a"][class]);
        if sel { b = b.selector("tier", "gold"); }
        if block { b = b.block(); }
        if let Some(v) = named { b = b.volume_name(&format!("pv{v}")); }
        let mut c = b.build();
        c.metadata.uid = Some(format!("uid-c{i}"));
        c
    }
}

fn world() -> impl Strategy<Value = World> {
    (0usize..8, 0usize..10).prop_flat_map(|(np, nc)| {
        let vols: Vec<_> = (0..np).map(|i| volume(i, nc)).collect();
        let claims: Vec<_> = (0..nc).map(|i| claim(i, np)).collect();
        (vols, claims).prop_map(|(vols, claims)| {
            let mut w = World {
                pvs: BTreeMap::new(),
                claims: BTreeMap::new(),
                rv: 0,
            };
            for v in vols {
                w.put_pv(v);
            }
            for c in claims {
                w.put_claim(c);
            }
            w
        })
    })
}

/// The invariants that must hold in every state the model passes through.
fn check_invariants(w: &World) -> Result<(), TestCaseError> {
    let mut holders: BTreeMap<&str, &str> = BTreeMap::new();
    for (key, c) in &w.claims {
        if claim_phase(c) != "Bound" {
            continue;
        }
        let vol = claim_volume_name(c);
        let v = w
            .pvs
            .get(vol)
            .ok_or_else(|| TestCaseError::fail(format!("{key} bound to missing {vol}")))?;
        prop_assert!(
            holders.insert(vol, key).is_none(),
            "volume {} holds two claims",
            vol
        );
        prop_assert_eq!(
            claim_ref(v).map(|r| r.2),
            c.metadata.uid.as_deref(),
            "{} not pointing back at {}",
            vol,
            key
        );
        // Capacity, access modes and volume mode hold for every binding; class and selector too
        // unless the claim asked for the volume by name (upstream skips those then) or the volume
        // was pre-bound to it.
        // Which rules upstream applies depends on who chose the pairing: nobody checks a pairing
        // the user made from both sides; a claim naming a volume skips the selector; a volume
        // pre-bound to the claim skips class and selector.
        let claim_named = !has_ann(c, ANN_BOUND_BY_CONTROLLER);
        let pv_prebound = !has_ann(v, ANN_BOUND_BY_CONTROLLER);
        let scope = match (claim_named, pv_prebound) {
            (true, true) => continue,
            (true, false) => core::Scope::Named,
            (false, true) => core::Scope::Prebound,
            (false, false) => core::Scope::Any,
        };
        if let Err(m) = core::check(v, c, scope) {
            prop_assert!(false, "{} bound to {} which does not satisfy it: {}", key, vol, m);
        }
    }
    Ok(())
}

/// Syncs every object in `order` until a full pass produces no action; returns the passes used.
fn converge(w: &mut World, order: &[usize]) -> Result<usize, TestCaseError> {
    let env = env();
    for pass in 0..30 {
        let mut keys: Vec<(bool, String)> = w.pvs.keys().map(|k| (true, k.clone())).collect();
        keys.extend(w.claims.keys().map(|k| (false, k.clone())));
        // A random permutation of all keys: `order` gives each position a weight.
        let mut perm: Vec<usize> = (0..keys.len()).collect();
        perm.sort_by_key(|i| {
            (
                order.get((i + pass) % order.len().max(1)).copied().unwrap_or(0),
                *i,
            )
        });
        let mut any = false;
        for i in perm {
            let (is_pv, key) = &keys[i];
            let cache = w.cache();
            let actions: Vec<Action> = if *is_pv {
                match w.pvs.get(key) {
                    Some(v) => core::sync_volume(v, &cache, &env),
                    None => vec![],
                }
            } else {
                match w.claims.get(key) {
                    Some(c) => core::sync_claim(c, &cache, &env),
                    None => vec![],
                }
            };
            for a in actions
                .iter()
                .filter(|a| !matches!(a, Action::Event(_) | Action::WakeClaim(_)))
            {
                any = true;
                w.apply(a);
                check_invariants(w)?;
            }
        }
        if !any {
            return Ok(pass);
        }
    }
    Err(TestCaseError::fail("did not converge in 30 passes"))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_worlds_converge_safely_in_any_order(w in world(), orders in proptest::collection::vec(proptest::collection::vec(0usize..64, 0..40), 2)) {
        for order in &orders {
            let mut w = w.clone();
            converge(&mut w, order)?;
            check_invariants(&w)?;
            // Converged: one more sync of everything yields nothing.
            let env = env();
            let cache = w.cache();
            for v in w.pvs.values() {
                let a: Vec<_> = core::sync_volume(v, &cache, &env).into_iter().filter(|a| !matches!(a, Action::Event(_) | Action::WakeClaim(_))).collect();
                prop_assert!(a.is_empty(), "converged volume {} still wants {:?}", v.name_any(), a);
            }
            for c in w.claims.values() {
                let a: Vec<_> = core::sync_claim(c, &cache, &env).into_iter().filter(|a| !matches!(a, Action::Event(_))).collect();
                prop_assert!(a.is_empty(), "converged claim {} still wants {:?}", claim_key(c), a);
            }
        }
    }

    #[test]
    fn deleting_claims_releases_exactly_their_volumes(w in world()) {
        let mut w = w;
        converge(&mut w, &[])?;
        let bound: Vec<(String, String)> = w.claims.iter().filter(|(_, c)| claim_phase(c) == "Bound").map(|(k, c)| (k.clone(), claim_volume_name(c).to_string())).collect();
        for (k, _) in &bound {
            w.claims.remove(k);
        }
        converge(&mut w, &[])?;
        for (_, v) in &bound {
            // Retain volumes whose claim is gone stay Released; never Available with a stale claim.
            prop_assert_eq!(pv_phase(&w.pvs[v]), "Released");
        }
    }

    #[test]
    fn incremental_index_equals_a_rebuilt_one(w in world(), updates in proptest::collection::vec((0usize..8, 0usize..3), 0..30)) {
        let mut w = w;
        let mut cache = w.cache();
        let names: Vec<String> = w.pvs.keys().cloned().collect();
        for (i, change) in updates {
            let Some(name) = names.get(i % names.len().max(1)) else { break };
            let Some(v) = w.pvs.get(name).cloned() else { continue };
            let next = match change {
                0 => core::with_pv_phase(&v, "Available", ""),
                1 => core::with_pv_phase(&v, "Released", ""),
                _ => core::unbound_pv(&v),
            };
            w.put_pv(next.clone());
            cache.put_pv(Arc::new(w.pvs[name].clone()));
        }
        let mut rebuilt = VolumeIndex::default();
        for v in w.pvs.values() {
            rebuilt.upsert(v);
        }
        prop_assert!(cache.index == rebuilt);
    }
}
