{{/*
Names, labels and the pieces every twophase pod shares.
*/}}

{{- define "twophase.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name, at most 63 chars (DNS label). Components append "-coordinator" or
"-participant", so the base is cut at 50 to leave room for them.
*/}}
{{- define "twophase.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "twophase.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels. Immutable in Deployments and StatefulSets, so they hold only what never changes
for a release: name, instance and (via twophase.componentSelectorLabels) component. Never the
chart version or app version.
*/}}
{{- define "twophase.selectorLabels" -}}
app.kubernetes.io/name: {{ include "twophase.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Call with (dict "root" $ "component" "coordinator"). */}}
{{- define "twophase.componentSelectorLabels" -}}
{{ include "twophase.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "twophase.labels" -}}
helm.sh/chart: {{ include "twophase.chart" . }}
{{ include "twophase.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: twophase
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Call with (dict "root" $ "component" "coordinator"). */}}
{{- define "twophase.componentLabels" -}}
{{ include "twophase.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "twophase.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "twophase.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The hook Job runs before the release's own objects exist, so it cannot use a ServiceAccount the
chart creates; it uses the named existing one, or the namespace default (no API access needed).
*/}}
{{- define "twophase.hookServiceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- "default" }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "twophase.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{- define "twophase.configMapName" -}}
{{- printf "%s-pipeline" (include "twophase.fullname" .) }}
{{- end }}

{{- define "twophase.pipelineName" -}}
{{- default .Release.Name .Values.pipeline.pipeline }}
{{- end }}

{{- define "twophase.saslEnabled" -}}
{{- if hasPrefix "SASL_" .Values.kafka.securityProtocol }}true{{ end }}
{{- end }}

{{- define "twophase.tlsEnabled" -}}
{{- if has .Values.kafka.securityProtocol (list "SSL" "SASL_SSL") }}true{{ end }}
{{- end }}

{{/*
Fail early on settings that render but cannot work. Included once, from the ConfigMap.
*/}}
{{- define "twophase.validate" -}}
{{- if eq (lower .Values.image.tag) "latest" }}
{{- fail "image.tag: \"latest\" is not allowed; pin a version so a pod restart never changes the code under a running pipeline" }}
{{- end }}
{{- if and (include "twophase.saslEnabled" .) (not .Values.kafka.sasl.existingSecret) }}
{{- fail (printf "kafka.sasl.existingSecret: securityProtocol %s needs a Secret with the SASL username and password" .Values.kafka.securityProtocol) }}
{{- end }}
{{- if and .Values.kafka.tls.existingSecret (not (include "twophase.tlsEnabled" .)) }}
{{- fail (printf "kafka.tls.existingSecret is set but kafka.securityProtocol is %s; use SSL or SASL_SSL" .Values.kafka.securityProtocol) }}
{{- end }}
{{- if and .Values.kafka.tls.clientAuth (not .Values.kafka.tls.existingSecret) }}
{{- fail "kafka.tls.clientAuth needs kafka.tls.existingSecret holding the client certificate and key" }}
{{- end }}
{{- if and .Values.participant.persistence.enabled (ne .Values.participant.kind "StatefulSet") }}
{{- fail "participant.persistence.enabled needs participant.kind StatefulSet (a Deployment has no per-pod volumes; mount a shared ReadWriteMany volume with extraVolumes instead)" }}
{{- end }}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.service.enabled) }}
{{- fail "metrics.serviceMonitor.enabled needs metrics.service.enabled" }}
{{- end }}
{{- range $c := list "coordinator" "participant" }}
{{- $pdb := (index $.Values $c).podDisruptionBudget }}
{{- if and $pdb.enabled (eq (kindOf $pdb.minAvailable) "invalid") (eq (kindOf $pdb.maxUnavailable) "invalid") }}
{{- fail (printf "%s.podDisruptionBudget: set one of minAvailable or maxUnavailable" $c) }}
{{- end }}
{{- if and $pdb.enabled (ne (kindOf $pdb.minAvailable) "invalid") (ne (kindOf $pdb.maxUnavailable) "invalid") }}
{{- fail (printf "%s.podDisruptionBudget: set only one of minAvailable or maxUnavailable (set the other to null)" $c) }}
{{- end }}
{{- end }}
{{- with .Values.participant.autoscaling }}
{{- if and .enabled (gt (int .minReplicas) (int .maxReplicas)) }}
{{- fail "participant.autoscaling.minReplicas must not exceed participant.autoscaling.maxReplicas" }}
{{- end }}
{{- if and .enabled (not .targetCPUUtilizationPercentage) (not .targetMemoryUtilizationPercentage) }}
{{- fail "participant.autoscaling: set targetCPUUtilizationPercentage and/or targetMemoryUtilizationPercentage" }}
{{- end }}
{{- end }}
{{- include "twophase.checkNoLiteralSecrets" (list "pipeline" .Values.pipeline) }}
{{- include "twophase.checkNoLiteralSecrets" (list "kafka.config" .Values.kafka.config) }}
{{- end }}

{{/*
Walks a value (called with (list "path" value)) and fails when a key that holds a secret has a
literal instead of a "${ENV:NAME}" / "${FILE:/path}" reference, or when a URL string carries a
password in its userinfo. ConfigMaps are readable by anyone who can read the namespace.
*/}}
{{- define "twophase.checkNoLiteralSecrets" -}}
{{- $path := index . 0 }}
{{- $value := index . 1 }}
{{- $secretKeys := list "password" "passwd" "secret" "token" "hmac_key" "api_key" "sasl.password" "sasl.oauthbearer.client.secret" "ssl.key.password" "ssl.key.pem" "ssl.keystore.password" }}
{{- $reference := "^\\$\\{(ENV|FILE):[^}]+\\}$" }}
{{- if kindIs "map" $value }}
{{- range $k, $v := $value }}
{{- $childPath := printf "%s.%s" $path $k }}
{{- if and (has (lower $k) $secretKeys) (not (kindIs "invalid" $v)) (not (kindIs "map" $v)) (not (kindIs "slice" $v)) (ne (toString $v) "") }}
{{- if not (and (kindIs "string" $v) (regexMatch $reference $v)) }}
{{- fail (printf "%s: literal secret in the pipeline config; put it in a Secret, set the matching secrets.*.existingSecret (or extraEnv) and write \"${ENV:NAME}\" here" $childPath) }}
{{- end }}
{{- end }}
{{- include "twophase.checkNoLiteralSecrets" (list $childPath $v) }}
{{- end }}
{{- else if kindIs "slice" $value }}
{{- range $i, $v := $value }}
{{- include "twophase.checkNoLiteralSecrets" (list (printf "%s[%d]" $path $i) $v) }}
{{- end }}
{{- else if kindIs "string" $value }}
{{- $urlWithUserinfo := "^[A-Za-z][A-Za-z0-9+.-]*://([^/@]*)@" }}
{{- if regexMatch $urlWithUserinfo $value }}
{{- $userinfo := regexReplaceAll (printf "%s.*$" $urlWithUserinfo) $value "${1}" }}
{{- if and (contains ":" $userinfo) (not (contains "${" $userinfo)) }}
{{- fail (printf "%s: URL carries a password; move it to a Secret and reference it with \"${ENV:NAME}\" (or leave it out of the URL and use the sink's password field)" $path) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The pipeline config: the user's free-form `pipeline`, its name defaulted to the release name,
the chart-level Kafka settings merged into `kafka`, and metrics.port set. Chart-level settings win over the same
keys in pipeline.kafka; kafka.config wins over both (it is the explicit passthrough).
*/}}
{{- define "twophase.pipelineConfig" -}}
{{- $p := deepCopy (.Values.pipeline | default dict) }}
{{- $_ := set $p "pipeline" (include "twophase.pipelineName" .) }}
{{- $kafka := deepCopy (get $p "kafka" | default dict) }}
{{- $cfg := deepCopy (get $kafka "config" | default dict) }}
{{- $_ := set $cfg "security.protocol" .Values.kafka.securityProtocol }}
{{- if include "twophase.saslEnabled" . }}
{{- $_ := set $cfg "sasl.mechanism" .Values.kafka.sasl.mechanism }}
{{- $_ := set $cfg "sasl.username" "${ENV:TWOPHASE_KAFKA_SASL_USERNAME}" }}
{{- $_ := set $cfg "sasl.password" "${ENV:TWOPHASE_KAFKA_SASL_PASSWORD}" }}
{{- end }}
{{- if and (include "twophase.tlsEnabled" .) .Values.kafka.tls.existingSecret }}
{{- $dir := .Values.kafka.tls.mountPath | trimSuffix "/" }}
{{- $_ := set $cfg "ssl.ca.location" (printf "%s/%s" $dir .Values.kafka.tls.caKey) }}
{{- if .Values.kafka.tls.clientAuth }}
{{- $_ := set $cfg "ssl.certificate.location" (printf "%s/%s" $dir .Values.kafka.tls.certKey) }}
{{- $_ := set $cfg "ssl.key.location" (printf "%s/%s" $dir .Values.kafka.tls.keyKey) }}
{{- end }}
{{- end }}
{{- $cfg = mergeOverwrite $cfg (deepCopy .Values.kafka.config) }}
{{- $_ := set $kafka "bootstrap_servers" .Values.kafka.bootstrapServers }}
{{- $_ := set $kafka "config" $cfg }}
{{- $_ := set $p "kafka" $kafka }}
{{- /* The probes and the Service use this port, so the chart owns it. */}}
{{- $metrics := deepCopy (get $p "metrics" | default dict) }}
{{- $_ := set $metrics "port" (int .Values.metrics.port) }}
{{- $_ := set $p "metrics" $metrics }}
{{- if and .Values.secrets.controlHmacKey.existingSecret (not (hasKey (get $p "control" | default dict) "hmac_key")) }}
{{- $control := deepCopy (get $p "control" | default dict) }}
{{- $_ := set $control "hmac_key" "${ENV:TWOPHASE_CONTROL_HMAC_KEY}" }}
{{- $_ := set $p "control" $control }}
{{- end }}
{{- toYaml $p }}
{{- end }}

{{/*
Environment shared by every twophase container: logging and the secret
references. Call with (dict "root" $ "participantId" true) to add TWOPHASE_PARTICIPANT_ID.
*/}}
{{- define "twophase.env" -}}
{{- $v := .root.Values }}
{{- if .participantId }}
# The pod name: stable across restarts for a StatefulSet, so a restarted participant finds its
# own prepared transactions and keeps its consumer-group identity.
- name: TWOPHASE_PARTICIPANT_ID
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- end }}
- name: TWOPHASE_LOG_FORMAT
  value: {{ $v.log.format | quote }}
- name: TWOPHASE_LOG_LEVEL
  value: {{ $v.log.level | quote }}
{{- if include "twophase.saslEnabled" .root }}
- name: TWOPHASE_KAFKA_SASL_USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ $v.kafka.sasl.existingSecret }}
      key: {{ $v.kafka.sasl.usernameKey }}
- name: TWOPHASE_KAFKA_SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $v.kafka.sasl.existingSecret }}
      key: {{ $v.kafka.sasl.passwordKey }}
{{- end }}
{{- with $v.secrets.controlHmacKey }}
{{- if .existingSecret }}
- name: TWOPHASE_CONTROL_HMAC_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .existingSecret }}
      key: {{ .key }}
{{- end }}
{{- end }}
{{- with $v.secrets.postgresPassword }}
{{- if .existingSecret }}
- name: TWOPHASE_PG_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .existingSecret }}
      key: {{ .key }}
{{- end }}
{{- end }}
{{- with $v.secrets.mongoUri }}
{{- if .existingSecret }}
- name: TWOPHASE_MONGO_URI
  valueFrom:
    secretKeyRef:
      name: {{ .existingSecret }}
      key: {{ .key }}
{{- end }}
{{- end }}
{{- with $v.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Volume mounts shared by every twophase container. Call with (dict "root" $ "configMap" name).
*/}}
{{- define "twophase.volumeMounts" -}}
- name: pipeline-config
  mountPath: /etc/twophase/pipeline.yaml
  subPath: pipeline.yaml
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if and (include "twophase.tlsEnabled" .root) .root.Values.kafka.tls.existingSecret }}
- name: kafka-tls
  mountPath: {{ .root.Values.kafka.tls.mountPath }}
  readOnly: true
{{- end }}
{{- with .root.Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "twophase.volumes" -}}
- name: pipeline-config
  configMap:
    name: {{ .configMap }}
- name: tmp
  emptyDir:
    sizeLimit: {{ .root.Values.tmpSizeLimit }}
{{- if and (include "twophase.tlsEnabled" .root) .root.Values.kafka.tls.existingSecret }}
- name: kafka-tls
  secret:
    secretName: {{ .root.Values.kafka.tls.existingSecret }}
    # Group-readable only: the pod's fsGroup owns it, the non-root user reads it.
    defaultMode: 0440
{{- end }}
{{- with .root.Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Probes on the health endpoints, each switchable. Call with the component's values.
*/}}
{{- define "twophase.probes" -}}
{{- with .startupProbe }}
{{- if .enabled }}
startupProbe:
  httpGet:
    path: /healthz
    port: http-metrics
  periodSeconds: {{ .periodSeconds }}
  timeoutSeconds: {{ .timeoutSeconds }}
  failureThreshold: {{ .failureThreshold }}
{{- end }}
{{- end }}
{{- with .livenessProbe }}
{{- if .enabled }}
livenessProbe:
  httpGet:
    path: /healthz
    port: http-metrics
  initialDelaySeconds: {{ .initialDelaySeconds }}
  periodSeconds: {{ .periodSeconds }}
  timeoutSeconds: {{ .timeoutSeconds }}
  failureThreshold: {{ .failureThreshold }}
{{- end }}
{{- end }}
{{- with .readinessProbe }}
{{- if .enabled }}
readinessProbe:
  httpGet:
    path: /readyz
    port: http-metrics
  initialDelaySeconds: {{ .initialDelaySeconds }}
  periodSeconds: {{ .periodSeconds }}
  timeoutSeconds: {{ .timeoutSeconds }}
  failureThreshold: {{ .failureThreshold }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Default soft anti-affinity: spread a component's pods over nodes unless the user set affinity.
Call with (dict "root" $ "component" "coordinator" "affinity" .Values.coordinator.affinity).
*/}}
{{- define "twophase.affinity" -}}
{{- if .affinity }}
{{- toYaml .affinity }}
{{- else }}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "twophase.componentSelectorLabels" (dict "root" .root "component" .component) | nindent 12 }}
{{- end }}
{{- end }}

{{/*
Container fields shared by every twophase container (image, security, env, mounts).
Call with (dict "root" $ "participantId" bool).
*/}}
{{- define "twophase.containerCommon" -}}
image: {{ include "twophase.image" .root }}
imagePullPolicy: {{ .root.Values.image.pullPolicy }}
securityContext:
  {{- toYaml .root.Values.securityContext | nindent 2 }}
env:
  {{- include "twophase.env" . | trim | nindent 2 }}
{{- with .root.Values.extraEnvFrom }}
envFrom:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod-level fields shared by every twophase pod. Call with the root context. */}}
{{- define "twophase.podCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
automountServiceAccountToken: false
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}
