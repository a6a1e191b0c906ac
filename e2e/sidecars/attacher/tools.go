//go:build tools

// external-attacher, pinned: the upstream sidecar run against the loop driver's second (external) name.
package tools

import _ "github.com/kubernetes-csi/external-attacher/v4/cmd/csi-attacher"
