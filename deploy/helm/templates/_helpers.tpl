{{/*
Names, labels and the settings each service's templates share.
A "component" is one of the values keys: directory, modelRegistry, datastore (the gRPC services,
"componentKeys"), and console (the web console, an HTTP server with templates of its own).
*/}}

{{- define "cogment-aux.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "cogment-aux.fullname" -}}
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

{{- define "cogment-aux.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The fixed facts of each component: its `cogment-aux services` name, environment prefix, name suffix. */}}
{{- define "cogment-aux.components" -}}
directory:
  service: directory
  envPrefix: COGMENT_DIRECTORY
  suffix: directory
  registers: false
modelRegistry:
  service: model_registry
  envPrefix: COGMENT_MODEL_REGISTRY
  suffix: model-registry
  registers: true
datastore:
  service: trial_datastore
  envPrefix: COGMENT_TRIAL_DATASTORE
  suffix: datastore
  registers: true
console:
  service: console
  envPrefix: COGMENT_CONSOLE
  suffix: console
  registers: false
{{- end -}}

{{/* The component keys, in a fixed order. */}}
{{- define "cogment-aux.componentKeys" -}}
{{- list "directory" "modelRegistry" "datastore" | toJson -}}
{{- end -}}

{{/* Fixed facts of one component: (dict "root" $ "key" "directory") */}}
{{- define "cogment-aux.meta" -}}
{{- index (include "cogment-aux.components" .root | fromYaml) .key | toYaml -}}
{{- end -}}

{{/* Resource name of one component: (dict "root" $ "key" "directory") */}}
{{- define "cogment-aux.componentName" -}}
{{- $meta := include "cogment-aux.meta" . | fromYaml -}}
{{- printf "%s-%s" (include "cogment-aux.fullname" .root | trunc (int (sub 62 (len $meta.suffix))) | trimSuffix "-") $meta.suffix -}}
{{- end -}}

{{- define "cogment-aux.labels" -}}
helm.sh/chart: {{ include "cogment-aux.chart" . }}
{{ include "cogment-aux.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: cogment
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "cogment-aux.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cogment-aux.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels of one component's resources: (dict "root" $ "key" "directory") */}}
{{- define "cogment-aux.componentLabels" -}}
{{ include "cogment-aux.labels" .root }}
app.kubernetes.io/component: {{ (include "cogment-aux.meta" . | fromYaml).suffix }}
{{- end -}}

{{- define "cogment-aux.componentSelectorLabels" -}}
{{ include "cogment-aux.selectorLabels" .root }}
app.kubernetes.io/component: {{ (include "cogment-aux.meta" . | fromYaml).suffix }}
{{- end -}}

{{- define "cogment-aux.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* In-cluster DNS name of one component's Service. */}}
{{- define "cogment-aux.serviceHost" -}}
{{- printf "%s.%s.svc.%s" (include "cogment-aux.componentName" .) .root.Release.Namespace .root.Values.clusterDomain -}}
{{- end -}}

{{/* "true" when the component keeps state on a volume of its own (SQLite file, local blobs). */}}
{{- define "cogment-aux.needsVolume" -}}
{{- $values := index .root.Values .key -}}
{{- if or (eq .root.Values.database.type "sqlite") (and (eq .key "modelRegistry") (eq $values.storage.type "local")) -}}
true
{{- end -}}
{{- end -}}

{{/* Effective TLS settings of one component, as YAML. */}}
{{- define "cogment-aux.tls" -}}
{{- $global := .root.Values.tls -}}
{{- $own := (index .root.Values .key).tls | default dict -}}
{{- $enabled := $global.enabled -}}
{{- if kindIs "bool" $own.enabled -}}
{{- $enabled = $own.enabled -}}
{{- end -}}
{{- $secret := $own.existingSecret | default $global.existingSecret -}}
enabled: {{ $enabled }}
secret: {{ $secret | quote }}
certKey: {{ $global.certKey | quote }}
keyKey: {{ $global.keyKey | quote }}
mtls: {{ and $enabled $global.clientCA.enabled }}
caSecret: {{ $global.clientCA.existingSecret | default $secret | quote }}
caKey: {{ $global.clientCA.key | quote }}
{{- end -}}

{{/* The directory endpoint the registry and the datastore register in; empty: none. */}}
{{- define "cogment-aux.directoryEndpoint" -}}
{{- $reg := .Values.directoryRegistration -}}
{{- if $reg.enabled -}}
{{- if $reg.endpoint -}}
{{- $reg.endpoint -}}
{{- else if .Values.directory.enabled -}}
{{- printf "grpc://%s:%v" (include "cogment-aux.serviceHost" (dict "root" . "key" "directory")) .Values.directory.service.port -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
Whether the directory answers inquiries load balanced: directory.loadBalancing, or when null,
whether a service registering in it runs several replicas. Without it every client (the
orchestrator takes the first endpoint) would go to the same replica.
*/}}
{{- define "cogment-aux.loadBalancing" -}}
{{- $forced := .Values.directory.loadBalancing -}}
{{- if kindIs "bool" $forced -}}
{{- $forced -}}
{{- else -}}
{{- $several := false -}}
{{- range $key := list "modelRegistry" "datastore" -}}
{{- $values := index $.Values $key -}}
{{- if and $values.enabled (gt (int $values.replicaCount) 1) -}}
{{- $several = true -}}
{{- end -}}
{{- end -}}
{{- $several -}}
{{- end -}}
{{- end -}}

{{/*
How one registering component (modelRegistry, datastore) reaches the directory it registers in,
as YAML: enabled (TLS), caSecret/caKey (the CA bundle the directory's certificate is checked
against), client (present a client certificate), certSecret/certKey/keyKey (that certificate).
For this release's directory, null values follow the directory's own TLS settings; for an
external one (directoryRegistration.endpoint), null means off.
(dict "root" $ "key" "modelRegistry")
*/}}
{{- define "cogment-aux.registrationTls" -}}
{{- $reg := .root.Values.directoryRegistration -}}
{{- $conf := $reg.tls -}}
{{- $own := include "cogment-aux.tls" . | fromYaml -}}
{{- $enabled := false -}}
{{- $client := false -}}
{{- $caSecret := $conf.caSecret -}}
{{- if not $reg.endpoint -}}
{{- $dir := include "cogment-aux.tls" (dict "root" .root "key" "directory") | fromYaml -}}
{{- $enabled = $dir.enabled -}}
{{- $client = $dir.mtls -}}
{{- $caSecret = $conf.caSecret | default $dir.secret -}}
{{- end -}}
{{- if kindIs "bool" $conf.enabled -}}
{{- $enabled = $conf.enabled -}}
{{- end -}}
{{- if kindIs "bool" $conf.clientCert.enabled -}}
{{- $client = $conf.clientCert.enabled -}}
{{- end -}}
{{- $cert := $conf.clientCert -}}
enabled: {{ $enabled }}
caSecret: {{ $caSecret | quote }}
caKey: {{ $conf.caKey | quote }}
client: {{ and $enabled $client }}
{{- if $cert.existingSecret }}
certSecret: {{ $cert.existingSecret | quote }}
certKey: {{ $cert.certKey | quote }}
keyKey: {{ $cert.keyKey | quote }}
{{- else }}
certSecret: {{ $own.secret | quote }}
certKey: {{ $own.certKey | quote }}
keyKey: {{ $own.keyKey | quote }}
{{- end }}
{{- end -}}

{{/*
Where the pods of one component are scheduled: its nodeSelector, tolerations, affinity (else the
podAntiAffinity preset) and topology spread constraints. (dict "root" $ "key" "directory")
*/}}
{{- define "cogment-aux.scheduling" -}}
{{- $values := index .root.Values .key -}}
{{- with $values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if $values.affinity }}
affinity:
  {{- toYaml $values.affinity | nindent 2 }}
{{- else if eq .root.Values.podAntiAffinity "soft" }}
affinity:
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "cogment-aux.componentSelectorLabels" . | nindent 14 }}
{{- else if eq .root.Values.podAntiAffinity "hard" }}
affinity:
  podAntiAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      - topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "cogment-aux.componentSelectorLabels" . | nindent 12 }}
{{- end }}
{{- with $values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
How the console reaches the services, as YAML: each one's endpoint (empty: the console discovers
it through the directory), and whether it speaks TLS to them, with which CA and client
certificate. An endpoint not given is this release's Service (for the directory, else
directoryRegistration.endpoint; none: empty); TLS (console.tls.enabled null) follows what the
release's Services it reaches serve, checked with the CA of tls.existingSecret, else of the first
of their own certificate Secrets: `mixed` when they differ, which one set of client settings
cannot reach (the console is then left out, and the install notes say why).
*/}}
{{- define "cogment-aux.consoleClient" -}}
{{- $root := . -}}
{{- $console := .Values.console -}}
{{- $conf := $console.tls -}}
{{- $given := dict "directory" $console.endpoints.directory "modelRegistry" $console.endpoints.modelRegistry "datastore" $console.endpoints.trialDatastore -}}
{{- $release := list -}}
{{- range $key := include "cogment-aux.componentKeys" . | fromJsonArray -}}
{{- if and (index $root.Values $key).enabled (not (index $given $key)) -}}
{{- $release = append $release $key -}}
{{- end -}}
{{- end -}}
{{- $enabled := false -}}
{{- $mtls := false -}}
{{- $mixed := false -}}
{{- $serviceSecret := "" -}}
{{- range $index, $key := $release -}}
{{- $tls := include "cogment-aux.tls" (dict "root" $root "key" $key) | fromYaml -}}
{{- if eq $index 0 -}}
{{- $enabled = $tls.enabled -}}
{{- $mtls = $tls.mtls -}}
{{- else if or (ne $tls.enabled $enabled) (ne $tls.mtls $mtls) -}}
{{- $mixed = true -}}
{{- end -}}
{{- if and $tls.enabled (not $serviceSecret) -}}
{{- $serviceSecret = $tls.secret -}}
{{- end -}}
{{- end -}}
{{- if kindIs "bool" $conf.enabled -}}
{{- $enabled = $conf.enabled -}}
{{- end -}}
{{- if kindIs "bool" $conf.clientCert.enabled -}}
{{- $mtls = $conf.clientCert.enabled -}}
{{- end -}}
{{- $scheme := ternary "grpcs" "grpc" $enabled -}}
endpoints:
{{- range $key := include "cogment-aux.componentKeys" . | fromJsonArray }}
{{- $values := index $root.Values $key }}
  {{ $key }}: {{ if index $given $key }}{{ index $given $key | quote }}{{ else if $values.enabled }}{{ printf "%s://%s:%v" $scheme (include "cogment-aux.serviceHost" (dict "root" $root "key" $key)) $values.service.port | quote }}{{ else if eq $key "directory" }}{{ $root.Values.directoryRegistration.endpoint | quote }}{{ else }}""{{ end }}
{{- end }}
tls: {{ $enabled }}
mixed: {{ $mixed }}
caSecret: {{ $conf.caSecret | default $root.Values.tls.existingSecret | default $serviceSecret | quote }}
caKey: {{ $conf.caKey | quote }}
client: {{ and $enabled $mtls }}
certSecret: {{ $conf.clientCert.existingSecret | default $root.Values.directoryRegistration.tls.clientCert.existingSecret | default $root.Values.tls.existingSecret | default $serviceSecret | quote }}
certKey: {{ $conf.clientCert.certKey | quote }}
keyKey: {{ $conf.clientCert.keyKey | quote }}
{{- end -}}

{{/* "true" when the console is deployed: enabled, and the services it reaches serve alike. */}}
{{- define "cogment-aux.consoleDeployed" -}}
{{- if and .Values.console.enabled (not (include "cogment-aux.consoleClient" . | fromYaml).mixed) -}}
true
{{- end -}}
{{- end -}}

{{/* The egress rules of every pod's NetworkPolicy: DNS, this release's pods, the extra ones. */}}
{{- define "cogment-aux.egressRules" -}}
# DNS.
- ports:
    - port: 53
      protocol: UDP
    - port: 53
      protocol: TCP
# This release's pods.
- to:
    - podSelector:
        matchLabels:
          {{- include "cogment-aux.selectorLabels" . | nindent 10 }}
{{- with .Values.networkPolicy.egress.extraEgress }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* An integer value as an environment variable string (no float formatting of large numbers). */}}
{{- define "cogment-aux.int" -}}
{{- . | int64 | toString | quote -}}
{{- end -}}

{{/*
Checks of the values that a schema cannot express; each failure is one clear message.
*/}}
{{- define "cogment-aux.validate" -}}
{{- $root := . -}}
{{- $db := .Values.database -}}
{{- if and (eq $db.type "postgresql") (not $db.postgresql.existingSecret) -}}
{{- fail "database.type=postgresql needs database.postgresql.existingSecret: the name of a Secret holding the database URL (key database.postgresql.urlKey)" -}}
{{- end -}}
{{- range $key := include "cogment-aux.componentKeys" . | fromJsonArray -}}
{{- $values := index $root.Values $key -}}
{{- if $values.enabled -}}
{{- $replicas := int $values.replicaCount -}}
{{- if and (gt $replicas 1) (eq $db.type "sqlite") -}}
{{- fail (printf "%s.replicaCount=%d is refused with database.type=sqlite: the embedded SQLite database lives on one ReadWriteOnce volume and serves a single replica. To scale out, set database.type=postgresql and database.postgresql.existingSecret (see ci/scale-out-values.yaml)" $key $replicas) -}}
{{- end -}}
{{- if and (eq $key "modelRegistry") (gt $replicas 1) (eq $values.storage.type "local") -}}
{{- fail (printf "modelRegistry.replicaCount=%d is refused with modelRegistry.storage.type=local: the version data lives on one ReadWriteOnce volume of one replica. To scale out, set modelRegistry.storage.type=s3 with modelRegistry.storage.s3.endpoint" $replicas) -}}
{{- end -}}
{{- $tls := include "cogment-aux.tls" (dict "root" $root "key" $key) | fromYaml -}}
{{- if and $tls.enabled (not $tls.secret) -}}
{{- fail (printf "TLS is enabled for %s but no certificate Secret is set: set tls.existingSecret (or %s.tls.existingSecret)" $key $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $s3 := .Values.modelRegistry.storage.s3 -}}
{{- if and .Values.modelRegistry.enabled (eq .Values.modelRegistry.storage.type "s3") -}}
{{- if not $s3.endpoint -}}
{{- fail "modelRegistry.storage.type=s3 needs modelRegistry.storage.s3.endpoint (host:port of the S3 server)" -}}
{{- end -}}
{{- end -}}
{{- $probes := .Values.probes -}}
{{- range $key := include "cogment-aux.componentKeys" . | fromJsonArray -}}
{{- $values := index $root.Values $key -}}
{{- if and $values.enabled (eq (int $probes.healthPort) (int $values.port)) -}}
{{- fail (printf "probes.healthPort=%d is also %s.port: the plaintext health service needs a port of its own" (int $probes.healthPort) $key) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.metrics.enabled (eq (int $probes.healthPort) (int .Values.metrics.port)) -}}
{{- fail (printf "probes.healthPort=%d is also metrics.port: the plaintext health service needs a port of its own" (int $probes.healthPort)) -}}
{{- end -}}
{{- if .Values.console.enabled -}}
{{- $client := include "cogment-aux.consoleClient" . | fromYaml -}}
{{- if and $client.tls (not $client.caSecret) -}}
{{- fail "the console reaches the services over TLS but has no CA to check their certificates with: set console.tls.caSecret (a Secret holding the PEM CA bundle, key console.tls.caKey) or tls.existingSecret" -}}
{{- end -}}
{{- if and $client.client (not $client.certSecret) -}}
{{- fail "the console reaches services that require client certificates but has no certificate: set console.tls.clientCert.existingSecret (a kubernetes.io/tls Secret whose certificate allows client authentication)" -}}
{{- end -}}
{{- end -}}
{{- $reg := .Values.directoryRegistration -}}
{{- $endpoint := include "cogment-aux.directoryEndpoint" . -}}
{{- if $endpoint -}}
{{- range $key := list "modelRegistry" "datastore" -}}
{{- if (index $root.Values $key).enabled -}}
{{- $regTls := include "cogment-aux.registrationTls" (dict "root" $root "key" $key) | fromYaml -}}
{{- if not $reg.endpoint -}}
{{- $dirTls := include "cogment-aux.tls" (dict "root" $root "key" "directory") | fromYaml -}}
{{- if ne $regTls.enabled $dirTls.enabled -}}
{{- fail (printf "directoryRegistration.tls.enabled=%v, but this release's directory %s: leave directoryRegistration.tls.enabled null to follow it" $reg.tls.enabled (ternary "serves TLS" "is plaintext" $dirTls.enabled)) -}}
{{- end -}}
{{- if and $dirTls.mtls (not $regTls.client) -}}
{{- fail "directoryRegistration.tls.clientCert.enabled=false, but this release's directory requires client certificates (tls.clientCA.enabled): leave it null to follow the directory" -}}
{{- end -}}
{{- end -}}
{{- if and (eq (toString $reg.tls.clientCert.enabled) "true") (not $regTls.enabled) -}}
{{- fail "directoryRegistration.tls.clientCert.enabled=true needs TLS to the directory: a client certificate is only presented over TLS (directoryRegistration.tls.enabled)" -}}
{{- end -}}
{{- if and $regTls.enabled (not $regTls.caSecret) -}}
{{- fail "directoryRegistration.tls.enabled with directoryRegistration.endpoint needs directoryRegistration.tls.caSecret: a Secret holding the CA bundle the directory's certificate is checked against (key directoryRegistration.tls.caKey)" -}}
{{- end -}}
{{- if and $regTls.client (not $regTls.certSecret) -}}
{{- fail (printf "%s registers in a directory that requires client certificates, but has no certificate Secret of its own: set directoryRegistration.tls.clientCert.existingSecret (a kubernetes.io/tls Secret whose certificate allows client authentication)" $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The series of this release, as its ServiceMonitors scrape them: the release's namespace, and a
job per Service (the Prometheus Operator names a job after the Service it scrapes).
metrics.prometheusRule.selector replaces it for other scrape configurations.
*/}}
{{- define "cogment-aux.seriesSelector" -}}
{{- if .Values.metrics.prometheusRule.selector -}}
{{- .Values.metrics.prometheusRule.selector -}}
{{- else -}}
{{- $root := . -}}
{{- $jobs := list -}}
{{- range $key := include "cogment-aux.componentKeys" . | fromJsonArray -}}
{{- if (index $root.Values $key).enabled -}}
{{- $jobs = append $jobs (include "cogment-aux.componentName" (dict "root" $root "key" $key)) -}}
{{- end -}}
{{- end -}}
{{- printf "namespace=%q, job=~%q" .Release.Namespace (join "|" $jobs) -}}
{{- end -}}
{{- end -}}

{{/*
PromQL true for each group (dict "series" "window" "by") whose counter counted events in the last
`window`: an increase, or a series that appeared within it. A series is exported from its first
event on, with that event in its first value, which increase() alone never sees. (Two filters
joined by `or`: `or` of the raw series would drop the new ones, its matching ignores names.)
*/}}
{{- define "cogment-aux.eventsWithin" -}}
(sum by ({{ .by }}) (increase({{ .series }}[{{ .window }}])) > 0) or (sum by ({{ .by }}) ({{ .series }} unless {{ .series }} offset {{ .window }}) > 0)
{{- end -}}
