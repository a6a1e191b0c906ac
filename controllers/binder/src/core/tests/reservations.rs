//! The decision cache's reservations: what a lost bind frees and what it keeps.

use crate::core::*;
use stowage_common::store::Stored;
use stowage_testkit::builders::{pv, pvc};

#[test]
fn a_claims_lost_bind_frees_its_reservations_but_not_a_running_volume_bind() {
    let mut cache = Cache::default();
    for (pv, claim) in [("a", "ns/x"), ("b", "ns/x"), ("c", "ns/y")] {
        cache.reserved.insert(pv.into(), claim.into());
    }
    // `b` is reserved for the same claim by its volume's bind, still running.
    cache.release_claim("ns/x", |pv| pv == "b");
    let left: BTreeSet<_> = cache.reserved.keys().map(String::as_str).collect();
    assert_eq!(left, BTreeSet::from(["b", "c"]));
}

#[test]
fn the_cache_skips_the_very_object_it_holds_and_older_versions() {
    let mut cache = Cache::default();
    let mut v = pv("v1").capacity("1Gi").class("c").build();
    v.metadata.uid = Some("u1".into());
    v.metadata.resource_version = Some("5".into());
    v.status = Some(k8s_openapi::api::core::v1::PersistentVolumeStatus {
        phase: Some("Available".into()),
        ..Default::default()
    });
    let shared = Arc::new(Stored::new(v.clone()));
    let put = cache.put_pv(shared.clone()).expect("a new volume is stored");
    assert!(put.old.is_none());
    assert_eq!(put.new, v);
    let rwo = ["ReadWriteOnce".to_string()].into_iter().collect();
    assert_eq!(cache.index.groups("c", &rwo, 0).len(), 1);
    // A resync hands back the same shared object: nothing changes, nothing is reported.
    assert!(cache.put_pv(shared).is_none());
    // An older version is refused; an equal version (a relist's copy) is stored.
    let mut older = v.clone();
    older.metadata.resource_version = Some("4".into());
    assert!(cache.put_pv(older).is_none());
    let again = cache.put_pv(v.clone()).expect("an equal version passes");
    assert_eq!(again.old.as_ref(), Some(&v));
    assert_eq!(cache.decode_pv("v1").as_deref(), Some(&v));

    let mut c = pvc("ns", "c1").build();
    c.metadata.uid = Some("u2".into());
    c.metadata.resource_version = Some("7".into());
    let shared = Arc::new(Stored::new(c.clone()));
    assert!(cache.put_claim(shared.clone()));
    assert!(!cache.put_claim(shared));
    assert!(cache.put_claim(c.clone()));
    assert_eq!(cache.decode_claim("ns/c1").as_deref(), Some(&c));
}
