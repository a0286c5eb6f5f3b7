#!/usr/bin/env bash
# Build, once, the real Kubernetes components the operator tests run against:
#   etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok, helm, and the custom metrics API server
#   (sigs.k8s.io/custom-metrics-apiserver's test adapter: a real custom.metrics.k8s.io aggregated API server whose
#   values the tests write, standing in for Prometheus scraping pods that kwok does not run);
#   and for the real single-node cluster (tests/realcluster/): kubelet and kube-proxy (the same Kubernetes
#   version), containerd with its runc shim and ctr, CoreDNS with only the plugins a cluster zone needs
#   (tests/realcluster/coredns/main.go), and kube-router's network policy controller (iptables + ipset: this
#   kernel has no nftables `queue`, which sigs.k8s.io/kube-network-policies needs).
# Everything lands in $H3SERVE_TOOLS_CACHE (default $HOME/.cache/h3serve-k8s), outside the repo,
# and is reused on later runs: a tool is rebuilt only if its binary or its version stamp is missing.
#
#   tests/operator/tools.sh [TOOL...]          build what is missing, print the bin directory
#   tests/operator/tools.sh --check [TOOL...]  exit 1 if anything is missing (builds nothing)
# TOOL is helm, etcd, kwok, kubernetes, metrics-adapter, node, containerd, coredns or kube-router (default: all).
#
# Versions are pinned below; override with the environment variables of the same name.
set -euo pipefail

CACHE=${H3SERVE_TOOLS_CACHE:-$HOME/.cache/h3serve-k8s}
K8S_VERSION=${K8S_VERSION:-v1.37.2}
ETCD_VERSION=${ETCD_VERSION:-v3.6.16}
KWOK_VERSION=${KWOK_VERSION:-v0.8.0}
HELM_VERSION=${HELM_VERSION:-v3.22.0}
METRICS_ADAPTER_VERSION=${METRICS_ADAPTER_VERSION:-v1.37.0}
CONTAINERD_VERSION=${CONTAINERD_VERSION:-v2.4.2}
COREDNS_VERSION=${COREDNS_VERSION:-v1.14.7}
KUBE_ROUTER_VERSION=${KUBE_ROUTER_VERSION:-v2.1.0}
HERE=$(cd "$(dirname "$0")" && pwd)
ADAPTER_MAIN=$HERE/metrics_adapter/main.go
ADAPTER_STAMP="$METRICS_ADAPTER_VERSION+$(sha256sum "$ADAPTER_MAIN" | cut -c1-12)"
COREDNS_MAIN=$HERE/../realcluster/coredns/main.go
COREDNS_STAMP="$COREDNS_VERSION+$(sha256sum "$COREDNS_MAIN" | cut -c1-12)"
NICE=${H3SERVE_TOOLS_NICE:-15}

BIN=$CACHE/bin
SHARE=$CACHE/share
STAMPS=$CACHE/stamps
mkdir -p "$BIN" "$SHARE" "$STAMPS"

export CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local
log() { printf '[tools %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

have() { # have NAME VERSION BINARIES...
  local name=$1 ver=$2; shift 2
  [[ -f $STAMPS/$name && $(cat "$STAMPS/$name") == "$ver" ]] || return 1
  local b; for b in "$@"; do [[ -x $BIN/$b ]] || return 1; done
}

mark() { echo "$2" > "$STAMPS/$1"; }

timed() { # timed NAME CMD...: run, record seconds in $CACHE/build-times.tsv
  local name=$1 t0=$SECONDS; shift
  "$@"
  printf '%s\t%s\t%ss\n' "$(date -u +%FT%TZ)" "$name" "$((SECONDS - t0))" >> "$CACHE/build-times.tsv"
  log "$name built in $((SECONDS - t0))s"
}

build_helm() {
  # Offline `helm template` / `helm lint` assume this Kubernetes version unless told otherwise (upstream: 1.20).
  local min; min=$(echo "$K8S_VERSION" | cut -d. -f2)
  local ldf="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
  local p; for p in pkg/chartutil pkg/lint/rules; do
    ldf="$ldf -X helm.sh/helm/v3/$p.k8sVersionMajor=1 -X helm.sh/helm/v3/$p.k8sVersionMinor=$min"
  done
  GOBIN=$BIN nice -n "$NICE" go install -trimpath -ldflags "$ldf" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
}

build_kwok() {
  GOBIN=$BIN nice -n "$NICE" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  # kwok >= v0.8.0 has no built-in stages: keep the upstream default ones next to the binary.
  local src; src=$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage
  local f out=$SHARE/kwok-stages.yaml
  : > "$out.tmp"
  for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
           pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    printf -- '---\n' >> "$out.tmp"; cat "$src/$f" >> "$out.tmp"
  done
  mv "$out.tmp" "$out"
}

build_etcd() {
  local w=$CACHE/src/etcd; rm -rf "$w"; mkdir -p "$w"; cd "$w"
  printf 'module local/etcdbuild\n\ngo 1.26.0\n' > go.mod
  nice -n "$NICE" go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
  nice -n "$NICE" go build -trimpath -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3
}

k8s_module() { # k8s_module DIR: a throw-away module that can build k8s.io/kubernetes/cmd/* at $K8S_VERSION
  local stg=v0.${K8S_VERSION#v1.}
  rm -rf "$1"; mkdir -p "$1"; cd "$1"
  printf 'module local/k8sbuild\n\ngo 1.26.0\n\ngodebug default=go1.26\n' > go.mod
  # k8s.io/kubernetes requires its staging modules as v0.0.0 and replaces them by relative path;
  # mirror that list from its real go.mod, pinning each to the matching published tag.
  local kgomod
  kgomod=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | python3 -c 'import json,sys;print(json.load(sys.stdin)["GoMod"])')
  local m
  for m in $(sed -n 's#^[[:space:]]*\(k8s\.io/[a-z0-9-]*\) => \./staging/src/k8s\.io/.*#\1#p' "$kgomod"); do
    go mod edit -replace="$m=$m@$stg"
  done
}

k8s_build() { # k8s_build CMD...: build k8s.io/kubernetes/cmd/CMD... into $BIN, version-stamped
  local maj=1 min ldf="-s -w" p c pkgs=(); min=$(echo "$K8S_VERSION" | cut -d. -f2)
  for c in "$@"; do pkgs+=("k8s.io/kubernetes/cmd/$c"); done
  nice -n "$NICE" go get "${pkgs[@]/%/@$K8S_VERSION}"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldf="$ldf -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=$maj -X $p.gitMinor=$min -X $p.gitTreeState=clean -X $p.buildDate=2000-01-01T00:00:00Z"
  done
  nice -n "$NICE" go build -p 2 -trimpath -ldflags "$ldf" -o "$BIN/" "${pkgs[@]}"
}

build_k8s() {
  k8s_module "$CACHE/src/k8s"
  k8s_build kube-apiserver kube-controller-manager kube-scheduler
}

build_node() { # the node agents, from the same module set (the Go build cache shares the common packages)
  k8s_module "$CACHE/src/k8s-node"
  k8s_build kubelet kube-proxy
}

build_containerd() { # containerd (with its CRI plugin), the runc v2 shim and ctr; no cgo: btrfs/devmapper left out
  local c; for c in containerd containerd-shim-runc-v2 ctr; do
    GOBIN=$BIN nice -n "$NICE" go install -trimpath -ldflags "-s -w" \
      "github.com/containerd/containerd/v2/cmd/$c@$CONTAINERD_VERSION"
  done
}

build_coredns() { # CoreDNS with the cluster-zone plugins only (no forward: nothing resolves outside the cluster)
  local w=$CACHE/src/coredns; rm -rf "$w"; mkdir -p "$w"; cp "$COREDNS_MAIN" "$w/"
  cd "$w"
  printf 'module local/corednsbuild\n\ngo 1.26.0\n' > go.mod
  nice -n "$NICE" go get "github.com/coredns/coredns@$COREDNS_VERSION"
  nice -n "$NICE" go build -trimpath -ldflags "-s -w" -o "$BIN/coredns" .
}

build_kube_router() { # only its firewall runs (tests/realcluster/cluster.py): no BGP, no proxy, no CNI
  GOBIN=$BIN nice -n "$NICE" go install -trimpath -ldflags "-s -w" \
    "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router@$KUBE_ROUTER_VERSION"
}

build_metrics_adapter() {
  # A throw-away module: our main (metrics_adapter/main.go: the upstream test provider, its write endpoint on
  # loopback) against the pinned release.
  local w=$CACHE/src/metrics-adapter; rm -rf "$w"; mkdir -p "$w"; cp "$ADAPTER_MAIN" "$w/"
  cd "$w"
  printf 'module local/metricsadapter\n\ngo 1.26.0\n' > go.mod
  nice -n "$NICE" go get "sigs.k8s.io/custom-metrics-apiserver@$METRICS_ADAPTER_VERSION"
  nice -n "$NICE" go build -trimpath -ldflags "-s -w" -o "$BIN/custom-metrics-adapter" .
}

HELM_STAMP="$HELM_VERSION+k8s${K8S_VERSION%.*}"
check=0
if [[ ${1:-} == --check ]]; then check=1; shift; fi
want=("$@"); [[ ${#want[@]} -gt 0 ]] || want=(helm etcd kwok kubernetes metrics-adapter node containerd coredns kube-router)

ok() { # ok TOOL: is it built at the pinned version?
  case $1 in
    helm) have helm "$HELM_STAMP" helm ;;
    etcd) have etcd "$ETCD_VERSION" etcd ;;
    kwok) have kwok "$KWOK_VERSION" kwok && [[ -s $SHARE/kwok-stages.yaml ]] ;;
    kubernetes) have k8s "$K8S_VERSION" kube-apiserver kube-controller-manager kube-scheduler ;;
    metrics-adapter) have metrics-adapter "$ADAPTER_STAMP" custom-metrics-adapter ;;
    node) have node "$K8S_VERSION" kubelet kube-proxy ;;
    containerd) have containerd "$CONTAINERD_VERSION" containerd containerd-shim-runc-v2 ctr ;;
    coredns) have coredns "$COREDNS_STAMP" coredns ;;
    kube-router) have kube-router "$KUBE_ROUTER_VERSION" kube-router ;;
    *) echo "unknown tool $1 (helm, etcd, kwok, kubernetes, metrics-adapter, node, containerd, coredns," \
            "kube-router)" >&2; exit 2 ;;
  esac
}

if (( check )); then
  for t in "${want[@]}"; do ok "$t" || exit 1; done
  exit 0
fi

# One builder at a time (parallel test workers may call this together).
exec 9> "$CACHE/.lock"
flock 9

for t in "${want[@]}"; do
  ok "$t" && continue
  case $t in
    helm) timed "helm@$HELM_VERSION" build_helm && mark helm "$HELM_STAMP" ;;
    etcd) timed "etcd@$ETCD_VERSION" build_etcd && mark etcd "$ETCD_VERSION" ;;
    kwok) timed "kwok@$KWOK_VERSION" build_kwok && mark kwok "$KWOK_VERSION" ;;
    kubernetes) timed "kubernetes@$K8S_VERSION" build_k8s && mark k8s "$K8S_VERSION" ;;
    metrics-adapter) timed "custom-metrics-adapter@$METRICS_ADAPTER_VERSION" build_metrics_adapter &&
      mark metrics-adapter "$ADAPTER_STAMP" ;;
    node) timed "kubelet+kube-proxy@$K8S_VERSION" build_node && mark node "$K8S_VERSION" ;;
    containerd) timed "containerd@$CONTAINERD_VERSION" build_containerd && mark containerd "$CONTAINERD_VERSION" ;;
    coredns) timed "coredns@$COREDNS_VERSION" build_coredns && mark coredns "$COREDNS_STAMP" ;;
    kube-router) timed "kube-router@$KUBE_ROUTER_VERSION" build_kube_router &&
      mark kube-router "$KUBE_ROUTER_VERSION" ;;
  esac
done
rm -rf "$CACHE/src"
echo "$BIN"
