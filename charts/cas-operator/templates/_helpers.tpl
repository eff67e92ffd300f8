{{- define "cas-operator.labels" -}}
app.kubernetes.io/name: cas-operator
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: cas-operator
{{- end -}}
{{- define "cas-operator.selector" -}}
app.kubernetes.io/name: cas-operator
{{- end -}}
