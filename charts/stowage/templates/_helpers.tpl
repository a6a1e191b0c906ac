{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "stowage.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-scoped base name; the release name alone when it already contains the chart name. */}}
{{- define "stowage.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "stowage.controller.fullname" -}}
{{- printf "%s-controller" (include "stowage.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "stowage.agent.fullname" -}}
{{- printf "%s-agent" (include "stowage.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "stowage.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "stowage.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels must never change across upgrades (they are immutable on Deployments). */}}
{{- define "stowage.controller.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stowage.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: controller
{{- end }}

{{- define "stowage.agent.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stowage.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: agent
{{- end }}

{{- define "stowage.controller.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "stowage.controller.fullname" .) .Values.serviceAccount.controllerName }}
{{- else }}
{{- required "serviceAccount.controllerName is required when serviceAccount.create is false" .Values.serviceAccount.controllerName }}
{{- end }}
{{- end }}

{{- define "stowage.agent.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "stowage.agent.fullname" .) .Values.serviceAccount.agentName }}
{{- else }}
{{- required "serviceAccount.agentName is required when serviceAccount.create is false" .Values.serviceAccount.agentName }}
{{- end }}
{{- end }}

{{- define "stowage.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The image store volume, shared by the controller and the agents. */}}
{{- define "stowage.imageStoreMode" -}}
{{- if not (has .Values.imageStore.mode (list "local" "shared")) }}
{{- fail (printf "imageStore.mode must be local or shared, not %q" .Values.imageStore.mode) }}
{{- end }}
{{- .Values.imageStore.mode }}
{{- end }}

{{- define "stowage.imageStoreVolume" -}}
- name: images
{{- if eq .Values.imageStore.type "hostPath" }}
  hostPath:
    path: {{ .Values.imageStore.path }}
    type: {{ .Values.imageStore.hostPathType | default (ternary "DirectoryOrCreate" "Directory" (eq .Values.imageStore.mode "local")) }}
{{- else if eq .Values.imageStore.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "imageStore.existingClaim is required when imageStore.type is pvc" .Values.imageStore.existingClaim }}
{{- include "stowage.storeClaimCheck" . }}
{{- else }}
{{- fail (printf "imageStore.type must be hostPath or pvc, not %q" .Values.imageStore.type) }}
{{- end }}
{{- end }}

{{/* The controller's metrics port: the secure one when controller.securePort is set. */}}
{{- define "stowage.controller.metricsPort" -}}
{{- if gt (int .Values.controller.securePort) 0 }}{{ .Values.controller.securePort }}{{ else }}{{ .Values.controller.metricsPort }}{{ end }}
{{- end }}

{{/* prometheus.io/* pod annotations for annotation-based scrape discovery. */}}
{{- define "stowage.scrapeAnnotations" -}}
{{- if .root.Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- if .secure }}
prometheus.io/scheme: https
{{- end }}
{{- end }}
{{- end }}

{{/* agent.mode, checked: csi (beside a kubelet) or standalone (no kubelet). */}}
{{- define "stowage.agent.mode" -}}
{{- $a := .Values.agent }}
{{- if not (has $a.mode (list "csi" "standalone")) }}
{{- fail (printf "agent.mode must be csi (beside a kubelet) or standalone (nodes without a kubelet), not %q" (toString $a.mode)) }}
{{- end }}
{{- if and (eq $a.mode "csi") $a.registerNode }}
{{- fail "agent.registerNode is for nodes without a kubelet: it needs agent.mode=standalone (in csi mode the kubelet keeps the Node)" }}
{{- end }}
{{- $a.mode }}
{{- end }}

{{/* Pod-level host networking of a workload: call with its values (controller or agent). */}}
{{- define "stowage.hostNetwork" -}}
{{- if .hostNetwork }}
hostNetwork: true
# Cluster DNS names still resolve from the host's network namespace.
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
{{- end }}

{{/* KUBERNETES_SERVICE_HOST/PORT from apiServer, for both containers' in-cluster config. */}}
{{- define "stowage.apiServerEnv" -}}
{{- $s := .Values.apiServer }}
{{- if or $s.host $s.port }}
{{- if not (and $s.host $s.port) }}
{{- fail "apiServer.host and apiServer.port go together: set both, or neither for the in-cluster default" }}
{{- end }}
# In-cluster config reads these; they replace the kubernetes Service's address.
- name: KUBERNETES_SERVICE_HOST
  value: {{ $s.host | toString | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ $s.port | toString | quote }}
{{- end }}
{{- end }}

{{/*
What to append to kube-controller-manager's --controllers value so that it turns off what this
release's controller runs (controller.controllers in stowage's names or KCM's), so the two never
both run one: ",-a,-b". Appended, never a value of its own: the flag replaces the distribution's
value, whose opt-in controllers (kubeadm's bootstrapsigner, tokencleaner) must stay. The
name tables repeat stowage-controller's (crates/controller/src/lib.rs); the chart tests render
this for every name and compare it with the binary's own answer. An unknown name fails here too,
for installs that skip values.schema.json.
*/}}
{{- define "stowage.kcmFlag" -}}
{{- $kcm := dict "binder" "persistentvolume-binder-controller" "pv-protection" "persistentvolume-protection-controller" "pvc-protection" "persistentvolumeclaim-protection-controller" "attachdetach" "persistentvolume-attach-detach-controller" "expand" "persistentvolume-expander-controller" -}}
{{- $alias := dict "persistentvolume-binder-controller" "binder" "persistentvolume-binder" "binder" "persistentvolume-protection-controller" "pv-protection" "persistentvolumeclaim-protection-controller" "pvc-protection" "persistentvolume-attach-detach-controller" "attachdetach" "persistentvolume-expander-controller" "expand" "persistentvolume-expander" "expand" -}}
{{- $on := list -}}
{{- $off := list -}}
{{- range .Values.controller.controllers -}}
{{- $item := trim . -}}
{{- if eq $item "*" -}}
{{- $on = concat $on (list "binder" "pv-protection" "pvc-protection" "attachdetach" "expand") -}}
{{- else -}}
{{- $n := trimPrefix "-" $item -}}
{{- $name := get $alias $n | default $n -}}
{{- if not (hasKey $kcm $name) -}}
{{- fail (printf "controller.controllers: unknown controller %q (known: binder, pv-protection, pvc-protection, attachdetach, expand, or kube-controller-manager's names for them)" $n) -}}
{{- end -}}
{{- if hasPrefix "-" $item -}}
{{- $off = append $off $name -}}
{{- else -}}
{{- $on = append $on $name -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range list "binder" "pv-protection" "pvc-protection" "attachdetach" "expand" -}}
{{- if and (has . $on) (not (has . $off)) -}},-{{ get $kcm . }}{{- end -}}
{{- end -}}
{{- end }}

{{/*
The agent is privileged: a namespace that enforces another Pod Security level refuses its pods
(the DaemonSet shows FailedCreate) while the install itself succeeds. Read from the namespace's
label at install and upgrade; `helm template` sees no cluster and skips it.
*/}}
{{- define "stowage.podSecurityCheck" -}}
{{- if .Values.podSecurity.check }}
{{- $ns := lookup "v1" "Namespace" "" .Release.Namespace | default dict }}
{{- $level := dig "metadata" "labels" "pod-security.kubernetes.io/enforce" "" $ns }}
{{- if and $level (ne $level "privileged") }}
{{- fail (printf "namespace %s enforces Pod Security level %q, but the stowage agent is privileged (host /dev, loop devices, mount propagation): its pods would be refused (DaemonSet events FailedCreate) while the install reports success. Label the namespace first: kubectl label namespace %s pod-security.kubernetes.io/enforce=privileged --overwrite (or install into a namespace that allows privileged pods; podSecurity.check=false skips this check)" .Release.Namespace $level .Release.Namespace) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A store on a claim: stowage's controller and agents mount it, so nothing of stowage's can bind it
or attach its volume (those controllers run in the pod that waits for it). A claim that is not
Bound, or whose volume needs attaching, would leave the install waiting for ever; refuse it with
the order that works. Read at install and upgrade; a claim not found (or `helm template`) is left
to the pods' own events.
*/}}
{{- define "stowage.storeClaimCheck" -}}
{{- if .Values.imageStore.checkClaim }}
{{- $name := .Values.imageStore.existingClaim }}
{{- $claim := lookup "v1" "PersistentVolumeClaim" .Release.Namespace $name | default dict }}
{{- if $claim }}
{{- $phase := dig "status" "phase" "Pending" $claim }}
{{- if ne $phase "Bound" }}
{{- fail (printf "imageStore.existingClaim %s/%s is %s, not Bound: stowage's controller and agents mount it, and stowage's own binder runs in the controller that would wait for it, so nothing would ever bind it. Bind it first, while kube-controller-manager's binder still runs, then turn kube-controller-manager's storage controllers off and install (docs/distributions.md, \"Order\"); imageStore.checkClaim=false skips this check" .Release.Namespace $name $phase) }}
{{- end }}
{{- $pvName := dig "spec" "volumeName" "" $claim }}
{{- $pv := lookup "v1" "PersistentVolume" "" $pvName | default dict }}
{{- $spec := dig "spec" dict $pv }}
{{- $attach := "" }}
{{- if hasKey $spec "csi" }}
{{- $driver := $spec.csi.driver }}
{{- $obj := lookup "storage.k8s.io/v1" "CSIDriver" "" $driver | default dict }}
{{- if dig "spec" "attachRequired" true $obj }}
{{- $attach = printf "CSI driver %s requires attach (its CSIDriver says attachRequired: true, or there is none)" $driver }}
{{- end }}
{{- else if $spec }}
{{- $attachable := list "awsElasticBlockStore" "gcePersistentDisk" "azureDisk" "cinder" "vsphereVolume" "portworxVolume" "iscsi" "rbd" "fc" "flexVolume" "photonPersistentDisk" "scaleIO" "storageos" }}
{{- range $attachable }}
{{- if hasKey $spec . }}
{{- $attach = printf "its %s source is attached to a node by the attach/detach controller" . }}
{{- end }}
{{- end }}
{{- end }}
{{- if $attach }}
{{- fail (printf "imageStore.existingClaim %s/%s is bound to volume %s, and %s: stowage's attach/detach controller runs in the controller pod that waits for this volume, so it would never be attached. Use a volume that needs no attach (NFS, CephFS, or a CSI driver with attachRequired: false); imageStore.checkClaim=false skips this check" .Release.Namespace $name $pvName $attach) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
