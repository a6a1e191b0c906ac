#!/usr/bin/env bash
# promtool from the Prometheus module pinned in e2e/promtool/go.mod (cached; see build-go-tool.sh).
exec "$(dirname "$0")/build-go-tool.sh" promtool promtool github.com/prometheus/prometheus/cmd/promtool
