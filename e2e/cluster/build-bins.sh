#!/usr/bin/env bash
# Build (or reuse) the binaries of the local Kubernetes stack from Go modules.
#
# Data flow: e2e/cluster/versions.env (pinned versions) -> wrapper Go modules under
# $CAS_BUILD_DIR -> binaries under $CAS_BIN_DIR/<component>-<version>/, which
# e2e/cluster/bins.py resolves for the harness.
# A component directory is complete only when its ".complete" stamp exists; anything else is
# rebuilt. Set CAS_KUBECONFIG to use a cluster of your own (kind, k3d, real): nothing is built.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=e2e/cluster/versions.env
source "${HERE}/versions.env"

BIN_DIR="${CAS_BIN_DIR:-${HOME}/.cache/cas-operator/bin}"
BUILD_DIR="${CAS_BUILD_DIR:-${HOME}/.cache/cas-operator/build}"
START=$(date +%s)
BUILT=0

if [[ -n "${CAS_KUBECONFIG:-}" ]]; then
  echo "build-bins: CAS_KUBECONFIG is set (${CAS_KUBECONFIG}); using that cluster, nothing to build"
  exit 0
fi
command -v go >/dev/null || { echo "build-bins: 'go' not found on PATH (need Go >= 1.26)" >&2; exit 1; }

export CGO_ENABLED=0
export GOFLAGS="-trimpath -buildvcs=false"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
# -mod=mod: the wrapper's go.sum is completed by the build itself. ("go get <package>" would also
# ask the proxy for a module named like the package, which some proxies refuse with 403.)
GOBUILD=(go build -p 2 -mod=mod)

log() { printf 'build-bins: [%4ss] %s\n' "$(( $(date +%s) - START ))" "$*"; }

# have <dir> <file>...: true when <dir> is stamped complete and holds every named file.
have() {
  local dir=$1; shift
  [[ -f "${dir}/.complete" ]] || return 1
  local f
  for f in "$@"; do [[ -x "${dir}/${f}" || -f "${dir}/${f}" ]] || return 1; done
}

# quiet <logfile> <cmd>...: run a command with its output in <logfile>; show the tail on failure.
quiet() {
  local logfile=$1; shift
  if ! "$@" >>"${logfile}" 2>&1; then
    echo "build-bins: failed: $* (last lines of ${logfile}):" >&2
    tail -n 30 "${logfile}" >&2
    exit 1
  fi
}

# wrapper_module <workdir> <module path> : start a fresh wrapper go.mod in <workdir>.
wrapper_module() {
  local work=$1 name=$2
  rm -rf "${work}" && mkdir -p "${work}"
  (cd "${work}" && go mod init "${name}" >/dev/null 2>&1)
}

# ---- Kubernetes: apiserver, controller-manager, scheduler, kubectl, kube-proxy --------------
# A complete cache that lacks a binary added later (kube-proxy) builds just that one, in the
# wrapper module it was resolved in.
build_kubernetes() {
  local v=${KUBERNETES_VERSION} out="${BIN_DIR}/kubernetes-${KUBERNETES_VERSION}"
  local bins=(kube-apiserver kube-controller-manager kube-scheduler kubectl kube-proxy)
  if have "${out}" "${bins[@]}"; then log "kubernetes ${v}: cached in ${out}"; return; fi
  local work="${BUILD_DIR}/kubernetes-${v}" need=() b
  if [[ -f "${out}/.complete" && -f "${work}/go.sum" ]]; then
    for b in "${bins[@]}"; do [[ -x "${out}/${b}" ]] || need+=("${b}"); done
    log "kubernetes ${v}: cached except ${need[*]}"
  else
    need=("${bins[@]}")
    rm -f "${out}/.complete"
    resolve_kubernetes "${work}"
  fi
  local minor=${v#v1.}; minor=${minor%%.*}
  # buildDate: the release time the module proxy records (reproducible), else now.
  local date info
  info=$(go mod download -json "k8s.io/kubernetes@${v}" \
    | sed -n 's/^[[:space:]]*"Info": "\(.*\)",\{0,1\}$/\1/p')
  date=$(sed -n 's/.*"Time":"\([^"]*\)".*/\1/p' "${info}" 2>/dev/null || true)
  [[ -n "${date}" ]] || date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  local ld="-s -w" key val
  for kv in "gitVersion=${v}" "gitMajor=1" "gitMinor=${minor}" "gitTreeState=clean" \
            "buildDate=${date}"; do
    key=${kv%%=*}; val=${kv#*=}
    ld+=" -X k8s.io/component-base/version.${key}=${val}"
    ld+=" -X k8s.io/client-go/pkg/version.${key}=${val}"
  done
  mkdir -p "${out}"
  for b in "${need[@]}"; do
    log "kubernetes ${v}: building ${b}"
    (cd "${work}" && "${GOBUILD[@]}" -ldflags "${ld}" -o "${out}/${b}" "k8s.io/kubernetes/cmd/${b}")
    log "kubernetes ${v}: ${b} done"
  done
  touch "${out}/.complete"; BUILT=1
}

# resolve_kubernetes <workdir>: the wrapper module requiring k8s.io/kubernetes, with the staging
# modules its go.mod replaces by ./staging/... replaced by their published versions.
resolve_kubernetes() {
  local v=${KUBERNETES_VERSION} work=$1
  wrapper_module "${work}" casbuild/kubernetes
  log "kubernetes ${v}: resolving the module and its staging replacements"
  local gomod
  gomod=$(go mod download -json "k8s.io/kubernetes@${v}" \
    | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')
  [[ -f "${gomod}" ]] || { echo "build-bins: no go.mod for k8s.io/kubernetes@${v}" >&2; exit 1; }
  # Staging modules are "k8s.io/X => ./staging/src/k8s.io/X" in the module's own go.mod;
  # each is published as k8s.io/X v0.<minor>.<patch>.
  local staging_v="v0.${v#v1.}"
  local mods
  mods=$(sed -n 's#^[[:space:]]*\(k8s\.io/[^[:space:]]*\)[[:space:]]*=>[[:space:]]*\./staging/.*#\1#p' \
    "${gomod}" | sort -u)
  [[ -n "${mods}" ]] || { echo "build-bins: no staging replaces found in ${gomod}" >&2; exit 1; }
  {
    echo "require k8s.io/kubernetes ${v}"
    echo "replace ("
    local m
    for m in ${mods}; do echo "	${m} => ${m} ${staging_v}"; done
    echo ")"
  } >>"${work}/go.mod"
  log "kubernetes ${v}: $(echo "${mods}" | wc -l) staging modules replaced by ${staging_v}"
  (cd "${work}" && quiet "${work}/resolve.log" go get "k8s.io/kubernetes@${v}")
}

# ---- etcd: a wrapper main around etcdmain (the root module carries replace directives) -----
build_etcd() {
  local v=${ETCD_VERSION} out="${BIN_DIR}/etcd-${ETCD_VERSION}"
  if have "${out}" etcd; then log "etcd ${v}: cached in ${out}"; return; fi
  local work="${BUILD_DIR}/etcd-${v}"
  wrapper_module "${work}" casbuild/etcd
  cat >"${work}/main.go" <<'GO'
// Command etcd runs the etcd server; it exists because etcd's root module cannot be built
// with "go install" (it carries replace directives).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
  log "etcd ${v}: resolving"
  (cd "${work}" && quiet "${work}/resolve.log" go get "go.etcd.io/etcd/server/v3@${v}" \
    && quiet "${work}/resolve.log" go mod tidy)
  log "etcd ${v}: building etcd"
  mkdir -p "${out}"
  (cd "${work}" && "${GOBUILD[@]}" -ldflags "-s -w" -o "${out}/etcd" .)
  touch "${out}/.complete"; BUILT=1
  log "etcd ${v}: done"
}

# build_module_main <name> <module> <version> <package> <binary>: build a main package of a
# module that has no replace directives, at exactly the versions its own go.mod selects.
build_module_main() {
  local name=$1 mod=$2 v=$3 pkg=$4 bin=$5 out="${BIN_DIR}/$1-$3"
  local work="${BUILD_DIR}/${name}-${v}"
  wrapper_module "${work}" "casbuild/${name}"
  log "${name} ${v}: resolving"
  (cd "${work}" && quiet "${work}/resolve.log" go get "${mod}@${v}")
  log "${name} ${v}: building ${bin}"
  mkdir -p "${out}"
  (cd "${work}" && "${GOBUILD[@]}" -ldflags "-s -w" -o "${out}/${bin}" "${pkg}")
  log "${name} ${v}: ${bin} done"
}

build_kwok() {
  local out="${BIN_DIR}/kwok-${KWOK_VERSION}"
  if have "${out}" kwok stages/node-initialize.yaml; then
    log "kwok ${KWOK_VERSION}: cached in ${out}"; return
  fi
  build_module_main kwok sigs.k8s.io/kwok "${KWOK_VERSION}" sigs.k8s.io/kwok/cmd/kwok kwok
  # The standalone kwok binary has no built-in stages (kwokctl embeds them); keep the module's
  # default node and pod stages next to the binary for e2e/cluster/stack.py to pass via --config.
  local src
  src=$(go mod download -json "sigs.k8s.io/kwok@${KWOK_VERSION}" \
    | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
  rm -rf "${out}/stages" && mkdir -p "${out}/stages"
  cp "${src}"/kustomize/stage/node/fast/node-initialize.yaml \
     "${src}"/kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
     "${src}"/kustomize/stage/pod/fast/pod-{ready,complete,delete}.yaml "${out}/stages/"
  chmod u+w "${out}"/stages/*.yaml
  log "kwok ${KWOK_VERSION}: copied $(ls "${out}/stages" | wc -l) default stages"
  touch "${out}/.complete"; BUILT=1
}

build_lws() {
  local out="${BIN_DIR}/lws-${LWS_VERSION}"
  if have "${out}" lws-controller-manager crds webhook/manifests.yaml; then
    log "lws ${LWS_VERSION}: cached in ${out}"; return
  fi
  build_module_main lws sigs.k8s.io/lws "${LWS_VERSION}" sigs.k8s.io/lws/cmd lws-controller-manager
  local src
  src=$(go mod download -json "sigs.k8s.io/lws@${LWS_VERSION}" \
    | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
  rm -rf "${out}/crds" && mkdir -p "${out}/crds"
  cp "${src}"/config/crd/bases/*.yaml "${out}/crds/"
  # The webhook manifests and their kustomize patches: the harness points them at the
  # controller's webhook server on loopback (e2e/cluster/stack.py).
  rm -rf "${out}/webhook" && mkdir -p "${out}/webhook"
  cp "${src}"/config/webhook/{manifests,mutating-patch,validating-patch}.yaml "${out}/webhook/"
  chmod u+w "${out}"/crds/*.yaml "${out}"/webhook/*.yaml
  log "lws ${LWS_VERSION}: copied $(ls "${out}/crds" | wc -l) CRD manifests"
  touch "${out}/.complete"; BUILT=1
}

# ---- Traefik (Gateway API implementation) and the Gateway API CRDs ----------------------------
# Traefik's go.mod carries replace directives, so it is built as the main module from a writable
# copy of its module source. The CRDs (standard channel) come from the module cache too, at the
# sigs.k8s.io/gateway-api version Traefik requires (checked against versions.env).
build_traefik() {
  local v=${TRAEFIK_VERSION} gv=${GATEWAY_API_VERSION} out="${BIN_DIR}/traefik-${TRAEFIK_VERSION}"
  if have "${out}" traefik gateway-crds/gateway.networking.k8s.io_httproutes.yaml; then
    log "traefik ${v}: cached in ${out}"; return
  fi
  local work="${BUILD_DIR}/traefik-${v}" src gw
  log "traefik ${v}: resolving"
  src=$(go mod download -json "github.com/traefik/traefik/v3@${v}" \
    | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
  [[ -d "${src}" ]] || { echo "build-bins: no source for traefik ${v}" >&2; exit 1; }
  grep -q "sigs.k8s.io/gateway-api ${gv}\$" "${src}/go.mod" || {
    echo "build-bins: traefik ${v} does not require sigs.k8s.io/gateway-api ${gv}" >&2; exit 1; }
  if [[ ! -f "${work}/go.mod" ]]; then
    rm -rf "${work}" && cp -r "${src}" "${work}" && chmod -R u+w "${work}"
  fi
  log "traefik ${v}: building traefik"
  mkdir -p "${out}"
  (cd "${work}" && "${GOBUILD[@]}" \
    -ldflags "-s -w -X github.com/traefik/traefik/v3/pkg/version.Version=${v}" \
    -o "${out}/traefik" ./cmd/traefik)
  log "traefik ${v}: traefik done"
  gw=$(go mod download -json "sigs.k8s.io/gateway-api@${gv}" \
    | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
  rm -rf "${out}/gateway-crds" && mkdir -p "${out}/gateway-crds"
  cp "${gw}"/config/crd/standard/*.yaml "${out}/gateway-crds/"
  chmod u+w "${out}"/gateway-crds/*.yaml
  log "gateway-api ${gv}: copied $(ls "${out}/gateway-crds" | wc -l) standard-channel CRDs"
  touch "${out}/.complete"; BUILT=1
}

# ---- Helm (chart lint and template in the chart tests) -----------------------------------------
# Helm's go.mod carries replace directives too, so it is built as the main module from a writable
# copy of its module source, like Traefik.
build_helm() {
  local v=${HELM_VERSION} out="${BIN_DIR}/helm-${HELM_VERSION}"
  if have "${out}" helm; then log "helm ${v}: cached in ${out}"; return; fi
  local work="${BUILD_DIR}/helm-${v}" src
  log "helm ${v}: resolving"
  src=$(go mod download -json "helm.sh/helm/${HELM_VERSION%%.*}@${v}" \
    | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
  [[ -d "${src}" ]] || { echo "build-bins: no source for helm ${v}" >&2; exit 1; }
  if [[ ! -f "${work}/go.mod" ]]; then
    rm -rf "${work}" && cp -r "${src}" "${work}" && chmod -R u+w "${work}"
  fi
  log "helm ${v}: building helm"
  mkdir -p "${out}"
  (cd "${work}" && "${GOBUILD[@]}" -ldflags "-s -w" -o "${out}/helm" ./cmd/helm)
  log "helm ${v}: done"
  touch "${out}/.complete"; BUILT=1
}

# ---- Argo CD: its application controller and repo server (e2e/tests/test_gitops_argocd.py) ------
# One binary, Argo CD's own main package (github.com/argoproj/argo-cd/v3/cmd), serves every
# component by the name it is started under (argv[0]); the component names are symlinks to it.
# Its go.mod replaces the gitops-engine sub-module by ./gitops-engine, a nested module that the
# module zip leaves out, so it is built from a wrapper module (as Kubernetes is) that requires
# the release and repeats its replace directives except that one: gitops-engine resolves to
# the module tagged at the same release (github.com/argoproj/argo-cd/gitops-engine/v3).
# Beside the binary, from the module, at the same relative paths: the Application and AppProject
# CRDs and the argocd-cm its installs ship (the default ignoreResourceUpdates and exclusions)
# under manifests/, and the scripts its image puts next to it on PATH (hack/: the repo server
# runs git-verify-wrapper.sh on every revision it reads).
ARGOCD_FILES=(manifests/crds/application-crd.yaml manifests/crds/appproject-crd.yaml
              manifests/base/config/argocd-cm.yaml hack/git-verify-wrapper.sh hack/gpg-wrapper.sh)
build_argocd() {
  local v=${ARGOCD_VERSION} out="${BIN_DIR}/argocd-${ARGOCD_VERSION}"
  local names=(argocd-application-controller argocd-repo-server)
  if have "${out}" argocd "${names[@]}" "${ARGOCD_FILES[@]}"; then
    log "argocd ${v}: cached in ${out}"; return
  fi
  local mod=github.com/argoproj/argo-cd/v3 work="${BUILD_DIR}/argocd-${v}" json gomod
  json=$(GOTOOLCHAIN=local go mod download -json "${mod}@${v}" || true)
  gomod=$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p' <<<"${json}")
  [[ -f "${gomod}" ]] || { echo "build-bins: no go.mod for ${mod}@${v}: ${json}" >&2; exit 1; }
  # The Go its go.mod asks for: the local one when new enough, else the pinned toolchain, which
  # the go command fetches through the module proxy (golang.org/toolchain, checksum-verified).
  local need toolchain=local
  need=$(sed -n 's/^go \([0-9.]*\)$/\1/p' "${gomod}")
  if ! go_at_least "${need}"; then
    toolchain=${ARGOCD_GO_TOOLCHAIN}
    log "argocd ${v}: needs go ${need}; the local go is $(go env GOVERSION), using ${toolchain}"
  fi
  (
    export GOTOOLCHAIN=${toolchain}
    local src
    src=$(go mod download -json "${mod}@${v}" \
      | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
    [[ -d "${src}" ]] || { echo "build-bins: no source for ${mod}@${v}" >&2; exit 1; }
    if [[ -f "${out}/.complete" && -x "${out}/argocd" ]]; then
      log "argocd ${v}: cached except files beside it"
    else
      rm -f "${out}/.complete"
      build_argocd_binary "${src}" "${gomod}" "${json}" "${work}" "${out}"
    fi
    local n f
    for n in "${names[@]}"; do ln -sfn argocd "${out}/${n}"; done
    rm -rf "${out}/manifests" "${out}/hack"
    for f in "${ARGOCD_FILES[@]}"; do
      mkdir -p "$(dirname "${out}/${f}")"
      cp "${src}/${f}" "${out}/${f}" && chmod u+w "${out}/${f}"
    done
    chmod +x "${out}"/hack/*.sh  # module zips keep no file modes
  )
  touch "${out}/.complete"; BUILT=1
}

# build_argocd_binary <module dir> <its go.mod> <its download json> <workdir> <out dir>
build_argocd_binary() {
  local src=$1 gomod=$2 json=$3 work=$4 out=$5 mod=github.com/argoproj/argo-cd/v3
  local v=${ARGOCD_VERSION}
  wrapper_module "${work}" casbuild/argocd
  {
    echo "require ${mod} ${v}"
    # every replace directive of the release but those to a relative path
    awk '/^replace \($/ { block = 1; print; next }
         block && /^\)$/ { block = 0; print; next }
         /=>[[:space:]]*\.\.?\// { next }
         block || /^replace / { print }' "${gomod}"
  } >>"${work}/go.mod"
  log "argocd ${v}: resolving"
  (cd "${work}" && quiet "${work}/resolve.log" go get "${mod}@${v}")
  # Version stamps as Argo CD's Makefile sets them (common/version.go); the release time is the
  # one the module proxy records.
  local info date kubectl_v ld pkg=${mod}/common
  info=$(sed -n 's/^[[:space:]]*"Info": "\(.*\)",\{0,1\}$/\1/p' <<<"${json}")
  date=$(sed -n 's/.*"Time":"\([^"]*\)".*/\1/p' "${info}" 2>/dev/null || true)
  kubectl_v=$(cd "${work}" && go list -mod=mod -m \
    -f '{{if .Replace}}{{.Replace.Version}}{{else}}{{.Version}}{{end}}' k8s.io/client-go)
  ld="-s -w -X ${pkg}.version=$(cat "${src}/VERSION") -X ${pkg}.gitTag=${v}"
  ld+=" -X ${pkg}.buildDate=${date:-1970-01-01T00:00:00Z} -X ${pkg}.kubectlVersion=${kubectl_v}"
  log "argocd ${v}: building argocd with $(go env GOVERSION) (a few minutes to tens of minutes)"
  mkdir -p "${out}"
  (cd "${work}" && "${GOBUILD[@]}" -ldflags "${ld}" -o "${out}/argocd" "${mod}/cmd")
  log "argocd ${v}: done ($(du -m "${out}/argocd" | cut -f1) MB)"
}

# go_at_least <version>: true when the local Go (GOTOOLCHAIN=local) is at least <version>.
go_at_least() {
  local have_v
  have_v=$(GOTOOLCHAIN=local go env GOVERSION); have_v=${have_v#go}
  [[ "$(printf '%s\n%s\n' "$1" "${have_v}" | sort -V | head -n 1)" == "$1" ]]
}

# ---- kube-network-policies (NetworkPolicy enforcement, e2e/runtime/netpol.py) ------------------
# Our main (e2e/cluster/netpol/main.go) around the module's own packages, at exactly the versions
# its go.mod selects; the stamp holds a hash of that main, so an edit rebuilds it.
build_netpol() {
  local v=${KUBE_NETWORK_POLICIES_VERSION} out="${BIN_DIR}/kube-network-policies-${KUBE_NETWORK_POLICIES_VERSION}"
  local main="${HERE}/netpol/main.go" sum
  sum=$(sha256sum "${main}" | cut -c1-16)
  if have "${out}" cas-netpol && grep -qx "${sum}" "${out}/.complete"; then
    log "kube-network-policies ${v}: cached in ${out}"; return
  fi
  local work="${BUILD_DIR}/kube-network-policies-${v}"
  wrapper_module "${work}" casbuild/netpol
  cp "${main}" "${work}/main.go"
  log "kube-network-policies ${v}: resolving"
  (cd "${work}" && quiet "${work}/resolve.log" go get "sigs.k8s.io/kube-network-policies@${v}")
  log "kube-network-policies ${v}: building cas-netpol"
  mkdir -p "${out}"
  (cd "${work}" && "${GOBUILD[@]}" -ldflags "-s -w" -o "${out}/cas-netpol" .)
  echo "${sum}" >"${out}/.complete"; BUILT=1
  log "kube-network-policies ${v}: done"
}

main() {
  mkdir -p "${BIN_DIR}" "${BUILD_DIR}"
  log "binaries in ${BIN_DIR} (go $(go env GOVERSION))"
  build_etcd
  build_kwok
  build_lws
  build_kubernetes
  build_traefik
  build_helm
  build_argocd
  build_netpol
  local total=$(( $(date +%s) - START ))
  if [[ ${BUILT} == 1 ]]; then
    log "build finished: total build time ${total}s"
  else
    log "all binaries cached (${total}s)"
  fi
}

main "$@"
