//go:build tools

// Package storage pins the ginkgo CLI at the version k8s.io/kubernetes requires: it runs the
// compiled suite in parallel processes; and agnhost, the test image most storage tests run,
// built from the same release. Never compiled.
package storage

import (
	_ "github.com/onsi/ginkgo/v2/ginkgo"
	_ "k8s.io/kubernetes/test/images/agnhost"
)
