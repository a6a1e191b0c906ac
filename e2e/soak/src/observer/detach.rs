//! No VolumeAttachment is deleted while its node uses the volume.

use super::{NodeSnap, Observer, Seen, St, VaSnap, state_at};

/// Whether the node may have mounted `volume` during the stretch of revisions, up to `rv`, in
/// which it has listed the volume in `volumesInUse` without a break: a node mounts only what
/// `volumesAttached` lists, so the question is whether any snapshot of that stretch listed it
/// there too. Only a stretch that began after `volumesAttached` had dropped the volume (a pod that
/// arrived after the controller's decision) clears the node; a stretch that runs into an unknown
/// state or a deletion, or back to the start of the history, cannot be cleared.
fn listed_while_in_use(h: &[(u64, St<NodeSnap>)], rv: u64, volume: &str) -> bool {
    let upto = h.partition_point(|(r, _)| *r <= rv);
    for (_, st) in h[..upto].iter().rev() {
        match st {
            St::Present(n) if n.in_use.contains(volume) => {
                if n.attached.contains(volume) {
                    return true;
                }
            }
            St::Present(_) => return false,
            St::Gone | St::Unknown => return true,
        }
    }
    true
}

impl Observer {
    /// An attachment is deleted (deletionTimestamp set, or removed outright) only when its node no
    /// longer lists the volume in `volumesInUse`, unless the node has the out-of-service taint
    /// then (the documented forced detach). The protocol (upstream's, and stowage's) leaves one
    /// race: the controller takes the volume out of `volumesAttached`, reads `volumesInUse`, then
    /// deletes; a pod arriving after that read makes the node list the volume in use before the
    /// delete lands. The node must not mount it then (a first mount needs the volume in
    /// `volumesAttached`, checked live), so that alone is no violation. But the agent lists a
    /// wanted volume in use before it is attached, so an in-use stretch that began unlisted may
    /// well have been listed later, and mounted: only a stretch in which `volumesAttached` never
    /// listed the volume is the race.
    pub(super) fn judge_detaches(&self, s: &mut Seen) -> u64 {
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
            if listed_while_in_use(nh, rv, &name) {
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
    use crate::observer::test_support::{node, observer, pv, va};

    const NAME: &str = "kubernetes.io/csi/loop.stowage.dev^h";

    /// Judges one attachment `x` of volume `v` on node `a` deleted at revision 20, with the
    /// node's `(revision, volumesInUse, volumesAttached)` snapshots before it; returns the
    /// violations and the raced-detach notes.
    fn judge(node_states: &[(u64, &[&str], &[&str])]) -> (usize, u64) {
        let (o, r, _d) = observer();
        {
            let mut s = o.lock();
            s.pvs.apply("v", 1, pv(Some("u1")));
            s.vas.apply("x", 2, va("a", true, false));
            for (rv, in_use, attached) in node_states {
                assert!(*rv < 20);
                s.nodes.apply("a", *rv, node(in_use, attached, false));
            }
            s.vas.apply("x", 20, va("a", true, true));
            s.nodes.apply("a", 21, node(&[], &[], false));
        }
        o.judge();
        let snap = r.snapshot();
        let raced = snap.notes.get("detach-raced-a-new-pod").copied().unwrap_or(0);
        (snap.violations.len(), raced)
    }

    /// The agent lists every wanted volume in use before it is attached, so in-use usually begins
    /// before `volumesAttached` lists the volume. Listed while in use, the node may have mounted
    /// it: deleting the attachment then is a violation, however the stretch began.
    #[test]
    fn in_use_before_the_attach_then_listed_then_deleted_is_a_violation() {
        let (violations, raced) = judge(&[
            (3, &[NAME], &[]),
            (5, &[NAME], &[NAME]),
            // The controller drops it from volumesAttached while the node still uses it.
            (8, &[NAME], &[]),
        ]);
        assert_eq!((violations, raced), (1, 0));
        // Still listed attached at the delete: the same.
        let (violations, raced) = judge(&[(3, &[NAME], &[]), (5, &[NAME], &[NAME])]);
        assert_eq!((violations, raced), (1, 0));
    }

    /// A pod that arrives after the controller took the volume out of `volumesAttached` (and read
    /// `volumesInUse`) makes the node list it in use before the delete lands; the node cannot
    /// mount it (no longer listed): the protocol's race, counted as a note. An earlier stretch in
    /// use while listed (a previous pod, gone before) does not count against it.
    #[test]
    fn in_use_only_after_volumes_attached_dropped_it_is_the_protocols_race() {
        let (violations, raced) = judge(&[(3, &[], &[NAME]), (6, &[], &[]), (8, &[NAME], &[])]);
        assert_eq!((violations, raced), (0, 1));
        let (violations, raced) = judge(&[
            (3, &[NAME], &[NAME]),
            (4, &[], &[NAME]),
            (6, &[], &[]),
            (8, &[NAME], &[]),
        ]);
        assert_eq!((violations, raced), (0, 1));
    }

    /// Nothing known about the node's past (a watch gap) cannot clear a delete of a volume in
    /// use.
    #[test]
    fn an_in_use_stretch_reaching_into_a_gap_is_not_excused() {
        let (o, r, _d) = observer();
        {
            let mut s = o.lock();
            s.pvs.apply("v", 1, pv(Some("u1")));
            s.vas.apply("x", 2, va("a", true, false));
            s.nodes.apply("a", 3, node(&[], &[NAME], false));
            s.nodes.begin_list();
            s.nodes.apply("a", 9, node(&[NAME], &[], false));
            s.nodes.end_list();
            s.vas.apply("x", 10, va("a", true, true));
            s.nodes.apply("a", 11, node(&[], &[], false));
        }
        o.judge();
        assert_eq!(r.snapshot().violations.len(), 1);
    }

    #[test]
    fn detach_while_in_use_unless_out_of_service() {
        for (oos, want) in [(false, 1), (true, 0)] {
            let (o, r, _d) = observer();
            {
                let mut s = o.lock();
                s.pvs.apply("v", 1, pv(Some("u1")));
                s.nodes.apply("a", 2, node(&[NAME], &[], oos));
                s.vas.apply("x", 3, va("a", true, false));
                s.nodes.apply("a", 4, node(&[NAME], &[NAME], oos));
                s.vas.apply("x", 5, va("a", true, true));
                s.nodes.apply("a", 6, node(&[], &[], oos));
            }
            o.judge();
            assert_eq!(r.snapshot().violations.len(), want, "oos {oos}");
        }
        // The node dropped the volume before the deletion: fine.
        let (o, r, _d) = observer();
        {
            let mut s = o.lock();
            s.pvs.apply("v", 1, pv(Some("u1")));
            s.nodes.apply("a", 2, node(&[NAME], &[NAME], false));
            s.vas.apply("x", 3, va("a", true, false));
            s.nodes.apply("a", 4, node(&[], &[NAME], false));
            s.vas.apply("x", 5, va("a", true, true));
            s.vas.delete("x", 6);
            s.nodes.apply("a", 7, node(&[], &[], false));
        }
        o.judge();
        let snap = r.snapshot();
        assert!(snap.violations.is_empty(), "{:?}", snap.violations);
        assert_eq!(snap.checks.get("no-detach-while-in-use"), Some(&1));
    }
}
