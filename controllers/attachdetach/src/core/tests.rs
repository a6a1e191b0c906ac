//! Tests of the pure pass, over 600 lines: one case per rule, each beside the rules it borders,
//! plus the property tests over random states.

use std::time::Duration;

use tokio::time::Instant;

use proptest::prelude::*;

use super::*;
use crate::actual::PairState;
use crate::desired::VolumeSpec;
use crate::read::VaState;

const NS: &str = "ns";

fn spec(v: &str, multi: bool) -> VolumeSpec {
    VolumeSpec {
        name: format!("kubernetes.io/csi/d^{v}"),
        pv_name: format!("pv-{v}"),
        driver: "d".into(),
        handle: v.into(),
        multi_attach: multi,
        kind: Kind::Csi,
    }
}

fn vname(v: &str) -> String {
    spec(v, false).name
}

fn pod(ns: &str, name: &str) -> PodRef {
    PodRef {
        namespace: ns.into(),
        name: name.into(),
        uid: format!("uid-{ns}-{name}"),
    }
}

fn node(ready: bool) -> NodeInfo {
    NodeInfo {
        managed: true,
        ready,
        ..Default::default()
    }
}

fn attached_va(v: &str, n: &str) -> VaState {
    VaState {
        name: attachment_name(v, "d", n),
        attached: true,
        device_path: format!("/dev/{v}"),
        ..Default::default()
    }
}

fn attach<'a>(actual: &'a mut Actual, v: &str, n: &str) -> &'a mut PairState {
    let e = actual.entry(&vname(v), n, "d", v);
    e.va = Some(attached_va(v, n));
    e
}

fn cfg() -> Config {
    Config {
        max_wait_for_unmount: Duration::from_secs(60),
        ..Default::default()
    }
}

fn detaches(actions: &[Action]) -> Vec<(&str, &str, Option<ForceReason>)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Detach {
                volume, node, forced, ..
            } => Some((volume.as_str(), node.as_str(), *forced)),
            _ => None,
        })
        .collect()
}

fn attaches(actions: &[Action]) -> Vec<(&str, &str)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Attach { volume, node, .. } => Some((volume.as_str(), node.as_str())),
            _ => None,
        })
        .collect()
}

#[test]
fn wanted_volume_gets_an_attachment_named_as_upstream() {
    let mut d = Desired::default();
    d.set_pod(pod(NS, "p"), "n1", vec![spec("v", false)]);
    let nodes = Nodes::from([("n1".to_string(), node(true))]);
    let actions = reconcile(&d, &Actual::default(), &nodes, Instant::now(), &cfg());
    assert_eq!(
        actions,
        vec![Action::Attach {
            volume: vname("v"),
            node: "n1".into(),
            va_name: attachment_name("v", "d", "n1"),
            pv_name: "pv-v".into(),
            driver: "d".into(),
            kind: Kind::Csi,
        }]
    );
}

#[test]
fn attached_and_wanted_is_left_alone_and_cancels_a_countdown() {
    let mut d = Desired::default();
    d.set_pod(pod(NS, "p"), "n1", vec![spec("v", false)]);
    let mut a = Actual::default();
    attach(&mut a, "v", "n1").detach_requested = Some(Instant::now());
    let mut n = node(true);
    n.volumes_attached.insert(vname("v"), "/dev/v".into());
    let nodes = Nodes::from([("n1".to_string(), n)]);
    let actions = reconcile(&d, &a, &nodes, Instant::now(), &cfg());
    assert_eq!(
        actions,
        vec![Action::CancelDetachRequest {
            volume: vname("v"),
            node: "n1".into()
        }]
    );
}

#[test]
fn unwanted_and_unmounted_is_detached_after_the_node_stops_reporting_it() {
    let mut a = Actual::default();
    attach(&mut a, "v", "n1");
    let mut n = node(true);
    n.volumes_attached.insert(vname("v"), "/dev/v".into());
    let nodes = Nodes::from([("n1".to_string(), n)]);
    let actions = reconcile(&Desired::default(), &a, &nodes, Instant::now(), &cfg());
    assert_eq!(
        actions,
        vec![
            Action::MarkDetachRequested {
                volume: vname("v"),
                node: "n1".into()
            },
            Action::Detach {
                volume: vname("v"),
                node: "n1".into(),
                va_name: attachment_name("v", "d", "n1"),
                forced: None,
                waited: Duration::ZERO,
            },
            Action::UpdateNodeStatus {
                node: "n1".into(),
                volumes: vec![],
                guard: None
            },
        ]
    );
}

#[test]
fn in_use_on_a_ready_node_waits_forever() {
    let t0 = Instant::now();
    let mut a = Actual::default();
    attach(&mut a, "v", "n1").detach_requested = Some(t0);
    let mut n = node(true);
    n.in_use.insert(vname("v"));
    let nodes = Nodes::from([("n1".to_string(), n)]);
    let later = t0 + Duration::from_secs(3600);
    let actions = reconcile(&Desired::default(), &a, &nodes, later, &cfg());
    assert!(detaches(&actions).is_empty(), "{actions:?}");
    assert!(
        actions.iter().any(
            |x| matches!(x, Action::WaitForUnmount { waited, .. } if *waited == Duration::from_secs(3600))
        )
    );
}

#[test]
fn in_use_on_a_not_ready_node_is_forced_after_the_max_wait() {
    let t0 = Instant::now();
    let mut a = Actual::default();
    attach(&mut a, "v", "n1").detach_requested = Some(t0);
    let mut n = node(false);
    n.in_use.insert(vname("v"));
    let nodes = Nodes::from([("n1".to_string(), n)]);
    let d = Desired::default();
    let before = reconcile(&d, &a, &nodes, t0 + Duration::from_secs(59), &cfg());
    assert!(detaches(&before).is_empty());
    let after = reconcile(&d, &a, &nodes, t0 + Duration::from_secs(60), &cfg());
    assert_eq!(
        detaches(&after),
        vec![(vname("v").as_str(), "n1", Some(ForceReason::Timeout))]
    );
    let disabled = Config {
        disable_force_detach_on_timeout: true,
        ..cfg()
    };
    let never = reconcile(&d, &a, &nodes, t0 + Duration::from_secs(6000), &disabled);
    assert!(detaches(&never).is_empty());
    assert_eq!(next_deadline(&a, &cfg(), t0), Some(t0 + Duration::from_secs(60)));
    assert_eq!(next_deadline(&a, &disabled, t0), None);
    // A deadline already passed is no reason to wake again.
    assert_eq!(next_deadline(&a, &cfg(), t0 + Duration::from_secs(61)), None);
}

#[test]
fn out_of_service_detaches_at_once() {
    let t0 = Instant::now();
    let mut a = Actual::default();
    attach(&mut a, "v", "n1");
    let mut n = node(true);
    n.in_use.insert(vname("v"));
    n.out_of_service = true;
    let nodes = Nodes::from([("n1".to_string(), n)]);
    let actions = reconcile(&Desired::default(), &a, &nodes, t0, &cfg());
    assert_eq!(
        detaches(&actions),
        vec![(vname("v").as_str(), "n1", Some(ForceReason::OutOfService))]
    );
}

/// Upstream keeps a deleted node's last `volumesInUse` and treats the node as unhealthy: its
/// volumes are force-detached only after --max-wait-for-unmount, never at once.
#[test]
fn deleted_and_unknown_nodes_wait_for_the_unmount_timeout() {
    let t0 = Instant::now();
    let mut a = Actual::default();
    attach(&mut a, "v", "gone");
    attach(&mut a, "w", "never-seen");
    attach(&mut a, "x", "gone");
    let mut gone = node(true);
    gone.in_use.insert(vname("v"));
    gone.volumes_attached.insert(vname("v"), "/dev/v".into());
    let nodes = Nodes::from([("gone".to_string(), gone.gone())]);
    let first = reconcile(&Desired::default(), &a, &nodes, t0, &cfg());
    // x is not in the gone node's last volumesInUse: safe, not forced.
    assert_eq!(detaches(&first), vec![(vname("x").as_str(), "gone", None)]);
    // Nothing is written to a Node that is gone.
    assert!(
        !first.iter().any(|x| matches!(x, Action::UpdateNodeStatus { .. })),
        "{first:?}"
    );
    for x in &first {
        if let Action::MarkDetachRequested { volume, node } = x {
            a.get_mut(volume, node).unwrap().detach_requested = Some(t0);
        }
    }
    let before = reconcile(
        &Desired::default(),
        &a,
        &nodes,
        t0 + Duration::from_secs(59),
        &cfg(),
    );
    assert!(
        !detaches(&before)
            .iter()
            .any(|(v, _, _)| *v == vname("v") || *v == vname("w")),
        "{before:?}"
    );
    let after = reconcile(
        &Desired::default(),
        &a,
        &nodes,
        t0 + Duration::from_secs(60),
        &cfg(),
    );
    let mut got = detaches(&after);
    got.retain(|(v, _, _)| *v != vname("x"));
    got.sort();
    let (v, w) = (vname("v"), vname("w"));
    let mut want = vec![
        (v.as_str(), "gone", Some(ForceReason::NodeDeleted)),
        (w.as_str(), "never-seen", Some(ForceReason::NodeDeleted)),
    ];
    want.sort();
    assert_eq!(got, want);
    let disabled = Config {
        disable_force_detach_on_timeout: true,
        ..cfg()
    };
    let never = reconcile(
        &Desired::default(),
        &a,
        &nodes,
        t0 + Duration::from_secs(6000),
        &disabled,
    );
    assert!(
        !detaches(&never).iter().any(|(v, _, _)| *v != vname("x")),
        "{never:?}"
    );
}

/// A deleted node keeps its pods' desired volumes, but nothing new is attached to it.
#[test]
fn nothing_is_attached_to_a_deleted_node() {
    let mut d = Desired::default();
    d.set_pod(pod(NS, "p"), "gone", vec![spec("v", false)]);
    let nodes = Nodes::from([("gone".to_string(), node(true).gone())]);
    let actions = reconcile(&d, &Actual::default(), &nodes, Instant::now(), &cfg());
    assert!(attaches(&actions).is_empty(), "{actions:?}");
}

#[test]
fn single_node_volume_waits_for_the_other_node_and_says_why_once() {
    let mut d = Desired::default();
    d.set_pod(pod(NS, "old"), "n1", vec![spec("v", false)]);
    d.set_pod(pod("other", "foreign"), "n1", vec![spec("v", false)]);
    d.set_pod(pod(NS, "new"), "n2", vec![spec("v", false)]);
    let mut a = Actual::default();
    attach(&mut a, "v", "n1");
    let mut n1 = node(true);
    n1.volumes_attached.insert(vname("v"), "/dev/v".into());
    let nodes = Nodes::from([("n1".to_string(), n1), ("n2".to_string(), node(true))]);
    let actions = reconcile(&d, &a, &nodes, Instant::now(), &cfg());
    assert!(attaches(&actions).is_empty(), "{actions:?}");
    let notes = actions
        .iter()
        .find_map(|x| match x {
            Action::MultiAttachError { node, notes, .. } if node == "n2" => Some(notes.clone()),
            _ => None,
        })
        .expect("multi-attach event");
    assert_eq!(notes.len(), 1);
    assert_eq!(notes[0].0.name, "new");
    let note = &notes[0].1;
    // Upstream's wording, which users and runbooks grep for.
    assert!(
        note.starts_with(
            "Multi-Attach error for volume \"pv-v\" Volume is already used by pod(s) old and 1 pod(s) in different namespaces"
        ),
        "{note}"
    );
    assert!(
        !note.contains("foreign"),
        "names from other namespaces leak: {note}"
    );

    d.mark_multi_attach_reported(&vname("v"), "n2");
    let again = reconcile(&d, &a, &nodes, Instant::now(), &cfg());
    assert!(
        again
            .iter()
            .all(|x| !matches!(x, Action::MultiAttachError { .. }))
    );
}

#[test]
fn multi_attach_names_only_pods_on_nodes_the_volume_is_attached_to() {
    let mut d = Desired::default();
    d.set_pod(pod(NS, "holder"), "n1", vec![spec("v", false)]);
    // Scheduled to a third node where the volume is not attached: it holds nothing.
    d.set_pod(pod(NS, "bystander"), "n3", vec![spec("v", false)]);
    d.set_pod(pod(NS, "new"), "n2", vec![spec("v", false)]);
    let mut a = Actual::default();
    attach(&mut a, "v", "n1");
    let nodes = Nodes::from([
        ("n1".to_string(), node(true)),
        ("n2".to_string(), node(true)),
        ("n3".to_string(), node(true)),
    ]);
    let actions = reconcile(&d, &a, &nodes, Instant::now(), &cfg());
    let note = actions
        .iter()
        .find_map(|x| match x {
            Action::MultiAttachError { node, notes, .. } if node == "n2" => Some(notes[0].1.clone()),
            _ => None,
        })
        .expect("multi-attach event for n2");
    assert!(note.contains("Volume is already used by pod(s) holder"), "{note}");
    assert!(!note.contains("bystander"), "{note}");

    // Attached elsewhere with no pod left there: upstream's "exclusively attached" text.
    let mut d = Desired::default();
    d.set_pod(pod(NS, "new"), "n2", vec![spec("v", false)]);
    let actions = reconcile(&d, &a, &nodes, Instant::now(), &cfg());
    let note = actions
        .iter()
        .find_map(|x| match x {
            Action::MultiAttachError { notes, .. } => Some(notes[0].1.clone()),
            _ => None,
        })
        .expect("multi-attach event");
    assert!(
        note.starts_with(
            "Multi-Attach error for volume \"pv-v\" Volume is already exclusively attached to one node and can't be attached to another"
        ),
        "{note}"
    );
}

#[test]
fn shareable_volume_attaches_everywhere() {
    let mut d = Desired::default();
    d.set_pod(pod(NS, "a"), "n2", vec![spec("v", true)]);
    let mut a = Actual::default();
    attach(&mut a, "v", "n1");
    let mut n1 = node(true);
    n1.volumes_attached.insert(vname("v"), "/dev/v".into());
    d.set_pod(pod(NS, "b"), "n1", vec![spec("v", true)]);
    let nodes = Nodes::from([("n1".to_string(), n1), ("n2".to_string(), node(true))]);
    let actions = reconcile(&d, &a, &nodes, Instant::now(), &cfg());
    assert_eq!(attaches(&actions), vec![(vname("v").as_str(), "n2")]);
}

#[test]
fn node_status_lists_confirmed_attachments_with_device_paths() {
    let mut d = Desired::default();
    d.set_pod(pod(NS, "p"), "n1", vec![spec("v", false), spec("w", false)]);
    let mut a = Actual::default();
    attach(&mut a, "v", "n1");
    // Still attaching: not reported.
    a.entry(&vname("w"), "n1", "d", "w").va = Some(VaState {
        name: attachment_name("w", "d", "n1"),
        ..Default::default()
    });
    let nodes = Nodes::from([("n1".to_string(), node(true))]);
    let actions = reconcile(&d, &a, &nodes, Instant::now(), &cfg());
    assert_eq!(
        actions,
        vec![Action::UpdateNodeStatus {
            node: "n1".into(),
            volumes: vec![(vname("v"), "/dev/v".into())],
            guard: None
        }]
    );
    // Already so: nothing to write.
    let mut n = node(true);
    n.volumes_attached.insert(vname("v"), "/dev/v".into());
    let nodes = Nodes::from([("n1".to_string(), n)]);
    assert!(reconcile(&d, &a, &nodes, Instant::now(), &cfg()).is_empty());
}

#[test]
fn attachments_carried_over_from_node_status_are_kept_while_wanted() {
    let mut d = Desired::default();
    d.set_pod(pod(NS, "p"), "n1", vec![spec("v", false)]);
    let mut a = Actual::default();
    a.entry(&vname("v"), "n1", "d", "v").reported = Some("/dev/x".into());
    let mut n = node(true);
    n.volumes_attached.insert(vname("v"), "/dev/x".into());
    let nodes = Nodes::from([("n1".to_string(), n)]);
    assert!(reconcile(&d, &a, &nodes, Instant::now(), &cfg()).is_empty());
    // Not wanted any more: detached by the name upstream would have given it.
    let actions = reconcile(&Desired::default(), &a, &nodes, Instant::now(), &cfg());
    assert!(
        actions.iter().any(
            |x| matches!(x, Action::Detach { va_name, .. } if *va_name == attachment_name("v", "d", "n1"))
        )
    );
}

#[test]
fn busy_and_backing_off_entries_are_skipped() {
    let now = Instant::now();
    let mut a = Actual::default();
    attach(&mut a, "v", "n1").op = Some(Op::Detach);
    attach(&mut a, "w", "n1").retry_at = Some(now + Duration::from_secs(1));
    let nodes = Nodes::from([("n1".to_string(), node(true))]);
    let actions = reconcile(&Desired::default(), &a, &nodes, now, &cfg());
    assert!(detaches(&actions).is_empty(), "{actions:?}");
}

// ---- properties ----

const VOLS: [&str; 3] = ["a", "b", "c"];
const NODES: [&str; 3] = ["n0", "n1", "n2"];

/// (volume, node, va attached, va deleting, reported only, op (true = attach), detach
/// requested seconds ago, backing off)
type Have = (usize, usize, bool, bool, bool, Option<bool>, Option<u64>, bool);

#[derive(Debug, Clone)]
struct World {
    /// (volume index, node index, pod namespace index)
    wants: Vec<(usize, usize, usize)>,
    multi: [bool; 3],
    have: Vec<Have>,
    /// per node: (exists, ready, out of service, in-use mask, managed)
    nodes: [(bool, bool, bool, u8, bool); 3],
    disable: bool,
}

fn world() -> impl Strategy<Value = World> {
    let want = (0..3usize, 0..3usize, 0..2usize);
    let have = (
        0..3usize,
        0..3usize,
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        proptest::option::of(any::<bool>()),
        proptest::option::of(0..200u64),
        any::<bool>(),
    );
    let node = (any::<bool>(), any::<bool>(), any::<bool>(), 0..8u8, any::<bool>());
    (
        proptest::collection::vec(want, 0..6),
        [any::<bool>(), any::<bool>(), any::<bool>()],
        proptest::collection::vec(have, 0..6),
        [node.clone(), node.clone(), node],
        any::<bool>(),
    )
        .prop_map(|(wants, multi, have, nodes, disable)| World {
            wants,
            multi,
            have,
            nodes,
            disable,
        })
}

/// Gives an entry the state `h` describes (its volume and node are the entry's own).
fn set_state(e: &mut PairState, h: &Have, t0: Instant) {
    let &(v, n, attached, deleting, reported, op, ago, backoff) = h;
    if reported {
        e.reported = Some(String::new());
        e.va = None;
    } else {
        e.reported = None;
        e.va = Some(VaState {
            name: attachment_name(VOLS[v], "d", NODES[n]),
            attached,
            deleting,
            ..Default::default()
        });
    }
    e.op = op.map(|attach| if attach { Op::Attach } else { Op::Detach });
    e.detach_requested = ago.map(|s| t0 - Duration::from_secs(s));
    e.retry_at = backoff.then(|| t0 + Duration::from_secs(1));
}

fn build(w: &World, t0: Instant) -> (Desired, Actual, Nodes, Config) {
    let mut d = Desired::default();
    for (i, (v, n, ns)) in w.wants.iter().enumerate() {
        let ns = ["ns", "other"][*ns];
        d.set_pod(
            pod(ns, &format!("p{i}")),
            NODES[*n],
            vec![spec(VOLS[*v], w.multi[*v])],
        );
    }
    let mut a = Actual::default();
    for h in &w.have {
        set_state(a.entry(&vname(VOLS[h.0]), NODES[h.1], "d", VOLS[h.0]), h, t0);
    }
    let mut nodes = Nodes::new();
    for (i, (exists, ready, oos, mask, managed)) in w.nodes.iter().enumerate() {
        if !exists {
            continue;
        }
        let in_use = (0..3)
            .filter(|b| mask & (1 << b) != 0)
            .map(|b| vname(VOLS[b]))
            .collect();
        nodes.insert(
            NODES[i].to_string(),
            NodeInfo {
                managed: *managed,
                ready: *ready,
                out_of_service: *oos,
                in_use,
                ..Default::default()
            },
        );
    }
    let config = Config {
        max_wait_for_unmount: Duration::from_secs(100),
        disable_force_detach_on_timeout: w.disable,
        ..Default::default()
    };
    (d, a, nodes, config)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// A volume the node still uses is detached only when the node is gone or out of service,
    /// or not Ready with the max wait passed (and forcing allowed).
    #[test]
    fn never_detaches_a_volume_in_use_before_the_deadline(w in world()) {
        // Far enough from the process start that subtracting durations cannot underflow.
        let t0 = Instant::now() + Duration::from_secs(10_000);
        let (d, a, nodes, config) = build(&w, t0);
        let actions = reconcile(&d, &a, &nodes, t0, &config);
        for act in &actions {
            let Action::Detach { volume, node, forced, .. } = act else { continue };
            prop_assert!(d.get(volume, node).is_none(), "detached a wanted volume");
            let Some(n) = nodes.get(node) else {
                prop_assert_eq!(*forced, Some(ForceReason::NodeDeleted));
                continue;
            };
            if !n.in_use.contains(volume) {
                prop_assert_eq!(*forced, None);
                continue;
            }
            if n.out_of_service {
                prop_assert_eq!(*forced, Some(ForceReason::OutOfService));
                continue;
            }
            let requested = a.get(volume, node).and_then(|e| e.detach_requested);
            let waited = requested.map(|t| t0 - t);
            prop_assert!(!n.ready, "forced on a Ready node");
            prop_assert!(!config.disable_force_detach_on_timeout, "forced although disabled");
            prop_assert!(waited.is_some_and(|x| x >= config.max_wait_for_unmount), "forced before the deadline: {:?}", waited);
            prop_assert_eq!(*forced, Some(ForceReason::Timeout));
        }
    }

    /// A single-node volume is never handed to two nodes by one pass, nor to a node while it
    /// is (or may be) attached to another.
    #[test]
    fn single_node_volumes_are_never_attached_twice(w in world()) {
        let t0 = Instant::now() + Duration::from_secs(10_000);
        let (d, a, nodes, config) = build(&w, t0);
        let actions = reconcile(&d, &a, &nodes, t0, &config);
        let mut seen: BTreeMap<String, String> = BTreeMap::new();
        for (volume, node) in attaches(&actions) {
            let multi = d.get(volume, node).expect("attach of an unwanted volume").spec.multi_attach;
            prop_assert!(a.get(volume, node).is_none_or(|e| !e.exists()), "attach of an existing attachment");
            if multi {
                continue;
            }
            prop_assert!(a.other_nodes(volume, node).next().is_none(), "{} attached elsewhere", volume);
            if let Some(prev) = seen.insert(volume.to_string(), node.to_string()) {
                prop_assert_eq!(prev, node.to_string(), "two nodes in one pass");
            }
        }
    }

    /// The attach step of some volumes decides exactly what a full pass decides for them in its
    /// attach phase (attaches, multi-attach refusals, cancelled detach requests): answering a pod
    /// event at once never decides differently from the pass that would have come later.
    #[test]
    fn the_attach_step_decides_as_the_full_pass_does(w in world(), pick in 0..8u8) {
        let t0 = Instant::now() + Duration::from_secs(10_000);
        let (d, a, nodes, config) = build(&w, t0);
        let volumes: BTreeSet<String> = (0..3)
            .filter(|b| pick & (1 << b) != 0)
            .map(|b| vname(VOLS[b]))
            .collect();
        let phase3 = |x: &&Action| {
            matches!(
                x,
                Action::Attach { .. } | Action::MultiAttachError { .. } | Action::CancelDetachRequest { .. }
            )
        };
        let of = |x: &Action| match x {
            Action::Attach { volume, .. }
            | Action::MultiAttachError { volume, .. }
            | Action::CancelDetachRequest { volume, .. } => volume.clone(),
            _ => unreachable!(),
        };
        let full = reconcile(&d, &a, &nodes, t0, &config);
        let mut want: Vec<&Action> = full.iter().filter(phase3).filter(|x| volumes.contains(&of(x))).collect();
        let step = reconcile_attaches(&d, &a, &nodes, t0, &volumes);
        let mut got: Vec<&Action> = step.iter().collect();
        let key = |x: &&Action| format!("{x:?}");
        want.sort_by_key(key);
        got.sort_by_key(key);
        prop_assert_eq!(got, want);
    }

    /// A change of one wanted entry that `pass_unaffected` lets skip the full pass (the
    /// create's result, its watch event) leaves every decision of that pass, and the next
    /// deadline, as they were: skipping it loses nothing.
    #[test]
    fn a_change_that_skips_the_pass_changes_nothing_it_decides(
        mut w in world(),
        attached in any::<bool>(),
        reported in any::<bool>(),
        op in proptest::option::of(any::<bool>()),
        calm_before in any::<bool>(),
        wanted in any::<bool>(),
    ) {
        let t0 = Instant::now() + Duration::from_secs(10_000);
        if w.have.is_empty() {
            w.have.push((0, 0, false, false, false, Some(true), None, false));
        }
        let last = w.have.len() - 1;
        // Mostly a calm entry before, so the predicate holds often enough to test something.
        if calm_before {
            let h = &mut w.have[last];
            (h.3, h.6, h.7) = (false, None, false);
        }
        let (v, n) = (w.have[last].0, w.have[last].1);
        if wanted {
            w.wants.push((v, n, 0));
        }
        let (d, a, nodes, config) = build(&w, t0);
        let (volume, node_name) = (vname(VOLS[v]), NODES[n]);
        let before = a.get(&volume, node_name).expect("the entry").clone();
        let mut a2 = a.clone();
        let e = a2.get_mut(&volume, node_name).expect("the entry");
        set_state(e, &(v, n, attached, false, reported, op, None, false), t0);
        let after = e.clone();
        if pass_unaffected(&before, &after, d.get(&volume, node_name).is_some()) {
            prop_assert_eq!(
                reconcile(&d, &a, &nodes, t0, &config),
                reconcile(&d, &a2, &nodes, t0, &config)
            );
            prop_assert_eq!(next_deadline(&a, &config, t0), next_deadline(&a2, &config, t0));
        }
    }

    /// Detaching and advertising never go together: a volume detached in a pass is not in the
    /// node status that pass writes.
    #[test]
    fn detached_volumes_leave_node_status_first(w in world()) {
        let t0 = Instant::now() + Duration::from_secs(10_000);
        let (d, a, nodes, config) = build(&w, t0);
        let actions = reconcile(&d, &a, &nodes, t0, &config);
        for act in &actions {
            let Action::UpdateNodeStatus { node, volumes, .. } = act else { continue };
            for (volume, detach_node, _) in detaches(&actions) {
                prop_assert!(detach_node != node || volumes.iter().all(|(v, _)| v != volume));
            }
        }
    }
}

fn releases(actions: &[Action]) -> Vec<(&str, &str)> {
    actions
        .iter()
        .filter_map(|x| match x {
            Action::ReleaseAttachment { volume, node, .. } => Some((volume.as_str(), node.as_str())),
            _ => None,
        })
        .collect()
}

/// A dead node's loop attachment being deleted has no agent left to drop its finalizer: the
/// controller releases it when the node is out of service, or gone past the unmount timeout.
#[test]
fn a_dead_nodes_loop_attachment_is_released_only_when_safe() {
    let t0 = Instant::now();
    let deleting = |a: &mut Actual, v: &str, n: &str| {
        let e = a.entry(&vname(v), n, LOOP_DRIVER, v);
        e.va = Some(VaState {
            deleting: true,
            loop_finalizer: true,
            ..attached_va(v, n)
        });
        e.detach_requested = Some(t0);
    };
    let mut a = Actual::default();
    deleting(&mut a, "v", "gone");
    deleting(&mut a, "w", "oos");
    deleting(&mut a, "x", "alive");
    let mut gone = node(true);
    gone.in_use.insert(vname("v"));
    let mut oos = node(false);
    oos.out_of_service = true;
    oos.in_use.insert(vname("w"));
    let mut alive = node(false);
    alive.in_use.insert(vname("x"));
    let nodes = Nodes::from([
        ("gone".to_string(), gone.gone()),
        ("oos".to_string(), oos),
        ("alive".to_string(), alive),
    ]);
    let d = Desired::default();
    let v = vname("v");
    let w = vname("w");
    assert_eq!(
        releases(&reconcile(&d, &a, &nodes, t0, &cfg())),
        vec![(w.as_str(), "oos")]
    );
    let later = reconcile(&d, &a, &nodes, t0 + Duration::from_secs(60), &cfg());
    let mut got = releases(&later);
    got.sort();
    assert_eq!(got, vec![(v.as_str(), "gone"), (w.as_str(), "oos")]);
    // Another driver's attachment is its own attacher's business.
    let mut other = Actual::default();
    let e = other.entry(&vname("v"), "gone", "csi.example.com", "h");
    e.va = Some(VaState {
        name: "va".into(),
        deleting: true,
        loop_finalizer: true,
        ..Default::default()
    });
    e.detach_requested = Some(t0);
    assert!(
        releases(&reconcile(
            &d,
            &other,
            &nodes,
            t0 + Duration::from_secs(600),
            &cfg()
        ))
        .is_empty()
    );
}

/// What the attach burst relies on: the create's result (an attachment not yet attached) skips
/// the pass; becoming attached (node status), being deleted, or not being wanted does not.
#[test]
fn only_a_calm_wanted_entry_skips_the_pass() {
    let mut creating = PairState {
        op: Some(Op::Attach),
        ..Default::default()
    };
    let mut created = creating.clone();
    created.op = None;
    created.va = Some(VaState {
        name: "va".into(),
        ..Default::default()
    });
    assert!(pass_unaffected(&creating, &created, true));
    assert!(
        !pass_unaffected(&creating, &created, false),
        "not wanted: a detach to decide"
    );
    let mut attached = created.clone();
    attached.va.as_mut().unwrap().attached = true;
    assert!(
        !pass_unaffected(&created, &attached, true),
        "node status to write"
    );
    let mut deleting = created.clone();
    deleting.va.as_mut().unwrap().deleting = true;
    assert!(!pass_unaffected(&created, &deleting, true));
    creating.retry_at = Some(Instant::now());
    assert!(
        !pass_unaffected(&creating, &created, true),
        "a retry deadline went away"
    );
    assert!(
        !pass_unaffected(&PairState::default(), &created, true),
        "a new entry"
    );
}

/// Entries of plugins the controller does not have (here an old in-tree EBS name and a flex
/// volume's) are written back as the node had them, guarded by the resourceVersion they were
/// read at; before, a status write replaced the list and dropped them.
#[test]
fn entries_of_other_plugins_stay_in_node_status() {
    let mut d = Desired::default();
    d.set_pod(pod(NS, "p"), "n1", vec![spec("v", false)]);
    let mut a = Actual::default();
    attach(&mut a, "v", "n1");
    let mut n = node(true);
    n.resource_version = Some("42".into());
    n.volumes_attached.insert(
        "kubernetes.io/aws-ebs/aws://zone/vol-1".into(),
        "/dev/xvdf".into(),
    );
    n.volumes_attached
        .insert("flexvolume-example/foo/bar".into(), String::new());
    let nodes = Nodes::from([("n1".to_string(), n.clone())]);
    let actions = reconcile(&d, &a, &nodes, Instant::now(), &cfg());
    assert_eq!(
        actions,
        vec![Action::UpdateNodeStatus {
            node: "n1".into(),
            volumes: vec![
                ("flexvolume-example/foo/bar".into(), String::new()),
                (
                    "kubernetes.io/aws-ebs/aws://zone/vol-1".into(),
                    "/dev/xvdf".into()
                ),
                (vname("v"), "/dev/v".into()),
            ],
            guard: Some("42".into()),
        }]
    );
    // Once written, nothing more to do; and they stay however the managed ones change.
    let mut n2 = n.clone();
    n2.volumes_attached.insert(vname("v"), "/dev/v".into());
    let nodes = Nodes::from([("n1".to_string(), n2)]);
    assert!(reconcile(&d, &a, &nodes, Instant::now(), &cfg()).is_empty());
    let nodes = Nodes::from([("n1".to_string(), n)]);
    let actions = reconcile(
        &Desired::default(),
        &Actual::default(),
        &nodes,
        Instant::now(),
        &cfg(),
    );
    assert!(actions.is_empty(), "{actions:?}");
}

/// iSCSI and FC volumes are attached by the same rules, without a VolumeAttachment: the
/// action says so, and their detach waits for the node to stop using them like any other.
#[test]
fn in_tree_volumes_attach_and_detach_by_the_same_rules() {
    let iscsi = VolumeSpec {
        name: "kubernetes.io/iscsi/10.0.0.1:3260:iqn.2001-04.com.example:t:0".into(),
        pv_name: "pv-iscsi".into(),
        driver: "kubernetes.io/iscsi".into(),
        handle: "10.0.0.1:3260:iqn.2001-04.com.example:t:0".into(),
        multi_attach: false,
        kind: Kind::InTree,
    };
    let mut d = Desired::default();
    d.set_pod(pod(NS, "p"), "n1", vec![iscsi.clone()]);
    let nodes = Nodes::from([("n1".to_string(), node(true))]);
    let actions = reconcile(&d, &Actual::default(), &nodes, Instant::now(), &cfg());
    assert!(
        matches!(&actions[..], [Action::Attach { kind: Kind::InTree, volume, .. }] if *volume == iscsi.name)
    );
    // Marked attached: listed with an empty device path.
    let mut a = Actual::default();
    a.entry(&iscsi.name, "n1", &iscsi.driver, &iscsi.handle).reported = Some(String::new());
    let actions = reconcile(&d, &a, &nodes, Instant::now(), &cfg());
    assert!(
        matches!(&actions[..], [Action::UpdateNodeStatus { volumes, .. }] if *volumes == vec![(iscsi.name.clone(), String::new())])
    );
    // Not wanted, still in use on a Ready node: waits.
    let mut n = node(true);
    n.in_use.insert(iscsi.name.clone());
    n.volumes_attached.insert(iscsi.name.clone(), String::new());
    a.get_mut(&iscsi.name, "n1").unwrap().detach_requested = Some(Instant::now());
    let nodes = Nodes::from([("n1".to_string(), n.clone())]);
    let actions = reconcile(&Desired::default(), &a, &nodes, Instant::now(), &cfg());
    assert!(
        matches!(&actions[..], [Action::WaitForUnmount { .. }]),
        "{actions:?}"
    );
    // No longer in use: leaves node status in the pass that detaches it.
    n.in_use.clear();
    let nodes = Nodes::from([("n1".to_string(), n)]);
    let actions = reconcile(&Desired::default(), &a, &nodes, Instant::now(), &cfg());
    assert_eq!(detaches(&actions), vec![(iscsi.name.as_str(), "n1", None)]);
    assert!(
        actions
            .iter()
            .any(|x| matches!(x, Action::UpdateNodeStatus { volumes, .. } if volumes.is_empty()))
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    /// Whatever the pass decides, every node status it writes keeps every entry the
    /// controller does not manage, with its device path, guarded by the version it was read at.
    #[test]
    fn entries_the_controller_does_not_manage_are_never_dropped(
        w in world(),
        foreign in proptest::collection::btree_map("(kubernetes\\.io/(aws-ebs|rbd|iscsi|fc|csi)|[a-z]{1,6})/[a-z0-9^]{0,6}", "[a-z/]{0,4}", 0..4),
    ) {
        let t0 = Instant::now() + Duration::from_secs(10_000);
        let (d, a, mut nodes, config) = build(&w, t0);
        for (i, n) in nodes.values_mut().enumerate() {
            n.resource_version = Some(format!("{i}"));
            n.volumes_attached.extend(foreign.clone());
        }
        for act in reconcile(&d, &a, &nodes, t0, &config) {
            let Action::UpdateNodeStatus { node, volumes, guard } = act else { continue };
            let n = &nodes[&node];
            let kept: Vec<(&String, &String)> = n.volumes_attached.iter().filter(|(v, _)| !is_managed_name(v)).collect();
            for (v, p) in &kept {
                prop_assert!(volumes.iter().any(|(x, y)| x == *v && y == *p), "dropped {}", v);
            }
            prop_assert_eq!(guard.is_some(), !kept.is_empty());
        }
    }
}
