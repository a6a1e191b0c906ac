//go:build tools

// external-provisioner, pinned: the upstream sidecar run against the loop driver's second (external) name.
package tools

import _ "github.com/kubernetes-csi/external-provisioner/v6/cmd/csi-provisioner"
