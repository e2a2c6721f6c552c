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

{{- /*
terminationGracePeriodSeconds: the drain (drain.handoffWaitSeconds +
drain.graceSeconds) plus 10 s for the rest of the stop, unless a longer one
is set; a shorter one is refused.
*/ -}}
{{- define "eastwest.terminationGracePeriod" -}}
{{- $min := add (int .Values.drain.handoffWaitSeconds) (int .Values.drain.graceSeconds) 10 -}}
{{- $set := int .Values.terminationGracePeriodSeconds -}}
{{- if eq $set 0 -}}
{{- $min -}}
{{- else if lt $set (int $min) -}}
{{- fail (printf "terminationGracePeriodSeconds %d is shorter than the drain: drain.handoffWaitSeconds + drain.graceSeconds + 10 = %d" $set (int $min)) -}}
{{- else -}}
{{- $set -}}
{{- end -}}
{{- end -}}
