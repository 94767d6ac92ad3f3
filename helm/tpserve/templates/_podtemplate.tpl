{{/* Ray pod templates and worker groups, from the pod settings of values.yaml's head/worker. */}}

{{/*
One Ray pod template: (dict "root" $ "group" VALUES "isWorker" BOOL "ports" LIST "resources" MAP).
The Ray container comes first (KubeRay's rule), then the group's sidecarContainers; the pod-spec
fields of the group pass through as given (KubeRay's ray-cluster chart spells them so).
*/}}
{{- define "tpserve.podTemplate" -}}
{{- $root := .root -}}
{{- $group := .group -}}
metadata:
  labels:
    {{- include "tpserve.selectorLabels" $root | nindent 4 }}
    {{- with $group.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $group.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- with (include "tpserve.initContainers" (dict "root" $root "extra" $group.initContainers) | trim) }}
  initContainers:
    {{- . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ ternary "ray-worker" "ray-head" .isWorker }}
      image: {{ include "tpserve.image" $root | quote }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      {{- with $group.containerEnv }}
      env:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $group.envFrom }}
      envFrom:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      ports:
        {{- toYaml .ports | nindent 8 }}
      resources:
        {{- toYaml .resources | nindent 8 }}
      {{- include "tpserve.probes" (dict "root" $root "group" $group "isWorker" .isWorker) | nindent 6 }}
      {{- with $group.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        {{- include "tpserve.volumeMounts" (dict "root" $root "isWorker" .isWorker "extra" $group.volumeMounts) | nindent 8 }}
    {{- with $group.sidecarContainers }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  volumes:
    {{- include "tpserve.volumes" (dict "root" $root "isWorker" .isWorker "shmSize" $group.shmSize "extra" $group.volumes) | nindent 4 }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- range $field := list "serviceAccountName" "priorityClassName" "runtimeClassName" "schedulerName" }}
  {{- with get $group $field }}
  {{ $field }}: {{ . | quote }}
  {{- end }}
  {{- end }}
  {{- range $field := list "nodeSelector" "tolerations" "affinity" "topologySpreadConstraints" }}
  {{- with get $group $field }}
  {{ $field }}:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- end }}
{{- end -}}

{{/* One KubeRay workerGroupSpec: (dict "root" $ "name" N "group" VALUES "shape" SHAPE "replicas" R). */}}
{{- define "tpserve.workerGroup" -}}
{{- $group := .group -}}
{{- $resources := deepCopy (default dict $group.resources) -}}
{{- $limits := default dict $resources.limits -}}
{{- $requests := default dict $resources.requests -}}
{{- $_ := set $limits "nvidia.com/gpu" (int .shape.gpus) -}}
{{- $_ := set $requests "nvidia.com/gpu" (int .shape.gpus) -}}
{{- $_ := set $resources "limits" $limits -}}
{{- $_ := set $resources "requests" $requests -}}
{{- $ports := list (dict "name" "serve" "containerPort" 8000 "protocol" "TCP") (dict "name" "serve-grpc" "containerPort" 9000 "protocol" "TCP") (dict "name" "metrics" "containerPort" 8080 "protocol" "TCP") -}}
- groupName: {{ .name }}
  replicas: {{ int .replicas }}
  minReplicas: {{ int .shape.minReplicas }}
  maxReplicas: {{ int .shape.maxReplicas }}
  {{- if gt (int .shape.hosts) 1 }}
  numOfHosts: {{ int .shape.hosts }}
  {{- end }}
  rayStartParams:
    {{- range $key, $val := $group.rayStartParams }}
    {{ $key }}: {{ $val | quote }}
    {{- end }}
  template:
    {{- include "tpserve.podTemplate" (dict "root" .root "group" $group "isWorker" true "ports" $ports "resources" $resources) | nindent 4 }}
{{- end -}}

{{/*
An additional worker group: (dict "root" $ "name" N "group" VALUES). Each setting it gives
replaces worker's whole value (a map or a list is not merged into worker's); the rest is
worker's. Pods: replicas (default 0) within minReplicas (default 0) and maxReplicas (default 1).
*/}}
{{- define "tpserve.extraWorkerGroup" -}}
{{- $root := .root -}}
{{- $group := .group -}}
{{- $where := printf "additionalWorkerGroups.%s" .name -}}
{{- $merged := deepCopy (omit $root.Values.worker "groupName" "gpusPerPod") -}}
{{- range $key, $val := omit $group "disabled" "replicas" "minReplicas" "maxReplicas" "gpusPerPod" -}}
{{- $_ := set $merged $key $val -}}
{{- end -}}
{{- $shape := include "tpserve.groupShape" (dict "gpusPerPod" $group.gpusPerPod "tp" $root.Values.serve.tpSize "minGroups" 0 "maxGroups" 0 "where" $where) | fromYaml -}}
{{- $min := ternary $group.minReplicas 0 (hasKey $group "minReplicas") | int -}}
{{- $max := ternary $group.maxReplicas 1 (hasKey $group "maxReplicas") | int -}}
{{- $replicas := ternary $group.replicas 0 (hasKey $group "replicas") | int -}}
{{- if gt $min $max -}}
{{- fail (printf "%s.minReplicas (%d) must not exceed %s.maxReplicas (%d)" $where $min $where $max) -}}
{{- end -}}
{{- if or (lt $replicas $min) (gt $replicas $max) -}}
{{- fail (printf "%s.replicas (%d) must lie within minReplicas (%d) and maxReplicas (%d)" $where $replicas $min $max) -}}
{{- end -}}
{{- $_ := set $shape "minReplicas" $min -}}
{{- $_ := set $shape "maxReplicas" $max -}}
{{- include "tpserve.workerGroup" (dict "root" $root "name" .name "group" $merged "shape" $shape "replicas" $replicas) -}}
{{- end -}}
