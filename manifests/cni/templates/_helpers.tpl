{{/* Common labels of every object of the chart. */}}
{{- define "cni.labels" -}}
app.kubernetes.io/name: isthmus-cni
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: isthmus
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* Labels selecting the chart's pods. */}}
{{- define "cni.selector" -}}
app: isthmus-cni
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "cni.image" -}}
{{ .Values.image.registry }}/{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* Cluster-scoped names carry the namespace: two installs do not collide. */}}
{{- define "cni.clusterName" -}}
isthmus-cni-{{ .Release.Namespace }}
{{- end }}
