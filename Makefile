# stowage — `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help
CARGO ?= cargo
TARGET_DIR := $(or $(CARGO_TARGET_DIR),target)

.PHONY: help
help: ## List targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

.PHONY: deps
deps: ## Install the OS tools tests and the demo need (root; no-op when present)
	@./e2e/scripts/install-deps.sh

.PHONY: controlplane
controlplane: ## Build etcd, kube-apiserver, kube-controller-manager, kubectl (cached by go.mod/go.sum)
	@./e2e/scripts/build-controlplane.sh

.PHONY: csi-sanity
csi-sanity: ## Build csi-sanity from the csi-test module pinned in e2e/csi (cached by go.mod/go.sum)
	@./e2e/scripts/build-csi-sanity.sh

.PHONY: kubeadm
kubeadm: ## Build kubeadm of the pinned release from e2e/kubeadm (cached by go.mod/go.sum); the distributions guide's test renders with it
	@./e2e/scripts/build-kubeadm.sh

.PHONY: promtool
promtool: ## Build promtool from the Prometheus module pinned in e2e/promtool (cached by go.mod/go.sum)
	@./e2e/scripts/build-promtool.sh

.PHONY: storage-e2e-suite
storage-e2e-suite: ## Build Kubernetes' storage e2e suite, ginkgo and agnhost from e2e/storage (cached by go.mod/go.sum)
	@./e2e/scripts/build-storage-e2e.sh

.PHONY: sidecars
sidecars: ## Build the upstream external-provisioner and external-attacher from e2e/sidecars (cached by go.mod/go.sum)
	@./e2e/scripts/build-sidecars.sh

.PHONY: build
build: ## Build both binaries
	$(CARGO) build --workspace --bins

.PHONY: test
test: deps controlplane kubeadm ## Run unit, property and integration tests (real control plane, csi-sanity, promtool, real nodes, a subset of Kubernetes' storage e2e suite)
	@# Go tools only the steps after the workspace's tests need build beside them (a no-op when
	@# cached): on a cold machine their minutes hide behind the Rust build and tests that mostly wait.
	@# (`make`, not `$$(MAKE)`: make -n runs the lines that name the latter.)
	@./e2e/scripts/background.sh start $(TARGET_DIR)/background go-tools make --no-print-directory csi-sanity promtool storage-e2e-suite sidecars
	$(CARGO) build --workspace --bins
	@# The image tests unpack an archive of the binaries under test; debug ones cost no second build.
	STOWAGE_IMAGE_BIN_DIR=$(TARGET_DIR)/debug ./e2e/scripts/image.sh
	@# The real-node test's pod and sandbox images (Debian busybox-static, cached).
	./e2e/scripts/pod-images.sh
	@# csi-sanity and the real-node scenarios run on their own, their output shown: CI logs keep
	@# the csi-sanity counts and each real-node step's state.
	$(CARGO) test --workspace --no-fail-fast -- --skip a_kubelet_runs_pods_on_loop_volumes --skip node_local_volumes_on_two_real_nodes --skip csi_sanity_passes --skip a_third_party_csi_driver --skip a_real_prometheus_scrapes --skip moving_back_to_kcm --skip the_kind_guide_runs --skip the_kubeadm_guide_runs --skip alert_rules_pass_promtool
	@./e2e/scripts/background.sh wait $(TARGET_DIR)/background go-tools
	$(CARGO) test -p stowage-chart-tests --test monitoring -- alert_rules_pass_promtool
	@# The CSI mock tests' stand-ins (e2e/storage/cmd, internal), each tested on its own.
	cd e2e/storage && go test ./cmd/... ./internal/...
	$(CARGO) test -p stowage-agent --test csi_sanity -- --nocapture
	@start=$$(date +%s); $(CARGO) test -p stowage-chart-tests --test realnode -- --nocapture && \
	  echo "real-node scenarios: $$(( $$(date +%s) - start ))s"
	@start=$$(date +%s); $(CARGO) test -p stowage-chart-tests --test realnode2 -- --nocapture && \
	  echo "two-node scenarios: $$(( $$(date +%s) - start ))s"
	@start=$$(date +%s); $(CARGO) test -p stowage-chart-tests --test realnode_local -- --nocapture && \
	  echo "two nodes, node-local stores: $$(( $$(date +%s) - start ))s"
	@start=$$(date +%s); $(CARGO) test -p stowage-chart-tests --test realnode_external -- --nocapture && \
	  echo "third-party driver, KCM and stowage side by side: $$(( $$(date +%s) - start ))s"
	@start=$$(date +%s); $(CARGO) test -p stowage-chart-tests --test realnode_prometheus -- --nocapture && \
	  echo "Prometheus on the chart's monitoring: $$(( $$(date +%s) - start ))s"
	@start=$$(date +%s); $(CARGO) test -p stowage-chart-tests --test realnode_uninstall -- --nocapture && \
	  echo "moving back to KCM and uninstalling: $$(( $$(date +%s) - start ))s"
	@# Kubernetes' own storage e2e suite: the tests of e2e/storage/subset.txt on two real nodes
	@# (make e2e-storage runs all of it). Its counts close the log.
	./e2e/scripts/curl-image.sh
	@start=$$(date +%s); E2E_SUITES=external E2E_SUBSET=1 ./e2e/scripts/e2e-storage.sh && \
	  echo "storage e2e subset: $$(( $$(date +%s) - start ))s"
	@# The same on two nodes that share no image store (the chart's default): topology and
	@# capacity (subset-local.txt), and the storage controllers' own tests (subset-controllers.txt).
	@start=$$(date +%s); E2E_STORE=local E2E_SUBSET=1 ./e2e/scripts/e2e-storage.sh && \
	  echo "storage e2e subset, local stores: $$(( $$(date +%s) - start ))s"

# The other minors the chart's kubeVersion claims (v1.36 is make test's); e2e/versions/1.33 is
# there to show where the range stops (K8S_VERSIONS=1.33: VolumeAttributesClass is off there).
K8S_VERSIONS ?= 1.37 1.35 1.34
# The minors whose kubelet is pinned too (e2e/versions/<minor>/go.mod names cmd/kubelet).
K8S_REALNODE_VERSIONS ?= 1.37 1.35

.PHONY: test-versions
test-versions: deps controlplane ## The controllers' apiserver integration tests against other Kubernetes minors (K8S_VERSIONS, default 1.37 1.35 1.34)
	@# Each minor's kube-apiserver, kube-controller-manager and kubectl are built once and cached
	@# (e2e/scripts/build-controlplane-version.sh); logs in e2e/results/versions/.
	CARGO=$(CARGO) ./e2e/scripts/test-versions.sh $(K8S_VERSIONS)

.PHONY: test-versions-realnode
test-versions-realnode: deps controlplane ## The real-node scenarios with another minor's kubelet, scheduler and control plane (K8S_REALNODE_VERSIONS, default 1.37 1.35)
	@# Each minor's five binaries are built once and cached; logs in e2e/results/versions/.
	CARGO=$(CARGO) ./e2e/scripts/test-versions-realnode.sh $(K8S_REALNODE_VERSIONS)

.PHONY: test-matrix
test-matrix: test-versions ## The whole version matrix: test-versions, then the one- and two-node real-node scenarios on K8S_REALNODE_VERSIONS
	REALNODE_TESTS="realnode realnode2" CARGO=$(CARGO) ./e2e/scripts/test-versions-realnode.sh $(K8S_REALNODE_VERSIONS)

.PHONY: image
image: deps ## Build the OCI image archive target/image/stowage-<version>.oci.tar offline (Debian packages + release binaries)
	@./e2e/scripts/image.sh

.PHONY: lint
lint: ## cargo fmt --check, clippy -D warnings, helm lint, no module loop in the controllers, common or the agent
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	python3 e2e/scripts/module-loops.py controllers/*/src crates/common/src crates/agent/src
	@if [ -d charts/stowage ]; then ./e2e/scripts/helm.sh lint --strict charts/stowage; fi

.PHONY: demo
demo: deps controlplane node-images ## The product as a user meets it: a real kubelet node, stowage installed by helm, a claim and a pod writing data, an online grow, Delete vs Retain, the Prometheus view
	./e2e/scripts/realnode.sh demo

.PHONY: demo-lite
demo-lite: deps controlplane ## The demo without a kubelet or containerd (stowage's agents play the nodes): sample claims to Bound, volumes mounted, a grow, Delete vs Retain
	$(CARGO) build --workspace --bins
	./e2e/scripts/demo.sh

.PHONY: node-images
node-images: deps ## Build the stowage image (debug binaries) and the pod/sandbox images for the real node
	$(CARGO) build --workspace --bins
	STOWAGE_IMAGE_BIN_DIR=$(TARGET_DIR)/debug ./e2e/scripts/image.sh
	./e2e/scripts/pod-images.sh
	./e2e/scripts/curl-image.sh

.PHONY: kind-node-image
kind-node-image: deps controlplane kubeadm ## Build the kind rig's node image offline (Debian, this release's Kubernetes binaries and control-plane images) into the rig's dockerd
	./e2e/scripts/kind.sh image

.PHONY: kind-up
kind-up: deps controlplane kubeadm ## A real kind cluster (one control plane, two workers) made and installed as docs/distributions.md says; KUBECONFIG=.kind/kubeconfig
	./e2e/scripts/kind.sh up

.PHONY: kind-down
kind-down: ## Delete the kind cluster and stop the rig's dockerd
	./e2e/scripts/kind.sh down

.PHONY: test-kind
test-kind: deps controlplane kubeadm ## The kind guide run as written on a real kind cluster (not in make test: a cold node image takes minutes)
	./e2e/scripts/kind.sh image
	$(CARGO) test -p stowage-chart-tests --test kind -- --nocapture

.PHONY: realnode-up
realnode-up: deps controlplane node-images ## Start a real node (kubelet, containerd) and helm-install stowage into it
	./e2e/scripts/realnode.sh up

.PHONY: realnode-down
realnode-down: ## Stop the real node and remove what it left behind
	./e2e/scripts/realnode.sh down

.PHONY: side-by-side
side-by-side: deps controlplane sidecars node-images ## A third-party CSI driver (the upstream sidecars) on a real node under KCM's storage controllers, then stowage's; end states compared
	$(CARGO) test -p stowage-chart-tests --test realnode_external -- --nocapture

.PHONY: soak
soak: deps controlplane ## Chaos soak: HA controller, agents, churn and faults; DURATION (default 30m) and SEED (default random); prints the summary
	$(CARGO) build --workspace --bins
	@# A failing run leaves its bundle (logs, object dumps, timeline) in e2e/results/soak-<seed>-<time>/.
	$(TARGET_DIR)/debug/stowage-soak --duration $(or $(DURATION),30m) $(if $(SEED),--seed $(SEED)) --results e2e/results

.PHONY: e2e-storage
e2e-storage: deps controlplane storage-e2e-suite node-images sidecars ## Kubernetes' storage e2e tests on two real nodes: External Storage and the controllers' own tests, the latter under stowage and KCM side by side; E2E_STORE, E2E_FOCUS; results in e2e/results/
	./e2e/scripts/e2e-storage-all.sh

.PHONY: bench
bench: deps controlplane ## Side-by-side benchmarks against upstream kube-controller-manager
	$(CARGO) build --release --workspace --bins
	./e2e/scripts/bench.sh
