//! Label selectors (claim → volume labels). Node affinity is not the binder's to check (upstream's
//! controller path leaves it to the scheduler).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::core::labels::{Selector, SelectorExt};

type Labels = BTreeMap<String, String>;

/// Whether `labels` satisfy `sel`, by kube-core's `Selector`: an empty selector matches
/// everything; one it cannot parse (an unknown operator, In/NotIn without values: the apiserver
/// refuses both) matches nothing.
pub fn labels_match(sel: &LabelSelector, labels: &Labels) -> bool {
    Selector::try_from(sel.clone()).is_ok_and(|s| s.matches(labels))
}

#[cfg(test)]
mod tests {
    use super::*;
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
}
