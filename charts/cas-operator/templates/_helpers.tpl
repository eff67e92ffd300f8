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
# Every write below is bounded further by the ValidatingAdmissionPolicy <release>-own-objects
# (templates/admission-policy.yaml): only objects labelled as a fleet's with one controller
# ownerReference to that CodingAgentServing, in the shapes the operator makes.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, watch, create, patch, delete]
# listed by label when an older revision retires
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, create, patch, delete]
# the plan ConfigMap (applied) and the prefill-gone feed (read, then written with its
# resourceVersion); never listed, so no other ConfigMap is read but by name
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, create, patch, update]
# each fleet's keys Secret, read by name and made when missing, and the copies of its versions
# the fleet's pods take (made, and deleted by name once no revision runs with them): never
# list or watch (other Secrets)
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create, delete]
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
# each fleet's NetworkPolicies (server-side apply, deleted when the spec turns them off)
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch, delete]
# spec.gateway: the fleet's HTTPRoute (server-side apply; deleted when the spec drops it), or
# the weights of the user's HTTPRoute it names (read, then written with its resourceVersion)
- apiGroups: [gateway.networking.k8s.io]
  resources: [httproutes]
  verbs: [get, create, patch, update, delete]
# each fleet's router reads its pods through a ServiceAccount, Role and RoleBinding the operator
# makes (it holds what it grants; no bind or escalate verb); removed with the fleet by the
# garbage collector, never by the operator
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, create, patch]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, create, patch]
{{- end -}}
