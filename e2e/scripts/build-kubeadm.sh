#!/usr/bin/env bash
# kubeadm from the Kubernetes module pinned in e2e/kubeadm/go.mod, its version stamped in as the
# control plane's are (kubeadm checks the configuration's kubernetesVersion against its own);
# cached, see build-go-tool.sh.
set -euo pipefail
cd "$(dirname "$0")/../kubeadm"
# shellcheck source=e2e/scripts/k8s-ldflags.sh
. ../scripts/k8s-ldflags.sh
GO_TOOL_LDFLAGS=$(k8s_ldflags) exec ../scripts/build-go-tool.sh kubeadm kubeadm k8s.io/kubernetes/cmd/kubeadm
