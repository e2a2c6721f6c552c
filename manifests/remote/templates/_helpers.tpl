{{/* Common labels of every object of the chart. */}}
{{- define "remote.labels" -}}
app.kubernetes.io/name: isthmus-remote
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: isthmus
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}
