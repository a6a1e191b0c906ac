//! The executing layer of both protection controllers: finalizer writes as JSON patches that
//! first `test` the resourceVersion the decision was made on: if the object changed since, the
//! apiserver applies nothing and the key is retried with a fresh view. A finalizer is never
//! removed on a stale view, and other finalizers are untouched.

use std::fmt::Debug;

use json_patch::Patch;
use kube::api::{ObjectMeta, PatchParams};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use crate::error::Error;

fn patch(ops: Value) -> Patch {
    serde_json::from_value(ops).expect("well-formed JSON patch")
}

/// Appends `finalizer`, guarded by the resourceVersion; `None` if there is nothing to guard with.
pub fn add_finalizer(meta: &ObjectMeta, finalizer: &str) -> Option<Patch> {
    let rv = meta.resource_version.as_ref()?;
    let add = match &meta.finalizers {
        Some(list) if !list.is_empty() => {
            json!({"op": "add", "path": "/metadata/finalizers/-", "value": finalizer})
        }
        _ => json!({"op": "add", "path": "/metadata/finalizers", "value": [finalizer]}),
    };
    Some(patch(
        json!([{"op": "test", "path": "/metadata/resourceVersion", "value": rv}, add]),
    ))
}

/// Removes `finalizer` at the position it has in `meta`, guarded by the resourceVersion and by a
/// test that the position still holds it; `None` if it is absent or there is no resourceVersion.
pub fn remove_finalizer(meta: &ObjectMeta, finalizer: &str) -> Option<Patch> {
    let rv = meta.resource_version.as_ref()?;
    let i = meta.finalizers.as_ref()?.iter().position(|f| f == finalizer)?;
    let path = format!("/metadata/finalizers/{i}");
    Some(patch(json!([
        {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
        {"op": "test", "path": path, "value": finalizer},
        {"op": "remove", "path": path},
    ])))
}

/// Sends `patch`; a vanished object counts as done (`Ok(None)`).
pub async fn send<K>(api: &Api<K>, name: &str, patch: Patch) -> Result<Option<K>, Error>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    match api
        .patch(
            name,
            &PatchParams::default(),
            &kube::api::Patch::Json::<()>(patch),
        )
        .await
    {
        Ok(o) => Ok(Some(o)),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(None),
        // A failed `test` comes back as 422 (the patch cannot be applied to the current object);
        // a plain conflict as 409. Both mean: look again.
        Err(kube::Error::Api(s)) if s.code == 409 || s.code == 422 => Err(Error::Stale),
        Err(e) => Err(Error::Api(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(rv: Option<&str>, fins: Option<Vec<&str>>) -> ObjectMeta {
        ObjectMeta {
            resource_version: rv.map(Into::into),
            finalizers: fins.map(|v| v.into_iter().map(Into::into).collect()),
            ..Default::default()
        }
    }

    #[test]
    fn remove_targets_the_right_index_and_guards_it() {
        let p = remove_finalizer(
            &meta(Some("7"), Some(vec!["a", "kubernetes.io/pvc-protection", "b"])),
            "kubernetes.io/pvc-protection",
        )
        .unwrap();
        let v = serde_json::to_value(&p).unwrap();
        assert_eq!(
            v,
            serde_json::json!([
                {"op": "test", "path": "/metadata/resourceVersion", "value": "7"},
                {"op": "test", "path": "/metadata/finalizers/1", "value": "kubernetes.io/pvc-protection"},
                {"op": "remove", "path": "/metadata/finalizers/1"},
            ])
        );
        assert!(remove_finalizer(&meta(Some("7"), Some(vec!["a"])), "x").is_none());
        assert!(
            remove_finalizer(&meta(None, Some(vec!["x"])), "x").is_none(),
            "no unguarded writes"
        );
    }

    #[test]
    fn add_creates_or_appends() {
        let v = serde_json::to_value(add_finalizer(&meta(Some("3"), None), "f").unwrap()).unwrap();
        assert_eq!(
            v[1],
            serde_json::json!({"op": "add", "path": "/metadata/finalizers", "value": ["f"]})
        );
        let v = serde_json::to_value(add_finalizer(&meta(Some("3"), Some(vec!["x"])), "f").unwrap()).unwrap();
        assert_eq!(
            v[1],
            serde_json::json!({"op": "add", "path": "/metadata/finalizers/-", "value": "f"})
        );
        assert_eq!(
            v[0],
            serde_json::json!({"op": "test", "path": "/metadata/resourceVersion", "value": "3"})
        );
    }
}
