{{/*
The alert rules, with the thresholds of .Values.alerts: the one source of both the chart's
PrometheusRule and deploy/prometheus/alerts.yaml (scripts/render_alerts.py renders it with the
default values; tests/deploy/test_alerts.py checks that the two agree).
Every metric named here is exported by tpserve's /metrics (cluster/metrics.py).
*/}}
{{- define "tpserve.alertGroups" -}}
groups:
  - name: tpserve
    rules:
      - alert: TPServeCollectiveErrors
        # A collective (all-reduce, gather, step-plan broadcast) raised: a rank died or a link
        # failed. The group's engine is dead; Serve replaces it.
        expr: sum by (model_name, group) (increase(tpserve:collective_errors_total[5m])) > 0
        labels:
          severity: critical
        annotations:
          summary: {{ `TP group {{ $labels.group }}: {{ $value }} collective errors in 5 minutes` | quote }}
          description: A collective of the group failed (a peer died, NCCL or gloo timed out). Check the group's ranks and the links between their GPUs and nodes.
      - alert: TPServeAllReduceSlow
        expr: histogram_quantile(0.99, sum by (model_name, group, le) (rate(tpserve:allreduce_latency_seconds_bucket[5m]))) > {{ .allReduceP99Seconds }}
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: {{ `TP group {{ $labels.group }}: all-reduce p99 {{ $value | humanizeDuration }}` | quote }}
          description: {{ printf "All-reduce p99 above %vs for 5 minutes: a slow link (NVLink degraded to PCIe, IB down to TCP) or a straggling rank." .allReduceP99Seconds | quote }}
      - alert: TPServeKVCacheFull
        expr: max by (model_name, group) (tpserve:kv_cache_usage_perc) > {{ .kvUsage }}
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: {{ `TP group {{ $labels.group }}: KV cache {{ $value | humanizePercentage }} used` | quote }}
          description: {{ printf "KV cache usage above %v for 5 minutes: requests wait or are preempted. Raise serve.groups.max, or check that the autoscaler can add GPU workers." .kvUsage | quote }}
      - alert: TPServeKVTierChecksumFailures
        # Any block whose checksum did not match on its way back up (dropped and recomputed).
        expr: sum by (model_name, group) (increase(tpserve:kv_tier_checksum_failures_total[10m])) > 0
        labels:
          severity: critical
        annotations:
          summary: {{ `TP group {{ $labels.group }}: KV-tier checksum failures` | quote }}
          description: Blocks read back from host memory or disk did not match their checksum. They were recomputed, never served; check the node's memory (ECC) and the KV disk.
      - alert: TPServeKVTierIOErrors
        expr: sum by (model_name, group) (increase(tpserve:kv_tier_io_errors_total[10m])) > 0
        labels:
          severity: warning
        annotations:
          summary: {{ `TP group {{ $labels.group }}: KV-tier I/O errors` | quote }}
          description: Reads or writes of the disk KV tier failed. The blocks are recomputed; check the KV volume (full, failing, remounted read-only).
      - alert: TPServeTTFTHigh
        expr: histogram_quantile(0.99, sum by (model_name, le) (rate(tpserve:time_to_first_token_seconds_bucket[5m]))) > {{ .ttftP99Seconds }}
        for: 10m
        labels:
          severity: warning
        annotations:
          summary: {{ `{{ $labels.model_name }}: TTFT p99 {{ $value | humanizeDuration }}` | quote }}
          description: {{ printf "Time to first token p99 above %vs for 10 minutes." .ttftP99Seconds | quote }}
      - alert: TPServeGroupRestarting
        # A group's engine died or its replica vanished: Serve restarts the group's replica.
        expr: sum by (model_name, cause) (increase(tpserve:group_failures_total[15m])) > 0
        labels:
          severity: warning
        annotations:
          summary: {{ `{{ $labels.model_name }}: a TP group restarted ({{ $labels.cause }})` | quote }}
          description: A TP group replica failed and Serve replaced it. Repeated restarts point at a bad GPU, node or checkpoint; see the replica logs.
{{- end -}}
