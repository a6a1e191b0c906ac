//! Tests of the binder's pure core, by behaviour: the claim status and default class as upstream
//! writes them, convergence of random objects under every sync order (property tests), the built-in
//! driver's data-safety decisions, the decision cache's reservations, and upstream's binder_test.go table, row for row.

use std::sync::Arc;

use k8s_openapi::api::storage::v1::StorageClass;

use crate::core::Env;

mod claim_status;
mod convergence;
mod data_safety;
mod reservations;
mod upstream_table;

/// An environment with the classes `class` gives, and no node, pod or published room: what the
/// property tests decide in (shared mode).
fn env_with(class: &'static dyn Fn(&str) -> Option<Arc<StorageClass>>) -> Env<'static> {
    Env {
        class,
        default_class: None,
        node_labels: &|_| None,
        pods_of: &|_| vec![],
        local: false,
        room: &|_| vec![],
        publishing: &|| false,
    }
}
