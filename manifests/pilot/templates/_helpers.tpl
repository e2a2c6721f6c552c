{{/* Common labels of every object of the chart. */}}
{{- define "pilot.labels" -}}
app.kubernetes.io/name: isthmus-pilot
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: isthmus
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* Labels selecting pilot's pods. */}}
{{- define "pilot.selector" -}}
app: isthmusd
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Name of cluster-scoped objects: unique per control-plane namespace. */}}
{{- define "pilot.clusterName" -}}
isthmusd-{{ .Release.Namespace }}
{{- end }}

{{- define "pilot.image" -}}
{{ .Values.image.registry }}/{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The exec allowlist file (multicluster.ParseExecAllowlist's format). */}}
{{- define "pilot.execAllowlist" -}}
commands:
{{- range .Values.execAllowlist }}
  - command: {{ .command | quote }}
    {{- with .args }}
    args:
      {{- range . }}
      - {{ . | quote }}
      {{- end }}
    {{- end }}
    {{- with .env }}
    env:
      {{- range . }}
      - {{ . | quote }}
      {{- end }}
    {{- end }}
{{- end }}
{{- end }}

{{/*
pilot.gatewayRules: remotesecret.GatewayRules, what pilot writes for each
Gateway of class isthmus-east-west (manifests/charts_test.go compares them).
*/}}
{{- define "pilot.gatewayRules" -}}
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, create, update, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [create, update, patch, delete]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [create, update, patch, delete]
{{- end }}
