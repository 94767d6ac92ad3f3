{{/* Names and labels, as in KubeRay's ray-cluster chart. */}}
{{- define "tpserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tpserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tpserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tpserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tpserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tpserve.labels" -}}
{{ include "tpserve.selectorLabels" . }}
helm.sh/chart: {{ include "tpserve.chart" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The API key's Secret: an existing one, the chart's own, or none (""). */}}
{{- define "tpserve.apiKeySecret" -}}
{{- if .Values.serve.apiKey.existingSecret -}}
{{- .Values.serve.apiKey.existingSecret -}}
{{- else if .Values.serve.apiKey.create -}}
{{- printf "%s-api-key" (include "tpserve.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/*
A worker group's shape from the TP size: GPUs per pod, pods per group (numOfHosts) and the pod
counts for a number of TP groups. Takes (dict "gpusPerPod" G "tp" T "minGroups" A "maxGroups" B
"where" "values path"); returns YAML: gpus, hosts, minReplicas, maxReplicas.
*/}}
{{- define "tpserve.groupShape" -}}
{{- $tp := int .tp -}}
{{- $gpus := $tp -}}
{{- if not (kindIs "invalid" .gpusPerPod) }}{{ $gpus = int .gpusPerPod }}{{ end -}}
{{- if ge $gpus $tp -}}
{{- if ne (mod $gpus $tp) 0 -}}
{{- fail (printf "%s.gpusPerPod (%d) must be a multiple or a divisor of serve.tpSize (%d)" .where $gpus $tp) -}}
{{- end -}}
{{- $perPod := div $gpus $tp -}}
gpus: {{ $gpus }}
hosts: 1
minReplicas: {{ div (add (int .minGroups) (sub $perPod 1)) $perPod }}
maxReplicas: {{ div (add (int .maxGroups) (sub $perPod 1)) $perPod }}
{{- else -}}
{{- if ne (mod $tp $gpus) 0 -}}
{{- fail (printf "%s.gpusPerPod (%d) must be a multiple or a divisor of serve.tpSize (%d)" .where $gpus $tp) -}}
{{- end -}}
gpus: {{ $gpus }}
hosts: {{ div $tp $gpus }}
minReplicas: {{ int .minGroups }}
maxReplicas: {{ int .maxGroups }}
{{- end -}}
{{- end -}}

{{/* Checks the values that values.schema.json cannot: each failure names the value. */}}
{{- define "tpserve.validate" -}}
{{- $groups := .Values.serve.groups -}}
{{- if gt (int $groups.min) (int $groups.max) -}}
{{- fail (printf "serve.groups.min (%d) must not exceed serve.groups.max (%d)" (int $groups.min) (int $groups.max)) -}}
{{- end -}}
{{- if and (not .Values.autoscaling.enabled) (ne (int $groups.min) (int $groups.max)) -}}
{{- fail (printf "serve.groups.min (%d) and serve.groups.max (%d) differ: set autoscaling.enabled=true, or make them equal" (int $groups.min) (int $groups.max)) -}}
{{- end -}}
{{- $model := .Values.serve.model -}}
{{- if not (hasPrefix (printf "%s/" (trimSuffix "/" $model.mountPath)) $model.path) -}}
{{- fail (printf "serve.model.path (%s) must lie under serve.model.mountPath (%s)" $model.path $model.mountPath) -}}
{{- end -}}
{{- if and (eq $model.source "pvc") (not $model.pvc.claimName) -}}
{{- fail "serve.model.pvc.claimName must be set when serve.model.source is pvc" -}}
{{- end -}}
{{- if and (eq $model.source "hostPath") (not $model.hostPath.path) -}}
{{- fail "serve.model.hostPath.path must be set when serve.model.source is hostPath" -}}
{{- end -}}
{{- if and .Values.serve.tiers.disk.enabled (le (float64 .Values.serve.tiers.host.gb) 0.0) -}}
{{- fail "serve.tiers.disk.enabled needs a host tier: set serve.tiers.host.gb above 0 (disk blocks come back through host memory)" -}}
{{- end -}}
{{- $disk := .Values.serve.tiers.disk -}}
{{- if and $disk.enabled (eq $disk.volume "pvc") (not $disk.pvc.claimName) -}}
{{- fail "serve.tiers.disk.pvc.claimName must be set when serve.tiers.disk.volume is pvc" -}}
{{- end -}}
{{- range $key := list "model" "served_model_name" "tp" "groups" "kv_target_occupancy" "device" "kv_cache_gb" "max_model_len" "host_kv_gb" "disk_kv_dir" "disk_kv_gb" "kv_eviction" "kv_write_policy" "api_key_env" "api_key" -}}
{{- if hasKey $.Values.serve.extraArgs $key -}}
{{- fail (printf "serve.extraArgs.%s is set by the chart from other values (see values.yaml); remove it" $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
