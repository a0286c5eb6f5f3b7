#!/usr/bin/env bash
# A real single-node Kubernetes cluster on this machine, to poke at by hand (the one the realcluster tests run):
# the project's image built here (scripts/image.sh), etcd + kube-apiserver + controller-manager + scheduler +
# containerd + kubelet + kube-proxy + CoreDNS in a network namespace of their own (tests/realcluster/cluster.py).
#
#   bash scripts/cluster.sh up          # builds what is missing (first time: tens of minutes), starts the cluster
#   eval "$(bash scripts/cluster.sh env)"   # KUBECONFIG for kubectl / helm
#   bash scripts/cluster.sh exec CMD... # CMD inside the node's network: Service names resolve, ClusterIPs route
#   bash scripts/cluster.sh down        # stops everything and checks that nothing is left behind
#
# Needs root (network namespaces, cgroups, mounts). H3SERVE_CLUSTER_DIR (default /tmp/h3serve-cluster) holds it.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${H3SERVE_CLUSTER_DIR:-/tmp/h3serve-cluster}
PY=${H3SERVE_VENV:-.venv}/bin/python
case ${1:-} in
  up) bash scripts/setup.sh; exec "$PY" tests/realcluster/cluster.py up --dir "$DIR" ;;
  down) exec "$PY" tests/realcluster/cluster.py down --dir "$DIR" ;;
  env) echo "export KUBECONFIG=$DIR/admin.kubeconfig" ;;
  exec) shift; ns=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["netns"])' "$DIR/state.json")
        exec ip netns exec "$ns" "$@" ;;
  leftovers) exec "$PY" tests/realcluster/cluster.py leftovers ;;
  *) echo "usage: scripts/cluster.sh up|down|env|exec CMD...|leftovers" >&2; exit 2 ;;
esac
