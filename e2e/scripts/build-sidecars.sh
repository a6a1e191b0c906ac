#!/usr/bin/env bash
# The upstream CSI sidecars external-provisioner and external-attacher, each from its module pinned
# in e2e/sidecars/<name>/go.mod (cached; see build-go-tool.sh). They drive the loop driver's
# second, external name (ext.loop.stowage.dev) as they would any third-party CSI driver.
set -euo pipefail
here=$(dirname "$0")
"$here/build-go-tool.sh" sidecars/provisioner csi-provisioner github.com/kubernetes-csi/external-provisioner/v6/cmd/csi-provisioner
"$here/build-go-tool.sh" sidecars/attacher csi-attacher github.com/kubernetes-csi/external-attacher/v4/cmd/csi-attacher
