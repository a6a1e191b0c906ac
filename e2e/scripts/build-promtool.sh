#!/usr/bin/env bash
# promtool from the Prometheus module pinned in e2e/promtool/go.mod (cached; see build-go-tool.sh).
# Without the cloud service discoveries (their SDKs were most of a cold build: 9 of its minutes
# on 2 cores); the tests check rules and scrape configs, which name Kubernetes discovery only.
GO_TOOL_TAGS=remove_all_sd,enable_kubernetes_sd exec "$(dirname "$0")/build-go-tool.sh" promtool promtool github.com/prometheus/prometheus/cmd/promtool
