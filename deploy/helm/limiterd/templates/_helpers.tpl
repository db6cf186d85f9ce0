{{/*
The labels every object carries besides its own: those of deploy/k8s/base
(app.kubernetes.io/part-of) and Helm's.
*/}}
{{- define "limiterd.labels" -}}
app.kubernetes.io/part-of: limiterd
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{/* An image reference: repository@digest, or repository:tag. */}}
{{- define "limiterd.image" -}}
{{- if .image.digest -}}
{{ .image.repository }}@{{ .image.digest }}
{{- else -}}
{{ .image.repository }}:{{ .image.tag | default .appVersion }}
{{- end -}}
{{- end }}

{{/* The values every region must set, checked once. */}}
{{- define "limiterd.required" -}}
{{- $_ := required "region is required: this region's name, as in the topology" .Values.region -}}
{{- $_ := required "redis.addrs is required: the region's Redis Cluster nodes" .Values.redis.addrs -}}
{{- $_ := required "nats.url is required: the region's NATS servers" .Values.nats.url -}}
{{- $_ := required "regionalService.hostname is required: the name other regions reach this limiterd at" .Values.regionalService.hostname -}}
{{- if lt (int .Values.fleet.maxReplicas) (int .Values.fleet.size) -}}
{{- fail (printf "fleet.maxReplicas (%v) is below fleet.size (%v)" .Values.fleet.maxReplicas .Values.fleet.size) -}}
{{- end -}}
{{- if not .Values.topology.regions -}}
{{- fail "topology.regions is required: every region and its limiter_address" -}}
{{- end -}}
{{- $found := false -}}
{{- range .Values.topology.regions -}}
{{- if eq .name $.Values.region -}}{{- $found = true -}}{{- end -}}
{{- end -}}
{{- if not $found -}}
{{- fail (printf "region %q is not in topology.regions" .Values.region) -}}
{{- end -}}
{{- end }}

{{/* A digest of the region ConfigMap's data, for the pods' annotation. */}}
{{- define "limiterd.regionSum" -}}
{{- list .Values.region .Values.fleet.size .Values.redis.addrs .Values.nats.url | toJson | sha256sum -}}
{{- end }}
