{{/* Labels every object carries; `component` is service, gateway or envoy. */}}
{{- define "forge.labels" -}}
app.kubernetes.io/name: forge
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/component: {{ .component }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end }}

{{- define "forge.selector" -}}
app.kubernetes.io/name: forge
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The Secret holding the API keys, or "" when none is used. */}}
{{- define "forge.secretName" -}}
{{- if .Values.auth.existingSecret -}}
{{ .Values.auth.existingSecret }}
{{- else if or .Values.auth.apiKey .Values.auth.grpcApiKey -}}
{{ .Release.Name }}-keys
{{- end -}}
{{- end }}

{{/* The hardened security context every container runs with (read-only root filesystem). */}}
{{- define "forge.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: [ALL]}
{{- end }}
