{{/* Pieces shared by the head's and the workers' pods. */}}

{{/* Environment of every Ray container: the API key, read where Serve builds the app. */}}
{{- define "tpserve.env" -}}
{{- $root := .root -}}
{{- $secret := include "tpserve.apiKeySecret" $root -}}
{{- if $secret }}
- name: TPSERVE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ $root.Values.serve.apiKey.secretKey }}
{{- end }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end -}}

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

{{- define "tpserve.initContainers" -}}
{{- $model := .Values.serve.model -}}
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
{{- end -}}

{{/* Volumes of a pod: model, /dev/shm, Ray's logs, the disk KV tier (workers), the user's. */}}
{{- define "tpserve.volumes" -}}
{{- $root := .root -}}
{{ include "tpserve.modelVolume" $root }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
- name: ray-logs
  emptyDir: {}
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
{{- if and .isWorker $root.Values.serve.tiers.disk.enabled }}
- name: kv-disk
  mountPath: {{ $root.Values.serve.tiers.disk.path }}
{{- end }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
Workers: started once their raylet is healthy (the dashboard agent's local_raylet_healthz, as
KubeRay's own probes check), within startupMinutes; ready, and in the Serve Service, once
tpserve's /health answers 200 through the pod's Serve proxy (a TP group serves). Serve runs a
proxy only on nodes hosting a replica: a pod holding ranks alone (a multi-host group's second
pod) is never ready and never restarted for it. Head: ready once Ray's GCS is (it serves no
model).
*/}}
{{- define "tpserve.workerProbes" -}}
{{- $p := .Values.probes -}}
{{- $raylet := list "sh" "-c" "wget -q -T 5 -O- http://127.0.0.1:52365/api/local_raylet_healthz | grep -q success" -}}
startupProbe:
  exec:
    command: {{ toJson $raylet }}
  periodSeconds: {{ int $p.periodSeconds }}
  failureThreshold: {{ div (mul (int $p.startupMinutes) 60) (int $p.periodSeconds) }}
readinessProbe:
  httpGet:
    path: /health
    port: serve
  periodSeconds: {{ int $p.periodSeconds }}
  failureThreshold: {{ int $p.readinessFailureThreshold }}
{{- end -}}

{{- define "tpserve.headProbes" -}}
{{- $p := .Values.probes }}
{{- $gcs := list "sh" "-c" "wget -q -T 5 -O- http://127.0.0.1:8265/api/gcs_healthz | grep -q success" -}}
startupProbe:
  exec:
    command: {{ toJson $gcs }}
  periodSeconds: {{ int $p.periodSeconds }}
  failureThreshold: {{ div 300 (int $p.periodSeconds) }}
readinessProbe:
  exec:
    command: {{ toJson $gcs }}
  periodSeconds: {{ int $p.periodSeconds }}
  failureThreshold: {{ int $p.readinessFailureThreshold }}
{{- end -}}

{{/* One KubeRay workerGroupSpec: (dict "root" $ "name" N "group" VALUES "shape" SHAPE "replicas" R). */}}
{{- define "tpserve.workerGroup" -}}
{{- $root := .root -}}
{{- $group := .group -}}
{{- $resources := deepCopy (default dict $group.resources) -}}
{{- $limits := default dict $resources.limits -}}
{{- $requests := default dict $resources.requests -}}
{{- $_ := set $limits "nvidia.com/gpu" (int .shape.gpus) -}}
{{- $_ := set $requests "nvidia.com/gpu" (int .shape.gpus) -}}
{{- $_ := set $resources "limits" $limits -}}
{{- $_ := set $resources "requests" $requests -}}
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
    metadata:
      labels:
        {{- include "tpserve.selectorLabels" $root | nindent 8 }}
        {{- with $group.labels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $group.annotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- with (include "tpserve.initContainers" $root | trim) }}
      initContainers:
        {{- . | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: "{{ $root.Values.image.repository }}:{{ $root.Values.image.tag }}"
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          {{- with (include "tpserve.env" (dict "root" $root "extra" $group.containerEnv) | trim) }}
          env:
            {{- . | nindent 12 }}
          {{- end }}
          {{- with $group.envFrom }}
          envFrom:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          ports:
            - {name: serve, containerPort: 8000, protocol: TCP}
            - {name: serve-grpc, containerPort: 9000, protocol: TCP}
            - {name: metrics, containerPort: 8080, protocol: TCP}
          resources:
            {{- toYaml $resources | nindent 12 }}
          {{- include "tpserve.workerProbes" $root | nindent 10 }}
          volumeMounts:
            {{- include "tpserve.volumeMounts" (dict "root" $root "isWorker" true "extra" $group.volumeMounts) | nindent 12 }}
      volumes:
        {{- include "tpserve.volumes" (dict "root" $root "isWorker" true "shmSize" $group.shmSize "extra" $group.volumes) | nindent 8 }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $group.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $group.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $group.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}
