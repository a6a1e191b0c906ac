//! What a managedFields entry says its manager wrote, read straight off the JSON.
//!
//! A watch event's `fieldsV1` is a tree of `f:<field>` keys. Decoding it into a
//! `serde_json::Value` allocates per node, on every event of every PV, claim, attachment and
//! Node the cluster changes; the walk here only looks at the few paths a storage controller
//! writes and steps over the rest without allocating (keys are borrowed from the event's text
//! when they need no unescaping).

use std::borrow::Cow;
use std::fmt;

use serde::Deserialize;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};

/// The storage fields one entry owns. Each names what only a PV binder or an attach/detach
/// controller writes, so another kube-controller-manager controller (the ephemeral-volume one
/// creating claims, node lifecycle tainting Nodes) leaves none of them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Footprint {
    /// `spec.claimRef` (a PV bound or pre-bound by the binder).
    pub claim_ref: bool,
    /// `status.phase` (PV and claim phases; only the binder sets them).
    pub phase: bool,
    /// `spec.volumeName` of a claim.
    pub volume_name: bool,
    /// `pv.kubernetes.io/bind-completed` or `pv.kubernetes.io/bound-by-controller`.
    pub bind_annotations: bool,
    /// `spec.attacher` or `spec.source` of a VolumeAttachment (set at its creation).
    pub attachment_spec: bool,
    /// `status.volumesAttached` of a Node.
    pub volumes_attached: bool,
}

/// Where the walk is in the tree.
#[derive(Clone, Copy)]
enum Level {
    Root,
    Spec,
    Status,
    Metadata,
    Annotations,
}

impl Level {
    /// The level a key leads to, or `None` to step over its value (after marking what it says).
    fn enter(self, key: &str, fp: &mut Footprint) -> Option<Level> {
        match (self, key) {
            (Level::Root, "f:spec") => Some(Level::Spec),
            (Level::Root, "f:status") => Some(Level::Status),
            (Level::Root, "f:metadata") => Some(Level::Metadata),
            (Level::Metadata, "f:annotations") => Some(Level::Annotations),
            (Level::Spec, "f:claimRef") => mark(&mut fp.claim_ref),
            (Level::Spec, "f:volumeName") => mark(&mut fp.volume_name),
            (Level::Spec, "f:attacher" | "f:source") => mark(&mut fp.attachment_spec),
            (Level::Status, "f:phase") => mark(&mut fp.phase),
            (Level::Status, "f:volumesAttached") => mark(&mut fp.volumes_attached),
            (
                Level::Annotations,
                "f:pv.kubernetes.io/bind-completed" | "f:pv.kubernetes.io/bound-by-controller",
            ) => mark(&mut fp.bind_annotations),
            _ => None,
        }
    }
}

fn mark(flag: &mut bool) -> Option<Level> {
    *flag = true;
    None
}

struct Walk<'a> {
    level: Level,
    fp: &'a mut Footprint,
}

impl<'de> DeserializeSeed<'de> for Walk<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Walk<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a fieldsV1 tree")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            match self.level.enter(&key, self.fp) {
                Some(level) => map.next_value_seed(Walk { level, fp: self.fp })?,
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }

    // A leaf (`{}` is the usual one, but any JSON is stepped over).
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(())
    }
}

impl<'de> Deserialize<'de> for Footprint {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut fp = Footprint::default();
        Walk {
            level: Level::Root,
            fp: &mut fp,
        }
        .deserialize(d)?;
        Ok(fp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{Map, Value, json};

    /// The same question answered on a decoded tree: the reference the walk must agree with.
    fn reference(v: &Value) -> Footprint {
        let at = |path: &[&str]| {
            let mut cur = v;
            for k in path {
                match cur.get(k) {
                    Some(next) => cur = next,
                    None => return false,
                }
            }
            true
        };
        Footprint {
            claim_ref: at(&["f:spec", "f:claimRef"]),
            phase: at(&["f:status", "f:phase"]),
            volume_name: at(&["f:spec", "f:volumeName"]),
            bind_annotations: at(&["f:metadata", "f:annotations", "f:pv.kubernetes.io/bind-completed"])
                || at(&[
                    "f:metadata",
                    "f:annotations",
                    "f:pv.kubernetes.io/bound-by-controller",
                ]),
            attachment_spec: at(&["f:spec", "f:attacher"]) || at(&["f:spec", "f:source"]),
            volumes_attached: at(&["f:status", "f:volumesAttached"]),
        }
    }

    #[test]
    fn a_binders_pv_status_write() {
        let fp: Footprint = serde_json::from_value(json!({"f:status": {"f:phase": {}}})).unwrap();
        assert_eq!(
            fp,
            Footprint {
                phase: true,
                ..Default::default()
            }
        );
    }

    #[test]
    fn a_claim_created_by_the_ephemeral_volume_controller_is_no_binder_write() {
        let fp: Footprint = serde_json::from_value(json!({
            "f:metadata": {"f:ownerReferences": {".": {}, "k:{\"uid\":\"u\"}": {}}},
            "f:spec": {"f:accessModes": {}, "f:resources": {"f:requests": {".": {}, "f:storage": {}}}}
        }))
        .unwrap();
        assert_eq!(fp, Footprint::default());
    }

    #[test]
    fn escaped_keys_are_read_too() {
        let fp: Footprint = serde_json::from_str(r#"{"f:spec": {"f:claim\u0052ef": {}}}"#).unwrap();
        assert!(fp.claim_ref);
    }

    fn key() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("f:spec".to_string()),
            Just("f:status".to_string()),
            Just("f:metadata".to_string()),
            Just("f:annotations".to_string()),
            Just("f:claimRef".to_string()),
            Just("f:phase".to_string()),
            Just("f:volumeName".to_string()),
            Just("f:attacher".to_string()),
            Just("f:source".to_string()),
            Just("f:volumesAttached".to_string()),
            Just("f:pv.kubernetes.io/bind-completed".to_string()),
            Just("f:pv.kubernetes.io/bound-by-controller".to_string()),
            Just(".".to_string()),
            "f:[a-z]{1,6}",
        ]
    }

    fn tree() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(json!({})),
            Just(json!(null)),
            Just(json!(1)),
            Just(json!("x"))
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop::collection::vec((key(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<String, Value>>()))
        })
    }

    proptest! {
        #[test]
        fn the_walk_agrees_with_the_decoded_tree(v in tree()) {
            let text = serde_json::to_string(&v).unwrap();
            let walked: Footprint = serde_json::from_str(&text).unwrap();
            prop_assert_eq!(walked, reference(&v));
        }
    }
}
