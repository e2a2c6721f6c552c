{{/* Common labels of every object of the chart. */}}
{{- define "eastwest.labels" -}}
app.kubernetes.io/name: isthmus-eastwest-gateway
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: isthmus
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* Labels selecting the gateway pods. */}}
{{- define "eastwest.selector" -}}
app: {{ .Values.name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}
