#!/usr/bin/env bash
# Debian packages the tests need: mooncake's CPU build links libibverbs and libnuma; prometheus
# is the real metrics server of the anomaly-loop e2e tests; iproute2 and nftables make the local
# stack's pod network (network namespaces, veths, routes, guard tables: e2e/cluster/podnet.py)
# and kube-proxy's nftables mode works with the kernel's nf_tables; curl sends requests from
# inside node namespaces in the e2e tests; redis-server (Argo CD's cache) and git (its daemon
# serves the repository Argo CD syncs from) run the GitOps e2e test; iptables (iptables-nft)
# writes the NFQUEUE rules of the NetworkPolicy enforcement some e2e tests start
# (e2e/runtime/netpol.py). Installs only what is missing.
set -euo pipefail
packages=(libibverbs1 libnuma1 openssl prometheus iproute2 nftables iptables curl redis-server git)
missing=()
for pkg in "${packages[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" -ne 0 ]; then
  echo "sysdeps: please install: ${missing[*]} (needs root and apt-get)" >&2
  exit 0
fi
echo "sysdeps: installing ${missing[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
