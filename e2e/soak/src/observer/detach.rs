//! No VolumeAttachment is deleted while its node uses the volume.

use super::{NodeSnap, Observer, Seen, St, VaSnap, state_at};

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

impl Observer {
    /// An attachment is deleted (deletionTimestamp set, or removed outright) only when its node no
    /// longer lists the volume in `volumesInUse`, unless the node has the out-of-service taint
    /// then (the documented forced detach). The protocol (upstream's, and stowage's) leaves one
    /// race: the controller takes the volume out of `volumesAttached`, reads `volumesInUse`, then
    /// deletes; a pod arriving after that read makes the node list the volume in use before the
    /// delete lands. A node then must not mount it (it is no longer in `volumesAttached`), so
    /// that is no violation: the in-use listing must have begun while `volumesAttached` still
    /// listed the volume, and lasted until the delete, for the controller to have been wrong.
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
    use crate::observer::test_support::{node, observer, pv, va};

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
}
