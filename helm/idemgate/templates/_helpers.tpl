{{/* Names and labels. */}}
{{- define "idemgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "idemgate.fullname" -}}
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

{{/* The Secret a secret setting ("database", "redis") is read from: its
     existingSecret, or the chart's own Secret when the value is given
     inline (for trials); empty when the setting is off. */}}
{{- define "idemgate.secretName" -}}
{{- $root := index . 0 -}}
{{- $ref := index $root.Values (index . 1) -}}
{{- if $ref.existingSecret -}}
{{- $ref.existingSecret -}}
{{- else if $ref.value -}}
{{- include "idemgate.fullname" $root -}}
{{- end -}}
{{- end -}}

{{/* The Secret a secret the chart makes when none is named ("admin",
     "ownerSalt", "replayKey") is read from: always one, the operator's or
     the chart's. */}}
{{- define "idemgate.madeSecretName" -}}
{{- $root := index . 0 -}}
{{- (index $root.Values (index . 1)).existingSecret | default (include "idemgate.fullname" $root) -}}
{{- end -}}

{{/* Refuses what cannot work, at install time. */}}
{{- define "idemgate.validate" -}}
{{- $owned := dict "listen" "ports.http" "admin_listen" "ports.admin" "upstreams" "upstreams" "shutdown_grace" "shutdownGraceSeconds" "database_url" "database.existingSecret" "redis_url" "redis.existingSecret" "admin_token" "admin.existingSecret" "replay_key" "replayKey.existingSecret" "embedded_path" "the chart (an emptyDir at /var/lib/idemgate)" -}}
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
{{- if and (eq .Values.mode "sidecar") .Values.serviceMonitor.enabled (not .Values.sidecar.podSelector) -}}
{{- fail "serviceMonitor in sidecar mode needs sidecar.podSelector: the labels of the API's pods, which the admin Service selects" -}}
{{- end -}}
{{- if and (eq .Values.mode "sidecar") .Values.admin.networkPolicy.enabled -}}
{{- fail "admin.networkPolicy is for mode: deployment; in sidecar mode the pod is the API's, so its NetworkPolicy belongs in the API's chart" -}}
{{- end -}}
{{- end -}}

{{/* Whole numbers stay integers. Helm reads every number in a values file
     as a float, and toToml writes 32 as 32.0, which the binary refuses for
     its integer keys (database_pool_size, max_attempts, statuses, sizes in
     bytes); no key of the binary takes a fraction. Walks a dict, and every
     table and array in it, replacing each whole float by an int64, in
     place: give it a copy. A list cannot be changed in place, so each
     element goes through in a dict of its own and a new list replaces it. */}}
{{- define "idemgate.wholeNumbers" -}}
{{- $table := . -}}
{{- range $key, $value := $table -}}
{{- if kindIs "float64" $value -}}
{{- if eq $value (floor $value) -}}
{{- $_ := set $table $key (int64 $value) -}}
{{- end -}}
{{- else if kindIs "map" $value -}}
{{- include "idemgate.wholeNumbers" $value -}}
{{- else if kindIs "slice" $value -}}
{{- $items := list -}}
{{- range $item := $value -}}
{{- $box := dict "item" $item -}}
{{- include "idemgate.wholeNumbers" $box -}}
{{- $items = append $items $box.item -}}
{{- end -}}
{{- $_ := set $table $key $items -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Whole seconds (rounded up) in `times` times a duration as the binary
     reads it (humantime: "90s", "2m", "1h30m", "500ms", "1.5h", "1m 30s"),
     for the termination grace period; anything else fails the install,
     naming `key`. Called with (list duration key times). */}}
{{- define "idemgate.seconds" -}}
{{- $text := toString (index . 0) -}}
{{- $key := index . 1 -}}
{{- $times := index . 2 -}}
{{- $units := dict
      "nanos" 0.000000001 "nsec" 0.000000001 "ns" 0.000000001
      "usec" 0.000001 "us" 0.000001 "µs" 0.000001
      "millis" 0.001 "msec" 0.001 "ms" 0.001
      "seconds" 1.0 "second" 1.0 "secs" 1.0 "sec" 1.0 "s" 1.0
      "minutes" 60.0 "minute" 60.0 "mins" 60.0 "min" 60.0 "m" 60.0
      "hours" 3600.0 "hour" 3600.0 "hrs" 3600.0 "hr" 3600.0 "h" 3600.0
      "days" 86400.0 "day" 86400.0 "d" 86400.0
      "weeks" 604800.0 "week" 604800.0 "wks" 604800.0 "wk" 604800.0 "w" 604800.0
      "months" 2630016.0 "month" 2630016.0 "M" 2630016.0
      "years" 31557600.0 "year" 31557600.0 "yrs" 31557600.0 "yr" 31557600.0 "y" 31557600.0 -}}
{{- $parts := regexFindAll "[0-9]+(\\.[0-9]+)?\\s*[a-zA-Zµ]+" $text -1 -}}
{{- if or (not $parts) (ne (join "" $parts | nospace) (nospace $text)) -}}
{{- fail (printf "%s = %q is not a duration: write it like \"90s\", \"2m\" or \"1h30m\"" $key $text) -}}
{{- end -}}
{{- $total := 0.0 -}}
{{- range $part := $parts -}}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?" $part -}}
{{- $unit := trimPrefix $number $part | trim -}}
{{- if not (hasKey $units $unit) -}}
{{- fail (printf "%s = %q: unknown unit %q (ms, s, m, h, d, ...)" $key $text $unit) -}}
{{- end -}}
{{- $total = addf $total (mulf (float64 $number) (get $units $unit)) -}}
{{- end -}}
{{- /* Rounded to the microsecond first: 0.1 x 10 in floats is a hair over 1. */ -}}
{{- int64 (ceil (round (mulf $total $times) 6)) -}}
{{- end -}}

{{/* The drain after SIGTERM, in seconds: shutdownGraceSeconds when set;
     else as long as an attempt may run, which is what the binary defaults
     shutdown_grace to: attempt_deadline, or 10 x upstream_timeout, or 300 s
     (10 x the default 30 s). */}}
{{- define "idemgate.shutdownGraceSeconds" -}}
{{- if not (kindIs "invalid" .Values.shutdownGraceSeconds) -}}
{{- int64 .Values.shutdownGraceSeconds -}}
{{- else if .Values.config.attempt_deadline -}}
{{- include "idemgate.seconds" (list .Values.config.attempt_deadline "config.attempt_deadline" 1) -}}
{{- else if .Values.config.upstream_timeout -}}
{{- include "idemgate.seconds" (list .Values.config.upstream_timeout "config.upstream_timeout" 10) -}}
{{- else -}}
300
{{- end -}}
{{- end -}}

{{/* The config file: the chart's listeners, upstreams and shutdown grace,
     then everything under `config`, whole numbers as integers. The grace is
     written even when derived, so the drain is the number the termination
     grace period was computed from. */}}
{{- define "idemgate.config" -}}
{{- $base := dict
      "listen" (printf "0.0.0.0:%d" (int .Values.ports.http))
      "admin_listen" (printf "0.0.0.0:%d" (int .Values.ports.admin))
      "upstreams" .Values.upstreams
      "shutdown_grace" (printf "%ss" (include "idemgate.shutdownGraceSeconds" .)) -}}
{{- if not (include "idemgate.secretName" (list . "database")) -}}
{{- $_ := set $base "embedded_path" "/var/lib/idemgate/idemgate.db" -}}
{{- end -}}
{{- $config := deepCopy (merge $base (.Values.config | default dict)) -}}
{{- include "idemgate.wholeNumbers" $config -}}
{{- toToml $config -}}
{{- end -}}

{{/* The environment: the store, Redis, the secrets, traces, extraEnv.
     Called with (list $ "serve") for the gateway, (list $ "migrate") for
     the migration Job, which gets only what `idemgate migrate` reads (the
     store; traces; extraEnv, where IDEMGATE_DATABASE_DIRECT_URL goes): the
     secrets the gateway serves with are left out, because a pre-upgrade
     hook runs before the chart's Secret is updated, and a key this chart
     version adds to it (the admin token, for one) is not there yet. */}}
{{- define "idemgate.env" -}}
{{- $ := index . 0 -}}
{{- $serve := eq (index . 1) "serve" -}}
- name: IDEMGATE_LOG_FORMAT
  value: json
{{- with include "idemgate.secretName" (list $ "database") }}
- name: IDEMGATE_DATABASE_URL
  valueFrom: { secretKeyRef: { name: {{ . }}, key: {{ $.Values.database.key }} } }
{{- end }}
{{- if $serve }}
{{- with include "idemgate.secretName" (list $ "redis") }}
- name: IDEMGATE_REDIS_URL
  valueFrom: { secretKeyRef: { name: {{ . }}, key: {{ $.Values.redis.key }} } }
{{- end }}
- name: IDEMGATE_OWNER_SALT
  valueFrom: { secretKeyRef: { name: {{ include "idemgate.madeSecretName" (list $ "ownerSalt") }}, key: {{ $.Values.ownerSalt.key }} } }
- name: IDEMGATE_REPLAY_KEY
  valueFrom: { secretKeyRef: { name: {{ include "idemgate.madeSecretName" (list $ "replayKey") }}, key: {{ $.Values.replayKey.key }} } }
- name: IDEMGATE_ADMIN_TOKEN
  valueFrom: { secretKeyRef: { name: {{ include "idemgate.madeSecretName" (list $ "admin") }}, key: {{ $.Values.admin.key }} } }
{{- end }}
{{- with $.Values.tracing.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ $.Values.tracing.serviceName | quote }}
{{- end }}
{{- with $.Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The container's probes: the chart's, with livenessProbe,
     readinessProbe and startupProbe from the values merged over them (a
     slower start: `startupProbe: { failureThreshold: 120 }`). */}}
{{- define "idemgate.probes" -}}
{{- $defaults := dict
      "livenessProbe" (dict "httpGet" (dict "path" "/healthz" "port" "admin") "periodSeconds" 10 "failureThreshold" 3)
      "readinessProbe" (dict "httpGet" (dict "path" "/readyz" "port" "admin") "periodSeconds" 5 "failureThreshold" 2)
      "startupProbe" (dict "httpGet" (dict "path" "/healthz" "port" "admin") "periodSeconds" 1 "failureThreshold" 30) -}}
{{- range $probe := list "livenessProbe" "readinessProbe" "startupProbe" }}
{{ $probe }}:
  {{- toYaml (mergeOverwrite (index $defaults $probe) (deepCopy (index $.Values $probe | default dict))) | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The idemgate container, as the Deployment and the sidecar both run it. */}}
{{- define "idemgate.container" -}}
name: idemgate
image: {{ include "idemgate.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
args: ["serve", "--config", "/etc/idemgate/idemgate.toml"]
env:
  {{- include "idemgate.env" (list . "serve") | nindent 2 }}
ports:
  - { name: http, containerPort: {{ .Values.ports.http }}, protocol: TCP }
  - { name: admin, containerPort: {{ .Values.ports.admin }}, protocol: TCP }
{{- include "idemgate.probes" . }}
lifecycle:
  # Keep serving while the endpoints drop the pod; then SIGTERM drains for
  # the shutdown grace (the image has no shell: the kubelet sleeps).
  preStop:
    sleep: { seconds: {{ .Values.preStopSeconds }} }
{{- with .Values.securityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
resources:
  {{- toYaml .Values.resources | nindent 2 }}
volumeMounts:
  - { name: idemgate-config, mountPath: /etc/idemgate, readOnly: true }
{{- if not (include "idemgate.secretName" (list . "database")) }}
  - { name: idemgate-data, mountPath: /var/lib/idemgate }
{{- end }}
{{- if .Values.database.tlsSecret }}
  - { name: idemgate-postgres-tls, mountPath: /etc/idemgate-tls/postgres, readOnly: true }
{{- end }}
{{- with .Values.extraVolumeMounts }}
  {{- toYaml . | nindent 2 }}
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
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Where the pod runs, as the Deployment and the migration Job both
     schedule it. */}}
{{- define "idemgate.scheduling" -}}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* For an API's pod: idemgate as a native sidecar (an init container that
     keeps running, Kubernetes >= 1.29; the preStop sleep needs 1.30),
     started before the API and stopped after it. Put it under
     `initContainers`, add "idemgate.volumes" to the pod's volumes and
     "idemgate.terminationGracePeriodSeconds" to its grace period; see
     examples/app-with-sidecar. */}}
{{- define "idemgate.sidecar" -}}
{{ include "idemgate.container" . }}
restartPolicy: Always
{{- end -}}

{{/* preStop, then the drain, then 5 s for the process to flush and exit:
     the kubelet's SIGKILL never lands mid-drain. */}}
{{- define "idemgate.terminationGracePeriodSeconds" -}}
{{- add (include "idemgate.shutdownGraceSeconds" . | int64) (int .Values.preStopSeconds) 5 -}}
{{- end -}}
