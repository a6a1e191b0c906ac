//! Tests of the binder's pure core, by behaviour: the claim status and default class as upstream
//! writes them, convergence of random objects under every sync order (property tests), the built-in
//! driver's data-safety decisions, the decision cache's reservations, and upstream's binder_test.go table, row for row.

mod claim_status;
mod convergence;
mod data_safety;
mod reservations;
mod upstream_table;
