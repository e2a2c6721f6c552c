{{/* Common labels of every object of the chart. */}}
{{- define "ztunnel.labels" -}}
app.kubernetes.io/name: isthmus-ztunnel
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: isthmus
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* Labels selecting the chart's pods. */}}
{{- define "ztunnel.selector" -}}
app: ztunnel
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "ztunnel.image" -}}
{{ .Values.image.registry }}/{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "ztunnel.xdsAddress" -}}
{{- if .Values.xdsAddressRequired -}}
{{ required "xdsAddress is required: pilot runs in another cluster (profile remote)" .Values.xdsAddress }}
{{- else -}}
{{ .Values.xdsAddress | default (printf "isthmusd.%s.svc:15012" .Release.Namespace) }}
{{- end -}}
{{- end }}

{{/* The pod template, shared by the DaemonSet and the Deployment. */}}
{{- /*
terminationGracePeriodSeconds: the drain (drain.handoffWaitSeconds +
drain.graceSeconds) plus 10 s for the rest of the stop, unless a longer one
is set; a shorter one is refused.
*/ -}}
{{- define "ztunnel.terminationGracePeriod" -}}
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

{{- define "ztunnel.podTemplate" -}}
metadata:
  labels:
    {{- include "ztunnel.selector" . | nindent 4 }}
    {{- with .Values.network }}
    topology.istio.io/network: {{ . | quote }}
    {{- end }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    prometheus.io/scrape: "true"
    prometheus.io/port: {{ .Values.ports.metrics | quote }}
    {{- with .Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ .Values.serviceAccount.name }}
  hostNetwork: false
  terminationGracePeriodSeconds: {{ include "ztunnel.terminationGracePeriod" . }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- range . }}
    - name: {{ . }}
    {{- end }}
  {{- end }}
  containers:
    - name: ztunnel
      image: {{ include "ztunnel.image" . | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      args:
        - --mode={{ .Values.mode }}
        - --node=$(NODE_NAME)
        - --cluster-id={{ required "clusterID is required" .Values.clusterID }}
        {{- with .Values.network }}
        - --network={{ . }}
        {{- end }}
        - --trust-domain={{ .Values.trustDomain }}
        - --xds-address={{ include "ztunnel.xdsAddress" . }}
        - --ca-address={{ include "ztunnel.xdsAddress" . }}
        - --ca-token=/var/run/secrets/tokens/isthmus-token
        - --root-cert=/var/run/secrets/isthmus/root-cert.pem
        - --trust-bundle=/var/run/secrets/isthmus/trust-bundle.json
        - --hbone-port={{ .Values.ports.hbone }}
        {{- if eq .Values.mode "node" }}
        {{- if .Values.inpod.enabled }}
        - --inpod-socket={{ .Values.inpod.socketDir }}/ztunnel.sock
        - --outbound-addr=none
        - --socks5-addr=none
        {{- else }}
        - --outbound-addr=:{{ .Values.ports.outbound }}
        - --socks5-addr=:{{ .Values.ports.socks5 }}
        {{- end }}
        - --handoff-wait={{ .Values.drain.handoffWaitSeconds }}s
        - --drain-grace={{ .Values.drain.graceSeconds }}s
        - --pod-dns={{ .Values.dns.podDNS }}
        {{- range .Values.dns.upstreams }}
        - --dns-upstream={{ . }}
        {{- end }}
        {{- end }}
        - --access-log={{ .Values.accessLog.enabled }}
        - --access-log-rate={{ .Values.accessLog.rate }}
        - --access-log-burst={{ .Values.accessLog.burst }}
        - --readiness-addr=:{{ .Values.ports.readiness }}
        - --metrics-addr=:{{ .Values.ports.metrics }}
        - --admin-addr={{ .Values.adminAddr }}
        {{- range .Values.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      env:
        - name: NODE_NAME
          valueFrom:
            fieldRef:
              fieldPath: spec.nodeName
        - name: POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        - name: POD_NAMESPACE
          valueFrom:
            fieldRef:
              fieldPath: metadata.namespace
        - name: INSTANCE_IP
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        # The node's addresses are never a source identity or destination.
        - name: HOST_IPS
          valueFrom:
            fieldRef:
              fieldPath: status.hostIPs
        {{- with .Values.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: tls-hbone
          containerPort: {{ .Values.ports.hbone }}
          protocol: TCP
        {{- if and (eq .Values.mode "node") (not .Values.inpod.enabled) }}
        - name: tcp-outbound
          containerPort: {{ .Values.ports.outbound }}
          protocol: TCP
        - name: tcp-socks5
          containerPort: {{ .Values.ports.socks5 }}
          protocol: TCP
        {{- end }}
        - name: http-ready
          containerPort: {{ .Values.ports.readiness }}
          protocol: TCP
        - name: http-metrics
          containerPort: {{ .Values.ports.metrics }}
          protocol: TCP
      readinessProbe:
        httpGet:
          path: /healthz/ready
          port: {{ .Values.ports.readiness }}
        {{- toYaml .Values.readinessProbe | nindent 8 }}
      {{- with .Values.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with (ternary .Values.inpod.securityContext .Values.securityContext (and (eq .Values.mode "node") .Values.inpod.enabled)) }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: isthmus-token
          mountPath: /var/run/secrets/tokens
          readOnly: true
        - name: isthmus-root-cert
          mountPath: /var/run/secrets/isthmus
          readOnly: true
        {{- if and (eq .Values.mode "node") .Values.inpod.enabled }}
        - name: cni-sockets
          mountPath: {{ .Values.inpod.socketDir }}
        {{- end }}
  volumes:
    {{- if and (eq .Values.mode "node") .Values.inpod.enabled }}
    - name: cni-sockets
      hostPath:
        path: {{ .Values.inpod.socketDir }}
        type: DirectoryOrCreate
    {{- end }}
    - name: isthmus-token
      projected:
        sources:
          - serviceAccountToken:
              path: isthmus-token
              audience: {{ .Values.caAudience }}
              expirationSeconds: 43200
    - name: isthmus-root-cert
      configMap:
        name: {{ .Values.rootCertConfigMap }}
        optional: true
        items:
          - key: root-cert.pem
            path: root-cert.pem
          - key: trust-bundle.json
            path: trust-bundle.json
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with (ternary .Values.tolerations .Values.gateway.tolerations (eq .Values.mode "node")) }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
