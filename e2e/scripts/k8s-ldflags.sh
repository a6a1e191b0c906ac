# Sourced by the scripts that build Kubernetes binaries from a Go module pinning k8s.io/kubernetes
# (the current directory): k8s_ldflags prints the -ldflags that stamp the release's version into
# them, so `--version` shows v1.36.3 rather than v0.0.0-master, and strip them.
k8s_ldflags() {
  local version minor vpkg=k8s.io/component-base/version
  version=$(go list -m -f '{{.Version}}' k8s.io/kubernetes)
  minor=$(echo "$version" | cut -d. -f2)
  echo "-s -w -X $vpkg.gitVersion=$version -X $vpkg.gitMajor=1 -X $vpkg.gitMinor=$minor -X $vpkg.gitTreeState=clean"
}
