//go:build tools

// Package promtool pins the Prometheus release whose promtool checks the chart's alert rules
// (`promtool check rules`, `promtool test rules`); it is never compiled.
package promtool

import (
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
