{{- define "npufleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "npufleet.labels" -}}
app.kubernetes.io/name: npufleet-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "npufleet.selectorLabels" -}}
app.kubernetes.io/name: npufleet-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "npufleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "npufleet.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "npufleet.routerLabels" -}}
app.kubernetes.io/name: npufleet-router
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "npufleet.routerSelectorLabels" -}}
app.kubernetes.io/name: npufleet-router
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
