{{/*
The alert rules, with the thresholds of .alerts (the chart's .Values.alerts) and the scrape job
of tpserve's /metrics (.job: the PodMonitor's, the chart's full name): the one source of both the
chart's PrometheusRule and deploy/prometheus/alerts.yaml (scripts/render_alerts.py renders it
with the default values for a release named tpserve, the job name of
deploy/prometheus/prometheus.yml; tests/deploy/test_alerts.py checks that the two agree, and
tests/deploy/test_alert_rules.py runs promtool's unit tests, deploy/prometheus/tests/, on them).
Every metric named here is exported by tpserve's /metrics (cluster/metrics.py).
*/}}
{{- define "tpserve.alertGroups" -}}
groups:
  - name: tpserve
    rules:
      - alert: TPServeDown
        # tpserve's own /metrics is not scraped: every other rule here goes silent with it.
        expr: absent(up{job={{ .job | quote }}} == 1)
        for: 2m
        labels:
          severity: critical
        annotations:
          summary: {{ printf "tpserve (job %s) is down or not scraped" .job | quote }}
          description: Prometheus has had no successful scrape of tpserve's /metrics for 2 minutes. The head pod, its Serve proxy or the ingress is down, or the scrape config lost it; no other tpserve alert can fire meanwhile.
      - alert: TPServeCollectiveErrors
        # A collective (all-reduce, gather, step-plan broadcast) failed on any rank: it raised,
        # timed out, or the step watchdog declared it hung. The group's engine is dead; Serve
        # replaces it.
        expr: sum by (model_name, group, kind) (increase(tpserve:collective_errors_total[5m])) > 0
        labels:
          severity: critical
        annotations:
          summary: {{ `TP group {{ $labels.group }}: {{ $value }} collective failures ({{ $labels.kind }}) in 5 minutes` | quote }}
          description: A collective of the group failed (error a peer died or NCCL failed, timeout NCCL or gloo gave up waiting, hang a rank stopped answering). Check the group's ranks and the links between their GPUs and nodes.
      - alert: TPServeAllReduceSlow
        expr: histogram_quantile(0.99, sum by (model_name, group, le) (rate(tpserve:allreduce_latency_seconds_bucket[5m]))) > {{ .alerts.allReduceP99Seconds }}
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: {{ `TP group {{ $labels.group }}: all-reduce p99 {{ $value | humanizeDuration }}` | quote }}
          description: {{ printf "All-reduce p99 above %vs for 5 minutes: a slow link (NVLink degraded to PCIe, IB down to TCP) or a straggling rank." .alerts.allReduceP99Seconds | quote }}
      - alert: TPServeKVCacheFull
        expr: max by (model_name, group) (tpserve:kv_cache_usage_perc) > {{ .alerts.kvUsage }}
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: {{ `TP group {{ $labels.group }}: KV cache {{ $value | humanizePercentage }} used` | quote }}
          description: {{ printf "KV cache usage above %v for 5 minutes: requests wait or are preempted. Raise serve.groups.max, or check that the autoscaler can add GPU workers." .alerts.kvUsage | quote }}
      - alert: TPServeGPUMemoryHigh
        expr: max by (model_name, group, rank) (tpserve:gpu_memory_used_bytes / tpserve:gpu_memory_total_bytes) > {{ .alerts.gpuMemory }}
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: {{ `TP group {{ $labels.group }} rank {{ $labels.rank }}: GPU memory {{ $value | humanizePercentage }} used` | quote }}
          description: {{ printf "GPU memory in use above %v of the device for 5 minutes: the next large step or graph capture may run out. With --gpu-memory-utilization above this fraction the KV pool alone passes it: set alerts.gpuMemory above that fraction." .alerts.gpuMemory | quote }}
      - alert: TPServeKVHostTierFull
        expr: max by (model_name, group) (tpserve:kv_tier_host_blocks_used / tpserve:kv_tier_host_blocks_total) > {{ .alerts.kvTierFill }}
        for: 15m
        labels:
          severity: warning
        annotations:
          summary: {{ `TP group {{ $labels.group }}: host KV tier {{ $value | humanizePercentage }} full` | quote }}
          description: {{ printf "The host-memory KV tier held above %v of its blocks for 15 minutes: it evicts (to disk, or away) what it would keep with more room. Raise --host-kv-gb if the hit rate suffers." .alerts.kvTierFill | quote }}
      - alert: TPServeKVDiskTierFull
        expr: max by (model_name, group) (tpserve:kv_tier_disk_blocks_used / tpserve:kv_tier_disk_blocks_total) > {{ .alerts.kvTierFill }}
        for: 15m
        labels:
          severity: warning
        annotations:
          summary: {{ `TP group {{ $labels.group }}: disk KV tier {{ $value | humanizePercentage }} full` | quote }}
          description: {{ printf "The disk KV tier held above %v of its blocks for 15 minutes: it evicts what it would keep with more room. Raise --disk-kv-gb if the hit rate suffers." .alerts.kvTierFill | quote }}
      - alert: TPServeIngressNearLimit
        expr: max by (model_name) (tpserve:ingress_requests_in_flight / tpserve:ingress_max_requests_in_flight) > {{ .alerts.ingressInFlight }}
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: {{ `{{ $labels.model_name }}: {{ $value | humanizePercentage }} of the ingress's request limit in flight` | quote }}
          description: {{ printf "Generation requests in flight above %v of the ingress's limit for 5 minutes; past the limit requests get 429. Add TP groups (serve.groups.max) or raise the limit." .alerts.ingressInFlight | quote }}
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
        expr: histogram_quantile(0.99, sum by (model_name, le) (rate(tpserve:time_to_first_token_seconds_bucket[5m]))) > {{ .alerts.ttftP99Seconds }}
        for: 10m
        labels:
          severity: warning
        annotations:
          summary: {{ `{{ $labels.model_name }}: TTFT p99 {{ $value | humanizeDuration }}` | quote }}
          description: {{ printf "Time to first token p99 above %vs for 10 minutes." .alerts.ttftP99Seconds | quote }}
      - alert: TPServeGroupRestarting
        # A group's engine died or its replica vanished: Serve restarts the group's replica.
        expr: sum by (model_name, cause) (increase(tpserve:group_failures_total[15m])) > 0
        labels:
          severity: warning
        annotations:
          summary: {{ `{{ $labels.model_name }}: a TP group restarted ({{ $labels.cause }})` | quote }}
          description: A TP group replica failed and Serve replaced it. Repeated restarts point at a bad GPU, node or checkpoint; see the replica logs.
{{- end -}}
