{{/* Pieces shared by the head's and the workers' pods. */}}

{{/* The model's volume: a claim, a node directory, or an emptyDir an init container fills. */}}
{{- define "tpserve.modelVolume" -}}
{{- $model := .Values.serve.model -}}
- name: model
{{- if eq $model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ $model.pvc.claimName }}
    readOnly: true
{{- else if eq $model.source "hostPath" }}
  hostPath:
    path: {{ $model.hostPath.path }}
    type: Directory
{{- else }}
  emptyDir:
    sizeLimit: {{ $model.initContainer.sizeLimit }}
{{- end }}
{{- end -}}

{{/* Init containers: the model fetcher (when the model comes from one), then the group's own. */}}
{{- define "tpserve.initContainers" -}}
{{- $model := .root.Values.serve.model -}}
{{- if eq $model.source "initContainer" }}
- name: fetch-model
  image: {{ $model.initContainer.image }}
  command:
    {{- toYaml $model.initContainer.command | nindent 4 }}
  {{- with $model.initContainer.env }}
  env:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: model
      mountPath: {{ $model.mountPath }}
{{- end }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
Volumes of a pod: model, /dev/shm, Ray's logs, the API key (a Secret volume: updates reach the
mounted file, which a subPath mount would not get), the disk KV tier (workers), the group's own.
*/}}
{{- define "tpserve.volumes" -}}
{{- $root := .root -}}
{{ include "tpserve.modelVolume" $root }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
- name: ray-logs
  emptyDir: {}
{{- with include "tpserve.apiKeySecret" $root }}
- name: api-key
  secret:
    secretName: {{ . }}
    items:
      - key: {{ $root.Values.serve.apiKey.secretKey }}
        path: key
    defaultMode: 288  # 0440: root and the pod's fsGroup
{{- end }}
{{- if and .isWorker $root.Values.serve.tiers.disk.enabled }}
{{ include "tpserve.kvDiskVolume" $root.Values.serve.tiers.disk }}
{{- end }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The disk KV tier's volume, of the type serve.tiers.disk.volume names. */}}
{{- define "tpserve.kvDiskVolume" -}}
- name: kv-disk
{{- if eq .volume "emptyDir" }}
  emptyDir:
    sizeLimit: {{ .emptyDir.sizeLimit }}
{{- else if eq .volume "hostPath" }}
  hostPath:
    path: {{ .hostPath.path }}
    type: DirectoryOrCreate
{{- else if eq .volume "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .pvc.claimName }}
{{- else }}
  ephemeral:
    volumeClaimTemplate:
      spec:
        accessModes: [ReadWriteOnce]
        {{- with .ephemeral.storageClassName }}
        storageClassName: {{ . }}
        {{- end }}
        resources:
          requests:
            storage: {{ .ephemeral.size }}
{{- end }}
{{- end -}}

{{- define "tpserve.volumeMounts" -}}
{{- $root := .root -}}
- name: model
  mountPath: {{ $root.Values.serve.model.mountPath }}
  readOnly: true
- name: dshm
  mountPath: /dev/shm
- name: ray-logs
  mountPath: /tmp/ray
{{- if include "tpserve.apiKeySecret" $root }}
- name: api-key
  mountPath: {{ include "tpserve.apiKeyDir" $root }}
  readOnly: true
{{- end }}
{{- if and .isWorker $root.Values.serve.tiers.disk.enabled }}
- name: kv-disk
  mountPath: {{ $root.Values.serve.tiers.disk.path }}
{{- end }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
Probes of a Ray container: (dict "root" $ "group" VALUES "isWorker" BOOL). Set here, so KubeRay
injects none of its own (it adds probes only to a container that has none); the checks are
KubeRay's. Started and alive: the dashboard agent's /api/healthz (the raylet; on the head the GCS
too). Ready: on a worker, its own Serve proxy's /-/healthz (Serve runs a proxy only on nodes that
host a replica, so a pod holding ranks alone, a multi-host group's second pod, is never ready,
which keeps it out of the Serve Service and restarts nothing); on the head, the agent's check (the
operator itself adds the head to the Serve Service or not).
*/}}
{{- define "tpserve.probes" -}}
{{- $p := .root.Values.probes -}}
{{- $agentPort := int (default 52365 (get .group.rayStartParams "dashboard-agent-listen-port")) -}}
{{- $agent := dict "httpGet" (dict "path" "/api/healthz" "port" $agentPort) "periodSeconds" (int $p.periodSeconds) "timeoutSeconds" (int $p.timeoutSeconds) -}}
{{- $startupMinutes := ternary (int $p.startupMinutes) 5 .isWorker -}}
startupProbe:
  {{- toYaml (merge (dict "failureThreshold" (div (mul $startupMinutes 60) (int $p.periodSeconds))) $agent) | nindent 2 }}
livenessProbe:
  {{- toYaml (merge (dict "failureThreshold" (int $p.livenessFailureThreshold)) $agent) | nindent 2 }}
readinessProbe:
  {{- if .isWorker }}
  httpGet:
    path: /-/healthz
    port: serve
  periodSeconds: {{ int $p.periodSeconds }}
  timeoutSeconds: {{ int $p.timeoutSeconds }}
  failureThreshold: {{ int $p.readinessFailureThreshold }}
  {{- else }}
  {{- toYaml (merge (dict "failureThreshold" 10) $agent) | nindent 2 }}
  {{- end }}
{{- end -}}
