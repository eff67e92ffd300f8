{{- define "cas-operator.labels" -}}
app.kubernetes.io/name: cas-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: cas-operator
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}
{{/* The Deployment's selector is immutable: never add to it (an upgrade would fail). */}}
{{- define "cas-operator.selector" -}}
app.kubernetes.io/name: cas-operator
{{- end -}}
{{/* The operator's identity, as the API server names it (RBAC subjects, the admission policy). */}}
{{- define "cas-operator.username" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ .Release.Name }}
{{- end -}}
{{/*
Exactly the namespaced verbs the operator uses (operator/cas_operator/kube.py and kopf), granted
per watched namespace (Roles) or cluster-wide (ClusterRole) when watchNamespaces is empty.
*/}}
{{- define "cas-operator.namespacedRules" -}}
- apiGroups: [serving.cas.dev]
  resources: [codingagentservings]
  verbs: [get, list, watch, patch]
- apiGroups: [serving.cas.dev]
  resources: [codingagentservings/status]
  verbs: [patch]
# children carry blockOwnerDeletion owner references (OwnerReferencesPermissionEnforcement)
- apiGroups: [serving.cas.dev]
  resources: [codingagentservings/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [""]
  resources: [services, configmaps, serviceaccounts]
  verbs: [get, list, watch, create, patch, update, delete]
# each fleet's keys Secret, read by name and made once: never list or watch (other Secrets)
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
# labels and annotations of its own pods only: see the ValidatingAdmissionPolicy
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, patch, delete]
- apiGroups: [""]
  resources: [pods/eviction]  # drains and replacements go through the Eviction API
  verbs: [create]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, update, delete]
# each fleet's NetworkPolicies (server-side apply, deleted when the spec turns them off)
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch, delete]
# spec.gateway: the fleet's HTTPRoute (server-side apply; deleted when the spec drops it), or
# the weights of the user's HTTPRoute it names (read, then written with its resourceVersion)
- apiGroups: [gateway.networking.k8s.io]
  resources: [httproutes]
  verbs: [get, create, patch, update, delete]
# each fleet's router reads its pods through a Role the operator makes (it holds what it grants)
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, watch, create, patch, update, delete]
{{- end -}}
