//! Label selectors (claim → volume labels) and node selectors (volume node affinity → node).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::core::labels::{Selector, SelectorExt};

type Labels = BTreeMap<String, String>;

/// Whether `labels` satisfy `sel`, by kube-core's `Selector`: an empty selector matches
/// everything; one it cannot parse (an unknown operator, In/NotIn without values: the apiserver
/// refuses both) matches nothing.
pub fn labels_match(sel: &LabelSelector, labels: &Labels) -> bool {
    Selector::try_from(sel.clone()).is_ok_and(|s| s.matches(labels))
}

// Node selectors stay hand-written: kube-core's `Selector` has no Gt/Lt and no matchFields.
fn requirement_matches(r: &NodeSelectorRequirement, value: Option<&String>) -> bool {
    let values = r.values.as_deref().unwrap_or_default();
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => value.is_none_or(|v| !values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(v), Some(bound)) = (value.and_then(|v| v.parse::<i64>().ok()), values.first()) else {
                return false;
            };
            let Ok(bound) = bound.parse::<i64>() else {
                return false;
            };
            if r.operator == "Gt" { v > bound } else { v < bound }
        }
        _ => false,
    }
}

/// Whether a node (name + labels) satisfies a required node selector: terms are ORed, the
/// requirements of a term ANDed; a term with no requirements matches nothing (upstream rule).
pub fn node_matches(sel: &NodeSelector, node_name: &str, labels: &Labels) -> bool {
    sel.node_selector_terms.iter().any(|term| {
        let exprs = term.match_expressions.as_deref().unwrap_or_default();
        let fields = term.match_fields.as_deref().unwrap_or_default();
        if exprs.is_empty() && fields.is_empty() {
            return false;
        }
        let name = node_name.to_string();
        exprs.iter().all(|r| requirement_matches(r, labels.get(&r.key)))
            && fields
                .iter()
                .all(|r| r.key == "metadata.name" && requirement_matches(r, Some(&name)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::NodeSelectorTerm;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    fn labels(kv: &[(&str, &str)]) -> Labels {
        kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn label_selector_operators() {
        let sel = LabelSelector {
            match_labels: Some(labels(&[("tier", "fast")])),
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "zone".into(),
                operator: "In".into(),
                values: Some(vec!["a".into(), "b".into()]),
            }]),
        };
        assert!(labels_match(&sel, &labels(&[("tier", "fast"), ("zone", "a")])));
        assert!(!labels_match(&sel, &labels(&[("tier", "fast"), ("zone", "c")])));
        assert!(!labels_match(&sel, &labels(&[("zone", "a")])));
        assert!(labels_match(&LabelSelector::default(), &labels(&[])));
        let expr = |op: &str, values: Option<Vec<&str>>| LabelSelector {
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "zone".into(),
                operator: op.into(),
                values: values.map(|v| v.into_iter().map(String::from).collect()),
            }]),
            ..Default::default()
        };
        let (a, none) = (labels(&[("zone", "a")]), labels(&[]));
        assert!(labels_match(&expr("NotIn", Some(vec!["b"])), &a));
        assert!(labels_match(&expr("NotIn", Some(vec!["b"])), &none));
        assert!(!labels_match(&expr("NotIn", Some(vec!["a"])), &a));
        assert!(labels_match(&expr("Exists", None), &a));
        assert!(!labels_match(&expr("Exists", None), &none));
        assert!(labels_match(&expr("DoesNotExist", None), &none));
        assert!(!labels_match(&expr("DoesNotExist", None), &a));
        // What the apiserver would refuse matches nothing.
        assert!(!labels_match(&expr("Gt", Some(vec!["1"])), &a));
        assert!(!labels_match(&expr("In", None), &a));
    }

    #[test]
    fn node_selector_terms_are_ored() {
        let req = |k: &str, op: &str, v: &[&str]| NodeSelectorRequirement {
            key: k.into(),
            operator: op.into(),
            values: Some(v.iter().map(|s| s.to_string()).collect()),
        };
        let sel = NodeSelector {
            node_selector_terms: vec![
                NodeSelectorTerm {
                    match_expressions: Some(vec![req("h", "In", &["n1"])]),
                    ..Default::default()
                },
                NodeSelectorTerm {
                    match_expressions: Some(vec![req("cpu", "Gt", &["4"])]),
                    ..Default::default()
                },
            ],
        };
        assert!(node_matches(&sel, "x", &labels(&[("h", "n1")])));
        assert!(node_matches(&sel, "x", &labels(&[("cpu", "8")])));
        assert!(!node_matches(&sel, "x", &labels(&[("cpu", "2"), ("h", "n2")])));
        let empty = NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm::default()],
        };
        assert!(!node_matches(&empty, "x", &labels(&[])));
    }
}
