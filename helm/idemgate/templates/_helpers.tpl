{{/* Names and labels. */}}
{{- define "idemgate.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "idemgate.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "idemgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "idemgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "idemgate.labels" -}}
{{ include "idemgate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "idemgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "idemgate.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "idemgate.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The Secret a secret setting ("database", "redis", "admin") is read
     from: its existingSecret, or the chart's own Secret when the value is
     given inline (for trials); empty when the setting is off. */}}
{{- define "idemgate.secretName" -}}
{{- $root := index . 0 -}}
{{- $ref := index $root.Values (index . 1) -}}
{{- if $ref.existingSecret -}}
{{- $ref.existingSecret -}}
{{- else if $ref.value -}}
{{- include "idemgate.fullname" $root -}}
{{- end -}}
{{- end -}}

{{/* Refuses what cannot work, at install time. */}}
{{- define "idemgate.validate" -}}
{{- $owned := dict "listen" "ports.http" "admin_listen" "ports.admin" "upstreams" "upstreams" "shutdown_grace" "shutdownGraceSeconds" "database_url" "database.existingSecret" "redis_url" "redis.existingSecret" "admin_token" "admin.existingSecret" "embedded_path" "the chart (an emptyDir at /var/lib/idemgate)" -}}
{{- range $key, $instead := $owned -}}
{{- if hasKey $.Values.config $key -}}
{{- fail (printf "config.%s is set by the chart: use %s instead" $key $instead) -}}
{{- end -}}
{{- end -}}
{{- $postgres := include "idemgate.secretName" (list . "database") -}}
{{- if and (not $postgres) (eq .Values.mode "sidecar") (not .Values.sidecar.embeddedStore) -}}
{{- fail "sidecar mode needs PostgreSQL: set database.existingSecret, or sidecar.embeddedStore: true if the API runs exactly one replica (each pod would keep its own jobs)" -}}
{{- end -}}
{{- if and (not $postgres) (eq .Values.mode "deployment") -}}
{{- if or (gt (int .Values.replicaCount) 1) .Values.autoscaling.enabled -}}
{{- fail "the embedded store serves one gateway: set database.existingSecret (PostgreSQL) to run more than one replica, or replicaCount: 1 and autoscaling.enabled: false" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The config file: the chart's listeners, upstreams and shutdown grace,
     then everything under `config`. */}}
{{- define "idemgate.config" -}}
{{- $base := dict
      "listen" (printf "0.0.0.0:%d" (int .Values.ports.http))
      "admin_listen" (printf "0.0.0.0:%d" (int .Values.ports.admin))
      "upstreams" .Values.upstreams
      "shutdown_grace" (printf "%ds" (int .Values.shutdownGraceSeconds)) -}}
{{- if not (include "idemgate.secretName" (list . "database")) -}}
{{- $_ := set $base "embedded_path" "/var/lib/idemgate/idemgate.db" -}}
{{- end -}}
{{- toToml (merge $base .Values.config) -}}
{{- end -}}

{{/* The idemgate container, as the Deployment and the sidecar both run it. */}}
{{- define "idemgate.container" -}}
name: idemgate
image: {{ include "idemgate.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
args: ["serve", "--config", "/etc/idemgate/idemgate.toml"]
env:
  - name: IDEMGATE_LOG_FORMAT
    value: json
{{- with include "idemgate.secretName" (list . "database") }}
  - name: IDEMGATE_DATABASE_URL
    valueFrom: { secretKeyRef: { name: {{ . }}, key: {{ $.Values.database.key }} } }
{{- end }}
{{- with include "idemgate.secretName" (list . "redis") }}
  - name: IDEMGATE_REDIS_URL
    valueFrom: { secretKeyRef: { name: {{ . }}, key: {{ $.Values.redis.key }} } }
{{- end }}
  - name: IDEMGATE_OWNER_SALT
    valueFrom: { secretKeyRef: { name: {{ .Values.ownerSalt.existingSecret | default (include "idemgate.fullname" .) }}, key: {{ .Values.ownerSalt.key }} } }
  - name: IDEMGATE_REPLAY_KEY
    valueFrom: { secretKeyRef: { name: {{ .Values.replayKey.existingSecret | default (include "idemgate.fullname" .) }}, key: {{ .Values.replayKey.key }} } }
{{- with include "idemgate.secretName" (list . "admin") }}
  - name: IDEMGATE_ADMIN_TOKEN
    valueFrom: { secretKeyRef: { name: {{ . }}, key: {{ $.Values.admin.key }} } }
{{- end }}
{{- with .Values.tracing.otlpEndpoint }}
  - name: OTEL_EXPORTER_OTLP_ENDPOINT
    value: {{ . | quote }}
  - name: OTEL_SERVICE_NAME
    value: {{ $.Values.tracing.serviceName | quote }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . | indent 2 }}
{{- end }}
ports:
  - { name: http, containerPort: {{ .Values.ports.http }}, protocol: TCP }
  - { name: admin, containerPort: {{ .Values.ports.admin }}, protocol: TCP }
livenessProbe:
  httpGet: { path: /healthz, port: admin }
  periodSeconds: 10
  failureThreshold: 3
readinessProbe:
  httpGet: { path: /readyz, port: admin }
  periodSeconds: 5
  failureThreshold: 2
startupProbe:
  httpGet: { path: /healthz, port: admin }
  periodSeconds: 1
  failureThreshold: 30
lifecycle:
  # Keep serving while the endpoints drop the pod; then SIGTERM drains for
  # shutdownGraceSeconds (the image has no shell: the kubelet sleeps).
  preStop:
    sleep: { seconds: {{ .Values.preStopSeconds }} }
securityContext:
  runAsNonRoot: true
  runAsUser: 65532
  runAsGroup: 65532
  readOnlyRootFilesystem: true
  allowPrivilegeEscalation: false
  capabilities: { drop: ["ALL"] }
  seccompProfile: { type: RuntimeDefault }
resources:
{{ toYaml .Values.resources | indent 2 }}
volumeMounts:
  - { name: idemgate-config, mountPath: /etc/idemgate, readOnly: true }
{{- if not (include "idemgate.secretName" (list . "database")) }}
  - { name: idemgate-data, mountPath: /var/lib/idemgate }
{{- end }}
{{- if .Values.database.tlsSecret }}
  - { name: idemgate-postgres-tls, mountPath: /etc/idemgate-tls/postgres, readOnly: true }
{{- end }}
{{- end -}}

{{/* The volumes the container mounts. */}}
{{- define "idemgate.volumes" -}}
- name: idemgate-config
  configMap: { name: {{ include "idemgate.fullname" . }} }
{{- if not (include "idemgate.secretName" (list . "database")) }}
- name: idemgate-data
  emptyDir: {}
{{- end }}
{{- with .Values.database.tlsSecret }}
- name: idemgate-postgres-tls
  secret: { secretName: {{ . }} }
{{- end }}
{{- end -}}

{{/* For an API's pod: idemgate as a native sidecar (an init container that
     keeps running, Kubernetes >= 1.29; the preStop sleep needs 1.30), started before the API and stopped
     after it. Put it under `initContainers` and add "idemgate.volumes" to
     the pod's volumes; see examples/app-with-sidecar. */}}
{{- define "idemgate.sidecar" -}}
{{ include "idemgate.container" . }}
restartPolicy: Always
{{- end -}}

{{- define "idemgate.terminationGracePeriodSeconds" -}}
{{- add (int .Values.shutdownGraceSeconds) (int .Values.preStopSeconds) 5 -}}
{{- end -}}
