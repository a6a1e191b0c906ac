//! The claim/volume invariants and the single-writer check on attachments.

use std::collections::{BTreeMap, BTreeSet};

use super::{Observer, PvSnap, Seen, St, state_at};

impl Observer {
    /// No volume is named by two claims at once (checked on every claim change: one stream, so
    /// the cache after each event is the exact state at that revision).
    pub(super) fn check_claim_names(&self, s: &Seen) {
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
    pub(super) fn check_single_writer(&self, s: &Seen) {
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
}

#[cfg(test)]
mod tests {
    use crate::observer::ClaimSnap;
    use crate::observer::test_support::{claim, observer, pv, va};

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
}
