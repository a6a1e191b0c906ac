//! Builders for the objects stowage works on. Each starts from the smallest valid object and
//! `build()`s the k8s-openapi type, e.g. `pv("a").capacity("1Gi").class("fast").build()`.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, Container, Namespace, Node, NodeCondition, NodeSpec, NodeStatus,
    ObjectReference, PersistentVolume, PersistentVolumeClaim, PersistentVolumeClaimSpec,
    PersistentVolumeClaimVolumeSource, PersistentVolumeSpec, Pod, PodSpec, ServiceAccount, Volume,
    VolumeMount, VolumeResourceRequirements,
};
use k8s_openapi::api::storage::v1::{CSIDriver, CSIDriverSpec, StorageClass};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::Resource;
use kube::api::ObjectMeta;

fn meta(name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_string()),
        ..Default::default()
    }
}

fn namespaced_meta(namespace: &str, name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: Some(namespace.into()),
        ..Default::default()
    }
}

/// A `storage` resource map (a volume's capacity, a claim's request).
fn storage(q: &str) -> BTreeMap<String, Quantity> {
    BTreeMap::from([("storage".to_string(), Quantity(q.into()))])
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// A namespace and its `default` ServiceAccount (no service-account controller runs in tests, and
/// the default ServiceAccount admission plugin rejects pods without one).
pub fn namespace(name: &str) -> (Namespace, ServiceAccount) {
    let sa = ServiceAccount {
        metadata: namespaced_meta(name, "default"),
        ..Default::default()
    };
    (
        Namespace {
            metadata: meta(name),
            ..Default::default()
        },
        sa,
    )
}

/// The shared core of every builder: the object under construction. What all kinds have
/// (metadata, `build`) is implemented once here; each kind adds its own setters in an
/// `impl Builder<Kind>` block.
pub struct Builder<K>(K);

pub type NodeBuilder = Builder<Node>;
pub type StorageClassBuilder = Builder<StorageClass>;
pub type PvBuilder = Builder<PersistentVolume>;
pub type PvcBuilder = Builder<PersistentVolumeClaim>;
pub type PodBuilder = Builder<Pod>;

impl<K: Resource> Builder<K> {
    pub fn label(mut self, k: &str, v: &str) -> Self {
        self.0
            .meta_mut()
            .labels
            .get_or_insert_with(BTreeMap::new)
            .insert(k.into(), v.into());
        self
    }
    pub fn annotation(mut self, k: &str, v: &str) -> Self {
        self.0
            .meta_mut()
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(k.into(), v.into());
        self
    }
    pub fn build(self) -> K {
        self.0
    }
}

pub fn node(name: &str) -> NodeBuilder {
    Builder(Node {
        metadata: meta(name),
        spec: Some(NodeSpec::default()),
        status: None,
    })
}

impl Builder<Node> {
    /// The annotation a kubelet (or stowage-agent) sets when the controller attaches for it.
    pub fn controller_attach(self) -> Self {
        self.annotation("volumes.kubernetes.io/controller-managed-attach-detach", "true")
    }
    pub fn ready(mut self, ready: bool) -> Self {
        let st = self.0.status.get_or_insert_with(NodeStatus::default);
        st.conditions = Some(vec![NodeCondition {
            type_: "Ready".into(),
            status: if ready { "True" } else { "False" }.into(),
            ..Default::default()
        }]);
        self
    }
}

pub fn csi_driver(name: &str, attach_required: bool) -> CSIDriver {
    CSIDriver {
        metadata: meta(name),
        spec: CSIDriverSpec {
            attach_required: Some(attach_required),
            ..Default::default()
        },
    }
}

pub fn storage_class(name: &str, provisioner: &str) -> StorageClassBuilder {
    Builder(StorageClass {
        metadata: meta(name),
        provisioner: provisioner.into(),
        ..Default::default()
    })
}

impl Builder<StorageClass> {
    pub fn reclaim(mut self, policy: &str) -> Self {
        self.0.reclaim_policy = Some(policy.into());
        self
    }
    pub fn wait_for_first_consumer(mut self) -> Self {
        self.0.volume_binding_mode = Some("WaitForFirstConsumer".into());
        self
    }
    pub fn allow_expansion(mut self, allow: bool) -> Self {
        self.0.allow_volume_expansion = Some(allow);
        self
    }
    pub fn parameter(mut self, k: &str, v: &str) -> Self {
        self.0
            .parameters
            .get_or_insert_with(BTreeMap::new)
            .insert(k.into(), v.into());
        self
    }
    pub fn default_class(self) -> Self {
        self.annotation("storageclass.kubernetes.io/is-default-class", "true")
    }
}

/// The setters of the spec fields volumes and claims share (same names, types and meaning in
/// both). A macro, as the two k8s-openapi spec types have no common trait a function could use;
/// the `impl` it expands in provides `spec()`.
macro_rules! shared_volume_spec_setters {
    () => {
        pub fn access_modes(mut self, modes: &[&str]) -> Self {
            self.spec().access_modes = Some(strings(modes));
            self
        }
        /// Sets the class; on a claim, `""` asks explicitly for volumes without a class.
        pub fn class(mut self, class: &str) -> Self {
            self.spec().storage_class_name = Some(class.into());
            self
        }
        pub fn block(mut self) -> Self {
            self.spec().volume_mode = Some("Block".into());
            self
        }
        pub fn attributes_class(mut self, class: &str) -> Self {
            self.spec().volume_attributes_class_name = Some(class.into());
            self
        }
    };
}

/// A 1Gi ReadWriteOnce volume of the built-in driver, Retain, no class.
pub fn pv(name: &str) -> PvBuilder {
    Builder(PersistentVolume {
        metadata: meta(name),
        spec: Some(PersistentVolumeSpec {
            capacity: Some(storage("1Gi")),
            access_modes: Some(strings(&["ReadWriteOnce"])),
            persistent_volume_reclaim_policy: Some("Retain".into()),
            csi: Some(CSIPersistentVolumeSource {
                driver: "loop.stowage.dev".into(),
                volume_handle: name.into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        status: None,
    })
}

impl Builder<PersistentVolume> {
    shared_volume_spec_setters!();
    fn spec(&mut self) -> &mut PersistentVolumeSpec {
        self.0.spec.get_or_insert_with(Default::default)
    }
    pub fn capacity(mut self, q: &str) -> Self {
        self.spec().capacity = Some(storage(q));
        self
    }
    pub fn reclaim(mut self, policy: &str) -> Self {
        self.spec().persistent_volume_reclaim_policy = Some(policy.into());
        self
    }
    pub fn driver(mut self, driver: &str, handle: &str) -> Self {
        self.spec().csi = Some(CSIPersistentVolumeSource {
            driver: driver.into(),
            volume_handle: handle.into(),
            ..Default::default()
        });
        self
    }
    /// Pre-binds to a claim; `uid` empty means "by name only", as a user would write it.
    pub fn claim_ref(mut self, namespace: &str, name: &str, uid: &str) -> Self {
        self.spec().claim_ref = Some(ObjectReference {
            kind: Some("PersistentVolumeClaim".into()),
            api_version: Some("v1".into()),
            namespace: Some(namespace.into()),
            name: Some(name.into()),
            uid: (!uid.is_empty()).then(|| uid.into()),
            ..Default::default()
        });
        self
    }
    pub fn node_affinity_hostname(mut self, node: &str) -> Self {
        use k8s_openapi::api::core::v1::{
            NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, VolumeNodeAffinity,
        };
        self.spec().node_affinity = Some(VolumeNodeAffinity {
            required: Some(NodeSelector {
                node_selector_terms: vec![NodeSelectorTerm {
                    match_expressions: Some(vec![NodeSelectorRequirement {
                        key: "kubernetes.io/hostname".into(),
                        operator: "In".into(),
                        values: Some(vec![node.into()]),
                    }]),
                    ..Default::default()
                }],
            }),
        });
        self
    }
}

/// A 1Gi ReadWriteOnce claim with no class set (the DefaultStorageClass admission may fill it).
pub fn pvc(namespace: &str, name: &str) -> PvcBuilder {
    Builder(PersistentVolumeClaim {
        metadata: namespaced_meta(namespace, name),
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(strings(&["ReadWriteOnce"])),
            resources: Some(VolumeResourceRequirements {
                requests: Some(storage("1Gi")),
                ..Default::default()
            }),
            ..Default::default()
        }),
        status: None,
    })
}

impl Builder<PersistentVolumeClaim> {
    shared_volume_spec_setters!();
    fn spec(&mut self) -> &mut PersistentVolumeClaimSpec {
        self.0.spec.get_or_insert_with(Default::default)
    }
    pub fn request(mut self, q: &str) -> Self {
        self.spec()
            .resources
            .get_or_insert_with(Default::default)
            .requests = Some(storage(q));
        self
    }
    pub fn volume_name(mut self, pv: &str) -> Self {
        self.spec().volume_name = Some(pv.into());
        self
    }
    pub fn selector(mut self, k: &str, v: &str) -> Self {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
        self.spec().selector = Some(LabelSelector {
            match_labels: Some(BTreeMap::from([(k.into(), v.into())])),
            ..Default::default()
        });
        self
    }
}

/// A one-container pod (never run by a kubelet in tests; it only has to be valid).
pub fn pod(namespace: &str, name: &str) -> PodBuilder {
    Builder(Pod {
        metadata: namespaced_meta(namespace, name),
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "app".into(),
                image: Some("busybox".into()),
                ..Default::default()
            }],
            ..Default::default()
        }),
        status: None,
    })
}

impl Builder<Pod> {
    fn spec(&mut self) -> &mut PodSpec {
        self.0.spec.get_or_insert_with(Default::default)
    }
    /// Adds pod volume `vol` of claim `claim`; the callers add its use by the container.
    fn claim_volume(&mut self, vol: &str, claim: &str) {
        self.spec().volumes.get_or_insert_with(Vec::new).push(Volume {
            name: vol.into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: claim.into(),
                read_only: None,
            }),
            ..Default::default()
        });
    }
    /// Mounts claim `claim` as volume `vol` at `/data/<vol>`.
    pub fn claim(mut self, vol: &str, claim: &str) -> Self {
        self.claim_volume(vol, claim);
        let mount = VolumeMount {
            name: vol.into(),
            mount_path: format!("/data/{vol}"),
            ..Default::default()
        };
        self.spec().containers[0]
            .volume_mounts
            .get_or_insert_with(Vec::new)
            .push(mount);
        self
    }
    pub fn node(mut self, node: &str) -> Self {
        self.spec().node_name = Some(node.into());
        self
    }
    /// Uses claim `claim` as raw block volume `vol` at `/dev/<vol>` (`volumeDevices`).
    pub fn claim_device(mut self, vol: &str, claim: &str) -> Self {
        self.claim_volume(vol, claim);
        let dev = k8s_openapi::api::core::v1::VolumeDevice {
            name: vol.into(),
            device_path: format!("/dev/{vol}"),
        };
        self.spec().containers[0]
            .volume_devices
            .get_or_insert_with(Vec::new)
            .push(dev);
        self
    }
    /// The pod's `securityContext.fsGroup`.
    pub fn fs_group(mut self, gid: i64) -> Self {
        self.spec()
            .security_context
            .get_or_insert_with(Default::default)
            .fs_group = Some(gid);
        self
    }
}

/// Creates a namespace with its `default` ServiceAccount (see [`namespace`]); panics on failure,
/// as a test cannot go on without it.
pub async fn create_namespace(client: &kube::Client, name: &str) {
    use kube::Api;
    use kube::api::PostParams;
    let (ns, sa) = namespace(name);
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap_or_else(|e| panic!("create namespace {name}: {e}"));
    Api::<ServiceAccount>::namespaced(client.clone(), name)
        .create(&PostParams::default(), &sa)
        .await
        .unwrap_or_else(|e| panic!("create the default ServiceAccount of {name}: {e}"));
}
