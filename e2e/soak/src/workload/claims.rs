//! Claims: created in every class, grown, deleted.

use std::time::Duration;

use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams};
use stowage_testkit::builders::pvc;

use super::pods::delete_pod;
use super::{CLASSES, ClaimState, Ctx, Deleted, NS};
use crate::rng::Rng;

pub(super) async fn create_claim(ctx: &Ctx, rng: &mut Rng) {
    let first = ctx.world().class_order.first().copied();
    let class = first.unwrap_or_else(|| rng.below(CLASSES.len()));
    let size_mi = if CLASSES[class].looped {
        16 * rng.range(1, 2)
    } else {
        64
    };
    let name = {
        let mut w = ctx.world();
        w.next_id += 1;
        format!("c{:04}", w.next_id)
    };
    let claim = pvc(NS, &name)
        .class(CLASSES[class].name)
        .request(&format!("{size_mi}Mi"))
        .build();
    let created = match ctx.claims().create(&PostParams::default(), &claim).await {
        Ok(made) => Ok(made),
        Err(e) => adopt(&ctx.claims(), &name, e).await,
    };
    match created {
        Ok(made) => {
            ctx.world().class_order.retain(|c| *c != class);
            ctx.world().claims.insert(
                name.clone(),
                ClaimState::new(class, made.uid().unwrap_or_default(), size_mi),
            );
            ctx.record.op(
                "create-claim",
                serde_json::json!({"claim": name, "class": CLASSES[class].name, "size": format!("{size_mi}Mi")}),
            );
        }
        Err(e) => ctx.api_failed("create claim", e),
    }
}

/// After a create failed without an answer from the apiserver (connection lost during a restart),
/// the object may exist all the same: look it up until the apiserver answers, so the soak never
/// loses track of a pod that holds a volume or a claim it must clean up.
pub(super) async fn adopt<K>(api: &Api<K>, name: &str, error: kube::Error) -> Result<K, kube::Error>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    if matches!(error, kube::Error::Api(_)) {
        return Err(error);
    }
    for _ in 0..120 {
        match api.get(name).await {
            Ok(o) => return Ok(o),
            Err(kube::Error::Api(s)) if s.code == 404 => return Err(error),
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
    Err(error)
}

pub(super) async fn delete_claim(ctx: &Ctx, name: &str) {
    delete_pod(ctx, name).await;
    let Some((uid, class)) = ctx.world().claims.get(name).map(|c| (c.uid.clone(), c.class)) else {
        return;
    };
    match ctx.claims().delete(name, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        Err(e) => {
            ctx.api_failed("delete claim", e);
            return;
        }
    }
    let mut w = ctx.world();
    w.claims.remove(name);
    w.deleted.push(Deleted {
        name: name.to_string(),
        uid,
        class,
    });
    drop(w);
    ctx.record.op(
        "delete-claim",
        serde_json::json!({"claim": name, "class": CLASSES[class].name}),
    );
}
