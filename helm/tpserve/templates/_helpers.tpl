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

{{- define "tpserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (toString (default .Chart.AppVersion .Values.image.tag)) -}}
{{- end -}}

{{/* The API key's Secret: the user's, or "<fullname>-api-key"; "" without a key. */}}
{{- define "tpserve.apiKeySecret" -}}
{{- if .Values.serve.apiKey.enabled -}}
{{- default (printf "%s-api-key" (include "tpserve.fullname" .)) .Values.serve.apiKey.existingSecret -}}
{{- end -}}
{{- end -}}

{{/* Where the pods read the API key: a file of the mounted Secret (one key per line). */}}
{{- define "tpserve.apiKeyDir" -}}/etc/tpserve/api-key{{- end -}}
{{- define "tpserve.apiKeyFile" -}}{{ include "tpserve.apiKeyDir" . }}/key{{- end -}}

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
{{- range $key := list "model" "served_model_name" "tp" "groups" "kv_target_occupancy" "device" "kv_cache_gb" "max_model_len" "host_kv_gb" "disk_kv_dir" "disk_kv_gb" "kv_eviction" "kv_write_policy" "api_key_env" "api_key_file" "api_key" -}}
{{- if hasKey $.Values.serve.extraArgs $key -}}
{{- fail (printf "serve.extraArgs.%s is set by the chart from other values (see values.yaml); remove it" $key) -}}
{{- end -}}
{{- end -}}
{{- include "tpserve.validateKey" . -}}
{{- include "tpserve.validateCluster" . -}}
{{- end -}}

{{- define "tpserve.validateKey" -}}
{{- $key := .Values.serve.apiKey -}}
{{- if and (not $key.enabled) (or $key.existingSecret $key.value) -}}
{{- fail "serve.apiKey.existingSecret or serve.apiKey.value is set but serve.apiKey.enabled is false: remove it, or enable the key" -}}
{{- end -}}
{{- if and $key.existingSecret $key.value -}}
{{- fail (printf "serve.apiKey.existingSecret (%s) and serve.apiKey.value are both set: give one (the chart makes a Secret only from value)" $key.existingSecret) -}}
{{- end -}}
{{- end -}}

{{/* The RayService-level settings KubeRay would refuse, or accept and ignore. */}}
{{- define "tpserve.validateCluster" -}}
{{- $upgrade := .Values.upgradeStrategy -}}
{{- if eq $upgrade.type "NewClusterWithIncrementalUpgrade" -}}
{{- if not .Values.autoscaling.enabled -}}
{{- fail "upgradeStrategy.type NewClusterWithIncrementalUpgrade needs autoscaling.enabled=true (KubeRay refuses it without the autoscaler)" -}}
{{- end -}}
{{- range $field := list "gatewayClassName" "stepSizePercent" "intervalSeconds" -}}
{{- if not (hasKey $upgrade.clusterUpgradeOptions $field) -}}
{{- fail (printf "upgradeStrategy.clusterUpgradeOptions.%s must be set when upgradeStrategy.type is NewClusterWithIncrementalUpgrade" $field) -}}
{{- end -}}
{{- end -}}
{{- if gt (int $upgrade.clusterUpgradeOptions.stepSizePercent) (int (default 100 $upgrade.clusterUpgradeOptions.maxSurgePercent)) -}}
{{- fail (printf "upgradeStrategy.clusterUpgradeOptions.stepSizePercent (%d) must not exceed maxSurgePercent (%d)" (int $upgrade.clusterUpgradeOptions.stepSizePercent) (int (default 100 $upgrade.clusterUpgradeOptions.maxSurgePercent))) -}}
{{- end -}}
{{- else if $upgrade.clusterUpgradeOptions -}}
{{- fail (printf "upgradeStrategy.clusterUpgradeOptions is used only by NewClusterWithIncrementalUpgrade, not %s: remove it" $upgrade.type) -}}
{{- end -}}
{{- $ft := .Values.gcsFaultTolerance -}}
{{- if and $ft.enabled (not $ft.redisAddress) -}}
{{- fail "gcsFaultTolerance.enabled needs gcsFaultTolerance.redisAddress (host:port of the Redis)" -}}
{{- end -}}
{{- if and $ft.enabled (hasKey .Values.head.rayStartParams "redis-password") -}}
{{- fail "head.rayStartParams.redis-password: KubeRay refuses it with GCS fault tolerance; use gcsFaultTolerance.redisPassword" -}}
{{- end -}}
{{- if and .Values.networkPolicy.enabled (not .Values.networkPolicy.dashboardFrom) -}}
{{- fail "networkPolicy.dashboardFrom is empty: the KubeRay operator polls the head's dashboard and would be shut out; keep its peer (see values.yaml)" -}}
{{- end -}}
{{- end -}}
