{{/* Names and labels shared by every template. */}}

{{- define "hivekeeper.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's objects' name: fullnameOverride, else RELEASE-NAME (RELEASE when it holds NAME). */}}
{{- define "hivekeeper.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "hivekeeper.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "hivekeeper.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hivekeeper.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "hivekeeper.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "hivekeeper.labels" -}}
helm.sh/chart: {{ include "hivekeeper.chart" . }}
{{ include "hivekeeper.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: hivekeeper
{{- end -}}

{{/* A map as KEY=VALUE,KEY=VALUE (label keys and values hold neither "," nor "="). */}}
{{- define "hivekeeper.keyValues" -}}
{{- $pairs := list -}}
{{- range $key, $value := . -}}
{{- $pairs = append $pairs (printf "%s=%s" $key $value) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}

{{/* Where files/alerts.yaml's runbook_url annotations point: docs/metrics.md, one section per alert. */}}
{{- define "hivekeeper.runbookBaseUrl" -}}
https://github.com/hivekeeper/hivekeeper/blob/main/docs/metrics.md
{{- end -}}

{{/* The Lease the operator's replicas elect their leader with, in the release's namespace. */}}
{{- define "hivekeeper.leaseName" -}}
{{- printf "%s-leader" (include "hivekeeper.fullname" .) -}}
{{- end -}}

{{- define "hivekeeper.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "hivekeeper.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "hivekeeper.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "hivekeeper.swarmImage" -}}
{{- if .Values.swarmImage.repository -}}
{{- printf "%s:%s" .Values.swarmImage.repository (default .Chart.AppVersion .Values.swarmImage.tag) -}}
{{- else -}}
{{- include "hivekeeper.image" . -}}
{{- end -}}
{{- end -}}

{{/*
What the operator may do, and nothing more: read and annotate its own resources, write their
status, create and update the children it owns. Pods are never touched directly, and the swarm
pods themselves get no API access at all (automountServiceAccountToken: false).
*/}}
{{- define "hivekeeper.rules" -}}
- apiGroups: ["hivekeeper.dev"]
  resources: ["swarms", "blockservers", "expertpools"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["hivekeeper.dev"]
  resources: ["swarms/status", "blockservers/status", "expertpools/status"]
  verbs: ["get", "patch", "update"]
# Owner references with blockOwnerDeletion need update on the owner's finalizers.
- apiGroups: ["hivekeeper.dev"]
  resources: ["swarms/finalizers", "blockservers/finalizers", "expertpools/finalizers"]
  verbs: ["update"]
- apiGroups: [""]
  resources: ["configmaps", "secrets"]
  verbs: ["get", "create", "patch", "delete"]
# list: the owner scan finds the children of a component a resource no longer runs.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "create", "patch", "delete"]
# A finished run's final figures: the termination message of the monitor Job's pod.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list"]
# An ExpertPool's checkpoint claim is made once and never patched; the garbage collector deletes it.
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "create"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "create", "patch", "delete"]
{{- if ne .Values.swarmServiceMonitors "off" }}
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors"]
  verbs: ["get", "create", "patch", "delete"]
{{- end }}
# Events on the resources (phase changes, scaling, errors); a repeated one is patched (its count).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}
