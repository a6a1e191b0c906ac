//! CSI migration: which CSI driver serves an in-tree plugin's volumes, and the annotation that
//! says a PV or claim was handed to it.

/// On a PV or claim made for an in-tree plugin whose volumes a CSI driver now serves: that driver.
pub const ANN_MIGRATED_TO: &str = "pv.kubernetes.io/migrated-to";

/// The CSI driver that serves an in-tree plugin's volumes since CSI migration went GA (the
/// table of csi-translation-lib; every entry is migrated unconditionally in v1.36).
pub fn migrated_driver(in_tree: &str) -> Option<&'static str> {
    Some(match in_tree {
        "kubernetes.io/aws-ebs" => "ebs.csi.aws.com",
        "kubernetes.io/gce-pd" => "pd.csi.storage.gke.io",
        "kubernetes.io/azure-disk" => "disk.csi.azure.com",
        "kubernetes.io/azure-file" => "file.csi.azure.com",
        "kubernetes.io/cinder" => "cinder.csi.openstack.org",
        "kubernetes.io/vsphere-volume" => "csi.vsphere.vmware.com",
        "kubernetes.io/portworx-volume" => "pxd.portworx.com",
        _ => return None,
    })
}
