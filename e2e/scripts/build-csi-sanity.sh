#!/usr/bin/env bash
# csi-sanity from the csi-test module pinned in e2e/csi/go.mod (cached; see build-go-tool.sh).
exec "$(dirname "$0")/build-go-tool.sh" csi csi-sanity github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity
