{{/* Name of the release's objects: <release>-paramserver (or the release name if it says so). */}}
{{- define "paramserver.fullname" -}}
{{- if contains "paramserver" .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-paramserver" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "paramserver.labels" -}}
app.kubernetes.io/name: paramserver
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "paramserver.selector" -}}
app.kubernetes.io/name: paramserver
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Headless Service of the shards; pod i's stable name is <fullname>-shard-i.<this>. */}}
{{- define "paramserver.shardService" -}}
{{- printf "%s-shards" (include "paramserver.fullname" .) -}}
{{- end -}}

{{/* DNS suffix of the shards' pods: pod <name> is <name><this> (from the headless Service). */}}
{{- define "paramserver.shardDomain" -}}
{{- printf ".%s.%s.svc.%s" (include "paramserver.shardService" .) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{/* host:port of shard i (dict "root" $ "index" i). */}}
{{- define "paramserver.podAddress" -}}
{{- $root := .root -}}
{{- printf "%s-shard-%d.%s.%s.svc.%s:%d" (include "paramserver.fullname" $root) (int .index) (include "paramserver.shardService" $root) $root.Release.Namespace $root.Values.clusterDomain (int $root.Values.shards.port) -}}
{{- end -}}

{{/* Shard .index's address: its pod, or with replicas every replica's pod joined by "|"
     (pod n is replica n % R of shard n / R); clients reach the primary. */}}
{{- define "paramserver.shardAddress" -}}
{{- $root := .root -}}
{{- $r := int $root.Values.shards.replication.replicasPerShard -}}
{{- $out := list -}}
{{- range $k := until $r -}}
{{- $out = append $out (include "paramserver.podAddress" (dict "root" $root "index" (add (mul (int $.index) $r) $k))) -}}
{{- end -}}
{{- join "|" $out -}}
{{- end -}}

{{/* Every shard's address in shard order, comma-separated (--shard-addresses). */}}
{{- define "paramserver.shardAddresses" -}}
{{- $root := . -}}
{{- $out := list -}}
{{- range $i := until (int .Values.shards.replicas) -}}
{{- $out = append $out (include "paramserver.shardAddress" (dict "root" $root "index" $i)) -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}

{{/* Server-side TLS / token flags. */}}
{{- define "paramserver.serverSecurityArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-cert=/etc/paramserver/tls/tls.crt
- --tls-key=/etc/paramserver/tls/tls.key
{{- if .Values.tls.mutual }}
- --tls-ca=/etc/paramserver/tls/ca.crt
{{- end }}
{{- end }}
{{- if .Values.auth.enabled }}
- --auth-tokens=/etc/paramserver/auth/tokens
{{- end }}
{{- end -}}

{{/* Client-side TLS / token flags (workers, probes). */}}
{{- define "paramserver.clientSecurityArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-ca=/etc/paramserver/tls/ca.crt
{{- if .Values.tls.mutual }}
- --tls-cert=/etc/paramserver/tls/tls.crt
- --tls-key=/etc/paramserver/tls/tls.key
{{- end }}
{{- end }}
{{- if .Values.auth.enabled }}
- --token-file=/etc/paramserver/auth/worker-token
{{- end }}
{{- end -}}

{{- define "paramserver.securityVolumeMounts" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/paramserver/tls
  readOnly: true
{{- end }}
{{- if .Values.auth.enabled }}
- name: auth
  mountPath: /etc/paramserver/auth
  readOnly: true
{{- end }}
{{- end -}}

{{- define "paramserver.securityVolumes" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ required "tls.secretName is required when tls.enabled" .Values.tls.secretName }}
    defaultMode: 256  # 0400: keys and tokens readable by their owner only
{{- end }}
{{- if .Values.auth.enabled }}
- name: auth
  secret:
    secretName: {{ required "auth.secretName is required when auth.enabled" .Values.auth.secretName }}
    defaultMode: 256  # 0400
{{- end }}
{{- end -}}

{{- define "paramserver.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "paramserver.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* Probe of a server on `port`, service `service`, with its timing `p` (timeoutS, periodS,
     failureThreshold): gRPC health, or with TLS `paramserver health` (kubelet's gRPC probes
     speak plain text), which starts in ~0.1 CPU-s, checks the certificate against the pod's own
     name (PARAMSERVER_TLS_SERVER_NAME in the container's environment) and gives up a second
     before the probe's timeout. (dict "root" $ "port" p "service" s "p" timing) */}}
{{- define "paramserver.healthProbe" -}}
{{- $root := .root -}}
{{- if $root.Values.tls.enabled }}
exec:
  command:
    - paramserver
    - health
    - --server=127.0.0.1:{{ .port }}
    - --service={{ .service }}
    - --timeout-s={{ max 1 (sub (int .p.timeoutS) 1) }}
    {{- with include "paramserver.clientSecurityArgs" $root | trim }}{{ . | nindent 4 }}{{- end }}
{{- else }}
grpc:
  port: {{ .port }}
  service: {{ .service | quote }}
{{- end }}
timeoutSeconds: {{ .p.timeoutS }}
periodSeconds: {{ .p.periodS }}
failureThreshold: {{ .p.failureThreshold }}
{{- end -}}

{{/* The container's own DNS name as the TLS server name of its probes (dict "root" $ "domain"
     ".<service>.<namespace>.svc.<cluster domain>"): env entries, POD_NAME first. */}}
{{- define "paramserver.podNameEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- if .root.Values.tls.enabled }}
- name: PARAMSERVER_TLS_SERVER_NAME
  value: "$(POD_NAME){{ .domain }}"
{{- end }}
{{- end -}}
