//! The volume manager's decisions: compare desired with actual state and list the operations, in
//! upstream's mandatory order (tear down pods' mounts that are no longer wanted, mount what is
//! wanted, then unmount devices nobody uses), and pick which of them may start now.

use tokio::time::Instant;

use crate::state::{Actual, AttachStatus, Desired};
use crate::tracker::{OpKey, Tracker};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Unmount a pod's bind mount (or remove its device file) and its directory.
    Teardown { pv: String, uid: String, block: bool },
    /// Mount the device globally if needed, then publish it into the pod.
    Mount {
        pv: String,
        uid: String,
        mount_device: bool,
    },
    /// Grow the file system of a mounted volume online.
    Expand { pv: String },
    /// Unmount the global device mount and remove its directory.
    UnmountDevice { pv: String },
}

impl Op {
    pub fn pv(&self) -> &str {
        match self {
            Op::Teardown { pv, .. } | Op::Mount { pv, .. } | Op::Expand { pv } | Op::UnmountDevice { pv } => {
                pv
            }
        }
    }

    /// Mounts are keyed by volume alone: that serialises the device mount of pods sharing it.
    pub fn key(&self) -> OpKey {
        match self {
            Op::Teardown { pv, uid, .. } => OpKey::pod(pv, uid),
            _ => OpKey::volume(self.pv()),
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Op::Teardown { .. } => "teardown",
            Op::Mount { .. } => "mount",
            Op::Expand { .. } => "expand_fs",
            Op::UnmountDevice { .. } => "unmount_device",
        }
    }

    /// Position in the pass order.
    pub fn phase(&self) -> u8 {
        match self {
            Op::Teardown { .. } => 0,
            Op::Mount { .. } | Op::Expand { .. } => 1,
            Op::UnmountDevice { .. } => 2,
        }
    }
}

/// Everything that should happen, in order. Idempotent: ops for things already in place are not
/// listed, so calling this again after an op finished lists only what is left.
pub fn reconcile(desired: &Desired, actual: &Actual) -> Vec<Op> {
    let mut ops = Vec::new();

    // 1. Pods' mounts nobody wants: the pod is gone or finished, or its mount is known broken
    // (a corrupted-mount error or another device than the table's; it is mounted again below on
    // a later pass). A live pod's mount that is only slow or gave an inconclusive error is left
    // alone (upstream never tears down a running pod's volume for that). Live pods whose claims
    // do not resolve right now keep their mounts: an API hiccup must not pull a volume from
    // under a running pod.
    for (pv, av) in &actual.volumes {
        for (uid, pm) in &av.pods {
            let live = desired.live_pods.contains(uid);
            let wanted = desired
                .volumes
                .get(pv)
                .is_some_and(|dv| dv.pods.contains_key(uid));
            let broken = pm.state.broken();
            if !live || (wanted && broken) {
                ops.push(Op::Teardown {
                    pv: pv.clone(),
                    uid: uid.clone(),
                    block: pm.block,
                });
            }
        }
    }

    // 2. Mounts wanted. Only once the attachment is done and the node status lists the volume
    // both as in use (so the controller cannot detach it in the middle of the mount) and as
    // attached (so the controller is not already detaching it: it takes the volume out of
    // volumesAttached before it deletes the attachment).
    for (pv, dv) in &desired.volumes {
        let av = actual.volumes.get(pv);
        let AttachStatus::Attached { .. } = dv.attachment else {
            continue;
        };
        if !dv.reported_in_use || !dv.listed_attached {
            continue;
        }
        let device = av.and_then(|a| a.device.as_ref());
        if device.is_some_and(|d| d.unsure()) {
            // The device mount does not answer: mounting over or next to it would only add
            // stuck work. Wait for its probe.
            continue;
        }
        let device_ok = device.is_some_and(|d| d.ok());
        let mut mounting = false;
        for uid in dv.pods.keys() {
            let pm = av.and_then(|a| a.pods.get(uid));
            match pm {
                Some(pm) if pm.state.ok() => continue,
                // Broken: torn down first (above); slow or unsure: left alone until it answers.
                Some(pm) if pm.state.mounted => continue,
                _ => {}
            }
            ops.push(Op::Mount {
                pv: pv.clone(),
                uid: uid.clone(),
                mount_device: !dv.block && !device_ok,
            });
            mounting = true;
        }
        let any_pod_mounted = av.is_some_and(|a| a.pods.values().any(|p| p.state.ok()));
        if dv.resize_to.is_some() && !mounting && any_pod_mounted && (dv.block || device_ok) {
            ops.push(Op::Expand { pv: pv.clone() });
        }
    }

    // 3. Devices nobody uses: not desired and no pod mount (or leftover pod dir) is left.
    for (pv, av) in &actual.volumes {
        if av.device.is_some() && av.pods.is_empty() && !desired.volumes.contains_key(pv) {
            ops.push(Op::UnmountDevice { pv: pv.clone() });
        }
    }
    ops
}

/// The ops that may start now: no conflict with a running op or with one picked before in this
/// pass, and not waiting out a backoff. Order is kept.
pub fn schedule(ops: Vec<Op>, tracker: &Tracker, now: Instant) -> Vec<Op> {
    let mut picked: Vec<Op> = Vec::new();
    for op in ops {
        let key = op.key();
        if !tracker.can_start(&key, op.kind(), now) {
            continue;
        }
        if picked.iter().any(|p| p.key().conflicts(&key)) {
            continue;
        }
        picked.push(op);
    }
    picked
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use proptest::prelude::*;

    use super::*;
    use crate::state::{ActualVolume, Claim, DesiredVolume, Health, Mounted, PodInfo, PodMount, PodUse};

    fn with_health(health: Health) -> Mounted {
        Mounted {
            mounted: true,
            health,
            devno: Some((7, 0)),
            source: None,
            read_only: false,
        }
    }

    fn mounted(ok: bool) -> Mounted {
        with_health(if ok {
            Health::Healthy
        } else {
            Health::Broken("stat failed: Transport endpoint is not connected".into())
        })
    }

    fn pending() -> Mounted {
        with_health(Health::Pending)
    }

    fn leftover() -> Mounted {
        Mounted::absent()
    }

    fn use_(uid: &str) -> PodUse {
        PodUse {
            pod: PodInfo {
                uid: uid.into(),
                namespace: "ns".into(),
                name: uid.into(),
                created: None,
            },
            spec_name: "data".into(),
            read_only: false,
            fs_group: None,
            fs_group_on_root_mismatch: false,
        }
    }

    /// `attached`: the attachment is done and the node status lists it in volumesAttached.
    fn dv(pv: &str, uids: &[&str], attached: bool, reported: bool) -> DesiredVolume {
        DesiredVolume {
            pv: pv.into(),
            handle: pv.into(),
            block: false,
            fs_type: "ext4".into(),
            pv_read_only: false,
            gid: None,
            claim: Claim {
                namespace: "ns".into(),
                name: "c".into(),
                uid: "u".into(),
            },
            attachment: if attached {
                AttachStatus::Attached {
                    device: "/dev/loop0".into(),
                }
            } else {
                AttachStatus::Pending { error: None }
            },
            reported_in_use: reported,
            listed_attached: attached,
            resize_to: None,
            pods: uids.iter().map(|u| (u.to_string(), use_(u))).collect(),
        }
    }

    fn desired(vols: Vec<DesiredVolume>, extra_live: &[&str]) -> Desired {
        let mut live: BTreeSet<String> = extra_live.iter().map(|s| s.to_string()).collect();
        for v in &vols {
            live.extend(v.pods.keys().cloned());
        }
        Desired {
            volumes: vols.into_iter().map(|v| (v.pv.clone(), v)).collect(),
            live_pods: live,
            errors: vec![],
        }
    }

    fn av(device: Option<Mounted>, pods: &[(&str, Mounted)]) -> ActualVolume {
        ActualVolume {
            device,
            pods: pods
                .iter()
                .map(|(u, m)| {
                    (
                        u.to_string(),
                        PodMount {
                            block: false,
                            state: m.clone(),
                        },
                    )
                })
                .collect(),
        }
    }

    #[test]
    fn first_mount_mounts_the_device_then_the_pod() {
        let d = desired(vec![dv("v", &["a"], true, true)], &[]);
        let ops = reconcile(&d, &Actual::default());
        assert_eq!(
            ops,
            vec![Op::Mount {
                pv: "v".into(),
                uid: "a".into(),
                mount_device: true
            }]
        );
    }

    #[test]
    fn waits_for_attach_and_for_volumes_in_use() {
        for (att, rep) in [(false, true), (true, false), (false, false)] {
            let d = desired(vec![dv("v", &["a"], att, rep)], &[]);
            assert!(reconcile(&d, &Actual::default()).is_empty());
        }
    }

    /// The attachment says attached, but the node status no longer lists it (the controller
    /// took it out before deleting the attachment) or does not list it yet: nothing is mounted.
    #[test]
    fn waits_until_the_node_status_lists_the_volume_attached() {
        let mut v = dv("v", &["a"], true, true);
        v.listed_attached = false;
        let d = desired(vec![v], &[]);
        assert!(reconcile(&d, &Actual::default()).is_empty());
    }

    #[test]
    fn second_pod_reuses_the_device_mount() {
        let d = desired(vec![dv("v", &["a", "b"], true, true)], &[]);
        let a = Actual {
            volumes: BTreeMap::from([("v".into(), av(Some(mounted(true)), &[("a", mounted(true))]))]),
        };
        assert_eq!(
            reconcile(&d, &a),
            vec![Op::Mount {
                pv: "v".into(),
                uid: "b".into(),
                mount_device: false
            }]
        );
    }

    #[test]
    fn device_unmounted_only_after_last_pod() {
        let a = Actual {
            volumes: BTreeMap::from([(
                "v".into(),
                av(Some(mounted(true)), &[("a", mounted(true)), ("b", mounted(true))]),
            )]),
        };
        // b went away: only its bind mount goes.
        let d = desired(vec![dv("v", &["a"], true, true)], &[]);
        assert_eq!(
            reconcile(&d, &a),
            vec![Op::Teardown {
                pv: "v".into(),
                uid: "b".into(),
                block: false
            }]
        );
        // both gone: both bind mounts first, the device on a later pass.
        let ops = reconcile(&Desired::default(), &a);
        assert_eq!(ops.len(), 2);
        assert!(ops.iter().all(|o| matches!(o, Op::Teardown { .. })));
        let a = Actual {
            volumes: BTreeMap::from([("v".into(), av(Some(mounted(true)), &[]))]),
        };
        assert_eq!(
            reconcile(&Desired::default(), &a),
            vec![Op::UnmountDevice { pv: "v".into() }]
        );
    }

    #[test]
    fn broken_pod_mount_is_torn_down_then_remounted() {
        let d = desired(vec![dv("v", &["a"], true, true)], &[]);
        let a = Actual {
            volumes: BTreeMap::from([("v".into(), av(Some(mounted(true)), &[("a", mounted(false))]))]),
        };
        assert_eq!(
            reconcile(&d, &a),
            vec![Op::Teardown {
                pv: "v".into(),
                uid: "a".into(),
                block: false
            }]
        );
        let a = Actual {
            volumes: BTreeMap::from([("v".into(), av(Some(mounted(true)), &[("a", leftover())]))]),
        };
        assert_eq!(
            reconcile(&d, &a),
            vec![Op::Mount {
                pv: "v".into(),
                uid: "a".into(),
                mount_device: false
            }]
        );
    }

    #[test]
    fn slow_or_unsure_mount_of_a_running_pod_is_left_alone() {
        let d = desired(vec![dv("v", &["a"], true, true)], &[]);
        for state in [
            pending(),
            with_health(Health::Unknown("stat failed: Permission denied".into())),
        ] {
            let a = Actual {
                volumes: BTreeMap::from([("v".into(), av(Some(mounted(true)), &[("a", state.clone())]))]),
            };
            assert!(
                reconcile(&d, &a).is_empty(),
                "{state:?}: neither torn down nor mounted over"
            );
        }
        // A gone pod's slow mount is still cleaned up (plain unmount, no lazy one).
        let a = Actual {
            volumes: BTreeMap::from([("v".into(), av(Some(mounted(true)), &[("a", pending())]))]),
        };
        assert_eq!(
            reconcile(&Desired::default(), &a),
            vec![Op::Teardown {
                pv: "v".into(),
                uid: "a".into(),
                block: false
            }]
        );
    }

    #[test]
    fn no_mount_next_to_a_device_mount_that_does_not_answer() {
        let d = desired(vec![dv("v", &["a", "b"], true, true)], &[]);
        let a = Actual {
            volumes: BTreeMap::from([("v".into(), av(Some(pending()), &[("a", mounted(true))]))]),
        };
        assert!(reconcile(&d, &a).is_empty());
    }

    #[test]
    fn live_pod_with_unresolvable_claim_keeps_its_mount() {
        let d = desired(vec![], &["a"]);
        let a = Actual {
            volumes: BTreeMap::from([("v".into(), av(Some(mounted(true)), &[("a", mounted(false))]))]),
        };
        assert!(reconcile(&d, &a).is_empty());
    }

    #[test]
    fn expands_only_mounted_volumes() {
        let mut v = dv("v", &["a"], true, true);
        v.resize_to = Some("2Gi".into());
        let d = desired(vec![v], &[]);
        assert!(
            reconcile(&d, &Actual::default())
                .iter()
                .all(|o| !matches!(o, Op::Expand { .. }))
        );
        let a = Actual {
            volumes: BTreeMap::from([("v".into(), av(Some(mounted(true)), &[("a", mounted(true))]))]),
        };
        assert_eq!(reconcile(&d, &a), vec![Op::Expand { pv: "v".into() }]);
    }

    #[test]
    fn schedule_runs_one_volume_op_at_a_time() {
        let ops = vec![
            Op::Teardown {
                pv: "v".into(),
                uid: "a".into(),
                block: false,
            },
            Op::Teardown {
                pv: "v".into(),
                uid: "b".into(),
                block: false,
            },
            Op::Mount {
                pv: "v".into(),
                uid: "c".into(),
                mount_device: false,
            },
            Op::Mount {
                pv: "w".into(),
                uid: "c".into(),
                mount_device: true,
            },
        ];
        let t = Tracker::default();
        let picked = schedule(ops, &t, Instant::now());
        assert_eq!(
            picked.len(),
            3,
            "two teardowns of different pods and the other volume's mount"
        );
        assert!(
            picked
                .iter()
                .all(|o| !(o.pv() == "v" && matches!(o, Op::Mount { .. })))
        );
    }

    // Random worlds over a few volumes and pods.
    fn arb_mounted() -> impl Strategy<Value = Mounted> {
        (any::<bool>(), 0..4u8).prop_map(|(m, h)| {
            if !m {
                return Mounted::absent();
            }
            with_health(match h {
                0 => Health::Healthy,
                1 => Health::Pending,
                2 => Health::Unknown("stat failed: Permission denied".into()),
                _ => Health::Broken("stat failed: Stale file handle".into()),
            })
        })
    }

    const PVS: [&str; 3] = ["v1", "v2", "v3"];
    const UIDS: [&str; 4] = ["a", "b", "c", "d"];

    fn arb_world() -> impl Strategy<Value = (Desired, Actual)> {
        let dvs = proptest::collection::vec(
            (
                0..3usize,
                proptest::collection::btree_set(0..4usize, 1..4),
                any::<bool>(),
                any::<bool>(),
                any::<bool>(),
                any::<bool>(),
            ),
            0..4,
        );
        let avs = proptest::collection::vec(
            (
                0..3usize,
                proptest::option::of(arb_mounted()),
                proptest::collection::btree_map(0..4usize, (arb_mounted(), any::<bool>()), 0..4),
            ),
            0..4,
        );
        let extra_live = proptest::collection::btree_set(0..4usize, 0..4);
        (dvs, avs, extra_live).prop_map(|(dvs, avs, extra)| {
            let mut vols = BTreeMap::new();
            for (p, uids, att, rep, block, listed) in dvs {
                let uids: Vec<&str> = uids.iter().map(|i| UIDS[*i]).collect();
                let mut v = dv(PVS[p], &uids, att, rep);
                v.block = block;
                v.listed_attached = att && listed;
                vols.insert(PVS[p].to_string(), v);
            }
            let extra: Vec<&str> = extra.iter().map(|i| UIDS[*i]).collect();
            let d = desired(vols.into_values().collect(), &extra);
            let mut a = Actual::default();
            for (p, dev, pods) in avs {
                a.volumes.insert(
                    PVS[p].to_string(),
                    ActualVolume {
                        device: dev,
                        pods: pods
                            .into_iter()
                            .map(|(u, (m, b))| (UIDS[u].to_string(), PodMount { block: b, state: m }))
                            .collect(),
                    },
                );
            }
            (d, a)
        })
    }

    proptest! {
        #[test]
        fn decisions_are_safe((d, a) in arb_world()) {
            let ops = reconcile(&d, &a);
            // Upstream order.
            prop_assert!(ops.windows(2).all(|w| w[0].phase() <= w[1].phase()));
            for op in &ops {
                match op {
                    Op::UnmountDevice { pv } => {
                        // Never under a desired pod or while any pod mount remains.
                        prop_assert!(!d.volumes.contains_key(pv));
                        prop_assert!(a.volumes[pv].pods.is_empty());
                    }
                    Op::Teardown { pv, uid, .. } => {
                        // A pod that may still run loses a mount only when it is known broken
                        // and wanted again: never for being slow or unsure, never a healthy one.
                        let pm = &a.volumes[pv].pods[uid];
                        if d.live_pods.contains(uid) {
                            prop_assert!(pm.state.broken());
                            prop_assert!(d.volumes.get(pv).is_some_and(|v| v.pods.contains_key(uid)));
                        }
                    }
                    Op::Mount { pv, uid, mount_device } => {
                        let dv = &d.volumes[pv];
                        prop_assert!(dv.reported_in_use);
                        prop_assert!(dv.listed_attached);
                        let attached = matches!(dv.attachment, AttachStatus::Attached { .. });
                        prop_assert!(attached);
                        prop_assert!(dv.pods.contains_key(uid));
                        // Block volumes have no device mount; a healthy device mount is reused,
                        // one that does not answer is waited for.
                        let dev = a.volumes.get(pv).and_then(|v| v.device.as_ref());
                        prop_assert!(!dev.is_some_and(|m| m.unsure()));
                        let dev_ok = dev.is_some_and(|m| m.ok());
                        prop_assert_eq!(*mount_device, !dv.block && !dev_ok);
                    }
                    Op::Expand { pv } => prop_assert!(d.volumes[pv].resize_to.is_some()),
                }
            }
            // Idempotence: nothing is listed twice.
            for (i, x) in ops.iter().enumerate() {
                prop_assert!(!ops[i + 1..].contains(x));
            }
            // Whatever is scheduled never conflicts with itself.
            let picked = schedule(ops, &Tracker::default(), Instant::now());
            for (i, x) in picked.iter().enumerate() {
                for y in &picked[i + 1..] {
                    prop_assert!(!x.key().conflicts(&y.key()));
                }
            }
        }
    }
}
