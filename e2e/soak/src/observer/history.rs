//! Per-kind histories by resourceVersion: what each watch saw, and where it saw nothing (the gaps
//! of a relist).

use std::collections::HashMap;

#[derive(Clone, Debug, PartialEq)]
pub enum St<T> {
    Present(T),
    Gone,
    /// The watch had a gap: the object may have changed in ways not seen.
    Unknown,
}

/// One kind's histories, keyed by UID (claims, attachments) or name (volumes, nodes).
pub struct Stream<T> {
    pub hist: HashMap<String, Vec<(u64, St<T>)>>,
    /// Every change with a resourceVersion up to this one has been seen.
    pub frontier: u64,
    listing: Option<HashMap<String, (u64, T)>>,
    /// The first list is complete.
    pub synced: bool,
    /// Revision ranges the watch did not see (lost, then relisted): an object created and deleted
    /// inside one is in no history at all.
    gaps: Vec<(u64, u64)>,
    /// A gap still open: from here until the first change after the relist.
    open_gap: Option<u64>,
}

impl<T: Clone + PartialEq> Default for Stream<T> {
    fn default() -> Self {
        Self {
            hist: HashMap::new(),
            frontier: 0,
            listing: None,
            synced: false,
            gaps: Vec::new(),
            open_gap: None,
        }
    }
}

impl<T: Clone + PartialEq> Stream<T> {
    fn push(&mut self, key: &str, rv: u64, st: St<T>) {
        let h = self.hist.entry(key.to_string()).or_default();
        if h.last().is_some_and(|(r, s)| *r >= rv && *s == st) {
            return;
        }
        h.push((rv, st));
    }

    pub fn apply(&mut self, key: &str, rv: u64, snap: T) {
        if let Some(list) = self.listing.as_mut() {
            list.insert(key.to_string(), (rv, snap));
            return;
        }
        self.close_gap(rv);
        self.push(key, rv, St::Present(snap));
        self.frontier = self.frontier.max(rv);
    }

    pub fn delete(&mut self, key: &str, rv: u64) {
        self.close_gap(rv);
        self.push(key, rv, St::Gone);
        self.frontier = self.frontier.max(rv);
    }

    /// The first change after a relist: the watch saw everything from its list on, so nothing
    /// between the list and this change was missed (the list's own revision is not known here).
    fn close_gap(&mut self, rv: u64) {
        if let Some(g) = self.open_gap.take() {
            self.gaps.push((g, rv.saturating_sub(1)));
        }
    }

    /// Whether every revision in `[from, until)` fell in a gap (nothing can be said of them).
    pub fn unseen(&self, from: u64, until: u64) -> bool {
        let mut x = from;
        while x < until {
            if self.open_gap.is_some_and(|g| g <= x) {
                return true;
            }
            match self
                .gaps
                .iter()
                .filter(|(a, b)| *a <= x && x <= *b)
                .map(|(_, b)| *b)
                .max()
            {
                Some(end) => x = end.saturating_add(1),
                None => return false,
            }
        }
        true
    }

    pub fn begin_list(&mut self) {
        self.listing = Some(HashMap::new());
        // Changes after the last one seen may be missing until the relist is followed.
        self.open_gap.get_or_insert(self.frontier + 1);
    }

    /// A fresh list replaces what is known: objects that changed or vanished while the watch was
    /// away are Unknown from just after their last seen version.
    pub fn end_list(&mut self) {
        let Some(list) = self.listing.take() else {
            return;
        };
        self.synced = true;
        let mut newest = self.frontier;
        for (key, h) in self.hist.iter_mut() {
            let last = h.last().map(|(r, _)| *r).unwrap_or(0);
            let still_gone = matches!(h.last(), Some((_, St::Gone))) && !list.contains_key(key);
            let same = list.get(key).is_some_and(|(rv, _)| *rv == last);
            if !still_gone && !same && !matches!(h.last(), Some((_, St::Unknown))) {
                h.push((last + 1, St::Unknown));
            }
        }
        // An object first seen in this list may have existed, in other states, since the watch
        // was lost: unknown from then until the version listed.
        let gap_start = self.frontier + 1;
        for (key, (rv, snap)) in list {
            newest = newest.max(rv);
            let h = self.hist.entry(key).or_default();
            if h.is_empty() && gap_start < rv {
                h.push((gap_start, St::Unknown));
            }
            let last = h.last().map(|(r, _)| *r).unwrap_or(0);
            if rv > last || h.is_empty() {
                h.push((rv, St::Present(snap)));
            }
        }
        self.frontier = newest;
    }

    pub fn listing(&self) -> bool {
        self.listing.is_some()
    }

    /// The latest state of every object.
    pub fn current(&self) -> impl Iterator<Item = (&String, &St<T>)> {
        self.hist
            .iter()
            .filter_map(|(k, h)| h.last().map(|(_, s)| (k, s)))
    }
}

/// The state of history `h` at revision `rv`: `None` when nothing was known then.
pub fn state_at<T>(h: &[(u64, St<T>)], rv: u64) -> Option<&St<T>> {
    h.iter().take_while(|(r, _)| *r <= rv).last().map(|(_, s)| s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observer::PvSnap;
    use crate::observer::test_support::pv;

    #[test]
    fn state_at_picks_the_last_change_not_after() {
        let h = vec![(5, St::Present(1)), (9, St::Gone)];
        assert_eq!(state_at(&h, 4), None);
        assert_eq!(state_at(&h, 5), Some(&St::Present(1)));
        assert_eq!(state_at(&h, 8), Some(&St::Present(1)));
        assert_eq!(state_at(&h, 9), Some(&St::Gone));
    }

    #[test]
    fn gaps_cover_only_what_was_missed() {
        let mut st: Stream<PvSnap> = Stream::default();
        st.apply("v", 5, pv(None));
        st.begin_list();
        st.end_list();
        assert!(st.unseen(6, 100), "open until the first change after the list");
        st.apply("v", 20, pv(None));
        assert!(st.unseen(6, 20));
        assert!(!st.unseen(6, 21));
        assert!(!st.unseen(3, 10));
    }

    #[test]
    fn a_relist_marks_the_gap_unknown() {
        let mut st: Stream<u32> = Stream::default();
        st.apply("a", 5, 1);
        st.apply("b", 6, 1);
        st.begin_list();
        st.apply("a", 9, 2);
        st.end_list();
        assert_eq!(
            st.hist["a"],
            vec![(5, St::Present(1)), (6, St::Unknown), (9, St::Present(2))]
        );
        assert_eq!(st.hist["b"], vec![(6, St::Present(1)), (7, St::Unknown)]);
        assert_eq!(st.frontier, 9);
        // Created while the watch was away: unknown since the watch was lost.
        st.begin_list();
        st.apply("a", 9, 2);
        st.apply("c", 12, 3);
        st.end_list();
        assert_eq!(st.hist["c"], vec![(10, St::Unknown), (12, St::Present(3))]);
    }
}
