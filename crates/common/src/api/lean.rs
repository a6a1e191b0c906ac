//! Decoding an API object without its managed fields.
//!
//! Every object the apiserver sends carries `metadata.managedFields`, the server-side-apply
//! bookkeeping: often half of the object's JSON, and each entry's `fieldsV1` is a free-form tree
//! that k8s-openapi decodes into a `serde_json::Value` (an allocation per node). No controller
//! here reads them, and the informers dropped them right after decoding; profiles of the attach
//! workload still showed their decoding and freeing as a visible share of the controller's CPU.
//!
//! `Lean<K>` decodes `K` through a deserializer that skips the `managedFields` key of the
//! top-level `metadata` (serde's `IgnoredAny`: the parser steps over it without allocating).
//! Everything else reaches `K`'s own `Deserialize` unchanged, so `Lean<K>` decodes exactly what
//! `K` does, less that one field. Every watch uses it (`Informer::spawn`; the stored objects are
//! plain `K`), and so do the writes whose answers the controllers decode (`writes::Writes`,
//! attach/detach's VolumeAttachment writes).

use std::borrow::Cow;
use std::fmt;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Serialize};

/// `K`, decoded without `metadata.managedFields`.
#[derive(Clone, Debug, Serialize)]
#[serde(transparent)]
pub struct Lean<K>(pub K);

impl<K> Lean<K> {
    pub fn into_inner(self) -> K {
        self.0
    }
}

impl<'de, K: Deserialize<'de>> Deserialize<'de> for Lean<K> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        K::deserialize(Filter {
            inner: d,
            level: Level::Object,
        })
        .map(Lean)
    }
}

/// Addressed as `K` (same kind, same URL), so an `Api<Lean<K>>` reads `K`'s objects.
impl<K: kube::Resource> kube::Resource for Lean<K> {
    type DynamicType = K::DynamicType;
    type Scope = K::Scope;

    fn kind(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::kind(dt)
    }

    fn group(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::group(dt)
    }

    fn version(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::version(dt)
    }

    fn api_version(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::api_version(dt)
    }

    fn plural(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::plural(dt)
    }

    fn meta(&self) -> &ObjectMeta {
        self.0.meta()
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        self.0.meta_mut()
    }
}

/// Where in the object a map is: the object itself (its `metadata` is filtered) or its
/// metadata (its `managedFields` is skipped). Deeper maps are never wrapped.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Level {
    Object,
    Metadata,
}

impl Level {
    /// The key skipped at this level, if any.
    fn skipped(self) -> Option<&'static str> {
        match self {
            Level::Object => None,
            Level::Metadata => Some("managedFields"),
        }
    }

    /// The level of the value under `key`, if it is filtered too.
    fn below(self, key: &str) -> Option<Level> {
        (self == Level::Object && key == "metadata").then_some(Level::Metadata)
    }
}

struct Filter<D> {
    inner: D,
    level: Level,
}

/// Forwards a deserializer method untouched.
macro_rules! forward {
    ($($method:ident($($arg:ident: $ty:ty),*);)*) => {$(
        fn $method<V: Visitor<'de>>(self, $($arg: $ty,)* visitor: V) -> Result<V::Value, D::Error> {
            self.inner.$method($($arg,)* visitor)
        }
    )*};
}

/// Forwards a deserializer method with the visitor wrapped, so that a map it meets is filtered.
macro_rules! wrap {
    ($($method:ident($($arg:ident: $ty:ty),*);)*) => {$(
        fn $method<V: Visitor<'de>>(self, $($arg: $ty,)* visitor: V) -> Result<V::Value, D::Error> {
            self.inner.$method($($arg,)* Wrapped { inner: visitor, level: self.level })
        }
    )*};
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Filter<D> {
    type Error = D::Error;

    wrap! {
        deserialize_any();
        deserialize_map();
        deserialize_option();
        deserialize_struct(name: &'static str, fields: &'static [&'static str]);
        deserialize_newtype_struct(name: &'static str);
    }

    forward! {
        deserialize_bool(); deserialize_i8(); deserialize_i16(); deserialize_i32(); deserialize_i64();
        deserialize_i128(); deserialize_u8(); deserialize_u16(); deserialize_u32(); deserialize_u64();
        deserialize_u128(); deserialize_f32(); deserialize_f64(); deserialize_char(); deserialize_str();
        deserialize_string(); deserialize_bytes(); deserialize_byte_buf(); deserialize_unit();
        deserialize_unit_struct(name: &'static str); deserialize_seq(); deserialize_tuple(len: usize);
        deserialize_tuple_struct(name: &'static str, len: usize);
        deserialize_enum(name: &'static str, variants: &'static [&'static str]);
        deserialize_identifier(); deserialize_ignored_any();
    }

    fn is_human_readable(&self) -> bool {
        self.inner.is_human_readable()
    }
}

/// A visitor whose maps are filtered; everything else goes to the inner visitor as is.
struct Wrapped<V> {
    inner: V,
    level: Level,
}

macro_rules! visit {
    ($($method:ident($ty:ty);)*) => {$(
        fn $method<E: de::Error>(self, v: $ty) -> Result<V::Value, E> {
            self.inner.$method(v)
        }
    )*};
}

impl<'de, V: Visitor<'de>> Visitor<'de> for Wrapped<V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        self.inner.expecting(f)
    }

    visit! {
        visit_bool(bool); visit_i8(i8); visit_i16(i16); visit_i32(i32); visit_i64(i64);
        visit_i128(i128); visit_u8(u8); visit_u16(u16); visit_u32(u32); visit_u64(u64);
        visit_u128(u128); visit_f32(f32); visit_f64(f64); visit_char(char); visit_str(&str);
        visit_borrowed_str(&'de str); visit_string(String); visit_bytes(&[u8]);
        visit_borrowed_bytes(&'de [u8]); visit_byte_buf(Vec<u8>);
    }

    fn visit_none<E: de::Error>(self) -> Result<V::Value, E> {
        self.inner.visit_none()
    }

    fn visit_unit<E: de::Error>(self) -> Result<V::Value, E> {
        self.inner.visit_unit()
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<V::Value, D::Error> {
        self.inner.visit_some(Filter {
            inner: d,
            level: self.level,
        })
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<V::Value, D::Error> {
        self.inner.visit_newtype_struct(Filter {
            inner: d,
            level: self.level,
        })
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, seq: A) -> Result<V::Value, A::Error> {
        self.inner.visit_seq(seq)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        self.inner.visit_map(FilteredMap {
            inner: map,
            level: self.level,
            next_value: None,
        })
    }

    fn visit_enum<A: de::EnumAccess<'de>>(self, data: A) -> Result<V::Value, A::Error> {
        self.inner.visit_enum(data)
    }
}

/// A map that skips its level's key and filters the value of the key below it.
struct FilteredMap<A> {
    inner: A,
    level: Level,
    /// The level of the value about to be read, when it is filtered too.
    next_value: Option<Level>,
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for FilteredMap<A> {
    type Error = A::Error;

    fn next_key_seed<S: DeserializeSeed<'de>>(&mut self, mut seed: S) -> Result<Option<S::Value>, A::Error> {
        loop {
            let key = Key {
                seed,
                level: self.level,
            };
            match self.inner.next_key_seed(key)? {
                None => return Ok(None),
                Some(KeyOut::Kept(value, below)) => {
                    self.next_value = below;
                    return Ok(Some(value));
                }
                Some(KeyOut::Skipped(back)) => {
                    self.inner.next_value::<IgnoredAny>()?;
                    seed = back;
                }
            }
        }
    }

    fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, A::Error> {
        match self.next_value.take() {
            Some(level) => self.inner.next_value_seed(FilteredSeed { inner: seed, level }),
            None => self.inner.next_value_seed(seed),
        }
    }

    fn size_hint(&self) -> Option<usize> {
        self.inner.size_hint()
    }
}

/// A key read as a string first: a skipped key hands its seed back, any other goes on to it.
struct Key<S> {
    seed: S,
    level: Level,
}

enum KeyOut<S, T> {
    /// The key as the seed read it, and the level of its value if that is filtered too.
    Kept(T, Option<Level>),
    /// The seed, unused: its key is skipped.
    Skipped(S),
}

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for Key<S> {
    type Value = KeyOut<S, S::Value>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de, S: DeserializeSeed<'de>> Visitor<'de> for Key<S> {
    type Value = KeyOut<S, S::Value>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<Self::Value, E> {
        if self.level.skipped() == Some(key) {
            return Ok(KeyOut::Skipped(self.seed));
        }
        let below = self.level.below(key);
        let value = self.seed.deserialize(de::value::StrDeserializer::<E>::new(key))?;
        Ok(KeyOut::Kept(value, below))
    }

    fn visit_borrowed_str<E: de::Error>(self, key: &'de str) -> Result<Self::Value, E> {
        if self.level.skipped() == Some(key) {
            return Ok(KeyOut::Skipped(self.seed));
        }
        let below = self.level.below(key);
        // Borrowed, so that a field type that keeps its key borrowed still can.
        let value = self
            .seed
            .deserialize(de::value::BorrowedStrDeserializer::<E>::new(key))?;
        Ok(KeyOut::Kept(value, below))
    }
}

/// A map value's seed whose value is filtered at `level`.
struct FilteredSeed<S> {
    inner: S,
    level: Level,
}

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for FilteredSeed<S> {
    type Value = S::Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<S::Value, D::Error> {
        self.inner.deserialize(Filter {
            inner: d,
            level: self.level,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::storage::v1::VolumeAttachment;
    use serde_json::json;

    fn with_managed_fields() -> serde_json::Value {
        json!({
            "apiVersion": "storage.k8s.io/v1",
            "kind": "VolumeAttachment",
            "metadata": {
                "name": "csi-1",
                "uid": "u-1",
                "resourceVersion": "42",
                "annotations": {"managedFields": "an annotation, not the field"},
                "labels": {"a": "b"},
                "finalizers": ["external-attacher/loop-stowage-dev"],
                "managedFields": [{
                    "manager": "kube-controller-manager",
                    "operation": "Update",
                    "apiVersion": "storage.k8s.io/v1",
                    "time": "2026-11-26T08:00:00Z",
                    "fieldsType": "FieldsV1",
                    "fieldsV1": {"f:spec": {"f:attacher": {}, "f:nodeName": {}, "f:source": {"f:persistentVolumeName": {}}}}
                }],
                "creationTimestamp": "2026-11-26T08:00:00Z"
            },
            "spec": {
                "attacher": "loop.stowage.dev",
                "nodeName": "n1",
                "source": {"persistentVolumeName": "pv-1"}
            },
            "status": {"attached": true, "attachmentMetadata": {"managedFields": "kept: not metadata"}}
        })
    }

    #[test]
    fn a_lean_object_is_the_object_less_its_managed_fields() {
        let json = serde_json::to_vec(&with_managed_fields()).unwrap();
        let mut full: VolumeAttachment = serde_json::from_slice(&json).unwrap();
        assert!(full.metadata.managed_fields.is_some());
        let lean: Lean<VolumeAttachment> = serde_json::from_slice(&json).unwrap();
        assert!(lean.0.metadata.managed_fields.is_none());
        full.metadata.managed_fields = None;
        assert_eq!(lean.0, full);
        // A key of that name elsewhere (an annotation, a status map) is data and stays.
        assert_eq!(
            lean.0.metadata.annotations.unwrap()["managedFields"],
            "an annotation, not the field"
        );
        assert_eq!(
            lean.0.status.unwrap().attachment_metadata.unwrap()["managedFields"],
            "kept: not metadata"
        );
    }

    #[test]
    fn decoding_errors_are_the_types_own() {
        // A wrong kind is still refused by k8s-openapi's check, through the filter.
        let mut v = with_managed_fields();
        v["kind"] = json!("Pod");
        let err = serde_json::from_value::<Lean<VolumeAttachment>>(v).unwrap_err();
        assert!(err.to_string().contains("Pod"), "{err}");
        // A malformed managed field is skipped unread, as the field is not wanted anyway.
        let mut v = with_managed_fields();
        v["metadata"]["managedFields"] = json!("not a list");
        let lean: Lean<VolumeAttachment> = serde_json::from_value(v).unwrap();
        assert_eq!(lean.0.metadata.name.as_deref(), Some("csi-1"));
        // Other malformed fields still fail.
        let mut v = with_managed_fields();
        v["spec"]["nodeName"] = json!(7);
        assert!(serde_json::from_value::<Lean<VolumeAttachment>>(v).is_err());
    }

    #[test]
    fn serializes_as_the_object() {
        let va: VolumeAttachment = serde_json::from_value(with_managed_fields()).unwrap();
        assert_eq!(
            serde_json::to_value(Lean(va.clone())).unwrap(),
            serde_json::to_value(va).unwrap()
        );
    }
}
