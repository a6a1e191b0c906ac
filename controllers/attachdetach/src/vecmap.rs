//! `VecMap`: a map by `String` kept as a sorted `Vec`, for the many tiny maps of the state (the
//! nodes of one volume, the pods of one volume on one node: nearly always one entry). A
//! `BTreeMap` allocates a whole leaf (room for 11 entries) for the first entry: with the size of
//! an attachment that was ~3.5 KB per volume, the biggest item of the controller's own memory
//! at 4,000 attachments. Iteration is in key order, as the `BTreeMap`s it replaces.

use std::borrow::Borrow;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VecMap<V> {
    items: Vec<(String, V)>,
}

impl<V> Default for VecMap<V> {
    fn default() -> Self {
        Self { items: Vec::new() }
    }
}

impl<V> VecMap<V> {
    fn find(&self, key: &str) -> Result<usize, usize> {
        self.items.binary_search_by(|(k, _)| k.as_str().cmp(key))
    }

    /// Room for one more: exactly one while the map is tiny (a `Vec` would otherwise start at
    /// four slots, most of them never used), the usual doubling beyond.
    fn make_room(&mut self) {
        if self.items.len() == self.items.capacity() && self.items.len() < 4 {
            self.items.reserve_exact(1);
        }
    }

    pub fn get(&self, key: &str) -> Option<&V> {
        self.find(key).ok().map(|i| &self.items[i].1)
    }

    pub fn get_mut(&mut self, key: &str) -> Option<&mut V> {
        self.find(key).ok().map(|i| &mut self.items[i].1)
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.find(key).is_ok()
    }

    /// The value at `key`, inserted from `make` if missing.
    pub fn get_or_insert_with(&mut self, key: &str, make: impl FnOnce() -> V) -> &mut V {
        let i = match self.find(key) {
            Ok(i) => i,
            Err(i) => {
                self.make_room();
                self.items.insert(i, (key.to_string(), make()));
                i
            }
        };
        &mut self.items[i].1
    }

    /// Sets `key` to `value`; returns the value it replaced.
    pub fn insert(&mut self, key: String, value: V) -> Option<V> {
        match self.find(&key) {
            Ok(i) => Some(std::mem::replace(&mut self.items[i].1, value)),
            Err(i) => {
                self.make_room();
                self.items.insert(i, (key, value));
                None
            }
        }
    }

    pub fn remove(&mut self, key: &str) -> Option<V> {
        let i = self.find(key).ok()?;
        let (_, v) = self.items.remove(i);
        // A map that shrank gives its room back (at once while tiny, as `make_room` grows it).
        if self.items.len() < 4 || self.items.len() * 4 < self.items.capacity() {
            self.items.shrink_to_fit();
        }
        Some(v)
    }

    pub fn retain(&mut self, mut keep: impl FnMut(&String, &mut V) -> bool) {
        self.items.retain_mut(|(k, v)| keep(k, v));
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &V)> {
        self.items.iter().map(|(k, v)| (k, v))
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&String, &mut V)> {
        self.items.iter_mut().map(|(k, v)| (&*k, v))
    }

    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.items.iter().map(|(k, _)| k)
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.items.iter().map(|(_, v)| v)
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

impl<V, K: Borrow<str>> FromIterator<(K, V)> for VecMap<V> {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        let mut m = VecMap::default();
        for (k, v) in iter {
            m.insert(k.borrow().to_string(), v);
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    proptest! {
        /// Behaves as a `BTreeMap<String, _>` under any sequence of inserts and removes, and a
        /// map of one entry holds room for one.
        #[test]
        fn matches_a_btreemap(ops in proptest::collection::vec((any::<bool>(), 0..6u8, any::<u8>()), 0..40)) {
            let mut m: VecMap<u8> = VecMap::default();
            let mut b: BTreeMap<String, u8> = BTreeMap::new();
            for (put, k, v) in ops {
                let k = format!("k{k}");
                if put {
                    prop_assert_eq!(m.insert(k.clone(), v), b.insert(k, v));
                } else {
                    prop_assert_eq!(m.remove(&k), b.remove(&k));
                }
                prop_assert_eq!(m.len(), b.len());
                let got: Vec<(&String, &u8)> = m.iter().collect();
                let want: Vec<(&String, &u8)> = b.iter().collect();
                prop_assert_eq!(got, want);
            }
            if m.len() == 1 {
                prop_assert_eq!(m.items.capacity(), 1);
            }
            for k in 0..6u8 {
                let k = format!("k{k}");
                prop_assert_eq!(m.get(&k), b.get(&k));
                prop_assert_eq!(m.contains_key(&k), b.contains_key(&k));
            }
        }
    }
}
