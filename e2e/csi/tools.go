//go:build tools

// Package csi pins the CSI tools this repository builds; it is never compiled.
package csi

import (
	_ "github.com/container-storage-interface/spec/lib/go/csi"
	_ "github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity"
	_ "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)
