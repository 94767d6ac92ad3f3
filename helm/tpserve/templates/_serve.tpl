{{/*
The RayService's serveConfigV2: Ray Serve's config file format, the same application as
deploy/ray/serve.yaml (cluster.serve_config:app_builder; args are `tpserve serve` options).
*/}}
{{- define "tpserve.serveConfig" -}}
{{- $serve := .Values.serve -}}
proxy_location: EveryNode
http_options:
  host: 0.0.0.0
  port: 8000
grpc_options:
  port: 9000
  # The gRPC API (cluster/proto/tpserve/v1/tpserve.proto), served by the same application.
  grpc_servicer_functions:
    - cluster.proto.tpserve.v1.tpserve_pb2_grpc.add_TPServeServicer_to_server
applications:
  - name: tpserve
    route_prefix: /
    import_path: cluster.serve_config:app_builder
    args:
      model: {{ $serve.model.path | quote }}
      {{- with $serve.model.servedName }}
      served_model_name: {{ . | quote }}
      {{- end }}
      tp: {{ int $serve.tpSize }}
      groups: {{ printf "%d:%d" (int $serve.groups.min) (int $serve.groups.max) | quote }}
      kv_target_occupancy: {{ $serve.kvTargetOccupancy }}
      {{- with $serve.ingressReplicas }}
      ingress_replicas: {{ printf "%d:%d" (int .min) (int .max) | quote }}
      {{- end }}
      device: cuda
      kv_cache_gb: {{ $serve.kvCacheGb }}
      {{- with $serve.maxModelLen }}
      max_model_len: {{ int . }}
      {{- end }}
      {{- if gt (float64 $serve.tiers.host.gb) 0.0 }}
      host_kv_gb: {{ $serve.tiers.host.gb }}
      {{- end }}
      {{- if $serve.tiers.disk.enabled }}
      disk_kv_dir: {{ $serve.tiers.disk.path | quote }}
      disk_kv_gb: {{ $serve.tiers.disk.gb }}
      {{- end }}
      kv_eviction: {{ $serve.tiers.eviction | quote }}
      kv_write_policy: {{ $serve.tiers.writePolicy | quote }}
      {{- if include "tpserve.apiKeySecret" . }}
      api_key_file: {{ include "tpserve.apiKeyFile" . | quote }}
      {{- end }}
      {{- with $serve.extraArgs }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
{{- end -}}

{{/*
The RayService's serveService: KubeRay keeps its selector (the pods whose proxy is ready) and,
from KubeRay 1.6, takes these definitions of the serve and serve-grpc ports. Its type is the
Serve Service's only: the head Service (dashboard, GCS) keeps KubeRay's cluster-internal one.
*/}}
{{- define "tpserve.serveService" -}}
{{- $svc := .Values.serveService -}}
serveService:
  metadata:
    labels:
      {{- include "tpserve.labels" . | nindent 6 }}
      {{- with $svc.labels }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    {{- with $svc.annotations }}
    annotations:
      {{- toYaml . | nindent 6 }}
    {{- end }}
  spec:
    type: {{ $svc.type }}
    ports:
      - {name: serve, port: {{ int $svc.ports.http }}, targetPort: serve, protocol: TCP}
      - name: serve-grpc
        port: {{ int $svc.ports.grpc }}
        targetPort: serve-grpc
        protocol: TCP
        appProtocol: kubernetes.io/h2c
    {{- with $svc.loadBalancerSourceRanges }}
    loadBalancerSourceRanges:
      {{- toYaml . | nindent 6 }}
    {{- end }}
{{- end -}}
