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

{{- /*
The one namespace the router routes, or "" for every namespace: router.watchNamespace, else
the operator's watchNamespace, so that a namespaced release is confined as a whole.
*/ -}}
{{- define "npufleet.routerWatchNamespace" -}}
{{- .Values.router.watchNamespace | default .Values.watchNamespace -}}
{{- end -}}

{{- define "npufleet.routerSelectorLabels" -}}
app.kubernetes.io/name: npufleet-router
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- /*
"true" when this release serves external.metrics.k8s.io itself: externalMetrics.enabled, and
v1beta1.external.metrics.k8s.io is not already registered by something other than this release
(CCE's monitoring add-on's prometheus-adapter, KEDA). Only one server can own that API in a
cluster; taking it over would cut the other server's HPAs off, so the chart leaves it alone.
`helm template` cannot look (lookup returns nothing offline) and renders the chart's own.
*/ -}}
{{- define "npufleet.servesExternalMetrics" -}}
{{- if .Values.externalMetrics.enabled -}}
{{- $existing := lookup "apiregistration.k8s.io/v1" "APIService" "" "v1beta1.external.metrics.k8s.io" -}}
{{- $owner := dig "metadata" "annotations" "meta.helm.sh/release-name" "" ($existing | default dict) -}}
{{- $ownerNamespace := dig "metadata" "annotations" "meta.helm.sh/release-namespace" "" ($existing | default dict) -}}
{{- if or (not $existing) (and (eq $owner .Release.Name) (eq $ownerNamespace .Release.Namespace)) -}}
true
{{- end -}}
{{- end -}}
{{- end -}}

{{- /*
The name of an object outside the release namespace (cluster-scoped, or in kube-system) that
releases in several namespaces may each make: "<release namespace>.<release>-<suffix>", from
(list $ "suffix"). Namespaces hold no dots, so no two releases' names can meet, whatever
their names.
*/ -}}
{{- define "npufleet.outsideName" -}}
{{- $top := index . 0 -}}
{{- printf "%s.%s-%s" $top.Release.Namespace $top.Release.Name (index . 1) -}}
{{- end -}}
