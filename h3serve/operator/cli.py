"""`h3serve render` and `h3serve operator`.

    h3serve render -f my-h3deployment.yaml [-n NAMESPACE] [--crd]   # manifests YAML on stdout, nothing applied
    h3serve operator [--namespace NS ...| --all-namespaces] [--liveness URL] [--leader-election-namespace NS]
                     [--policy JSON] [--apply-crd]

`python -m h3serve.operator.cli ...` works the same without the top-level CLI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

import yaml

from h3serve.config.spec import KIND, AdmissionPolicy, parse_and_validate
from h3serve.errors import H3Error
from h3serve.operator import crd, manifests


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("render", help="render an H3Deployment into the Kubernetes objects the operator applies",
                       description="Read an H3Deployment (or a bare spec with --name) and print the objects the "
                                   "operator would apply, as multi-document YAML. Nothing is sent to a cluster.")
    r.add_argument("-f", "--file", required=True, help="H3Deployment YAML ('-' = stdin)")
    r.add_argument("-n", "--namespace", default=None, help="namespace (default: the resource's, else 'default')")
    r.add_argument("--name", default=None, help="name, when the file holds a bare spec")
    r.add_argument("--crd", action="store_true", help="print the H3Deployment CRD first")
    r.set_defaults(func=_cmd_render)

    o = sub.add_parser("operator", help="run the H3Deployment operator (kopf)",
                       description="Watch H3Deployments and reconcile their serving graphs. Credentials: in-cluster, "
                                   "else $KUBECONFIG.")
    scope = o.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=None,
                       help="namespace to watch (repeatable; default: $H3SERVE_WATCH_NAMESPACES, comma-separated, "
                            "else the pod's own namespace)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    o.add_argument("--liveness", default=os.environ.get("H3SERVE_LIVENESS"),
                   help="serve kopf's liveness probe here, e.g. http://0.0.0.0:8080/healthz")
    o.add_argument("--leader-election-namespace", default=os.environ.get("H3SERVE_LEADER_NAMESPACE"),
                   help="namespace of the Lease that elects the one replica that reconciles (default: the pod's "
                        "namespace, else the first watched namespace)")
    o.add_argument("--no-leader-election", action="store_true",
                   help="reconcile without holding the Lease (only when a single operator can run)")
    o.add_argument("--lease-seconds", type=float, default=float(os.environ.get("H3SERVE_LEASE_SECONDS", "15")),
                   help="how long a leader's Lease lasts without renewal (default 15)")
    o.add_argument("--policy", default=os.environ.get("H3SERVE_POLICY", "{}"),
                   help="what an H3Deployment may use, as JSON with the chart's policy keys (allowedVolumeKinds, "
                        "allowedImages, allowedCsiDrivers, maxVolumeSize, allowedSecretNames, allowedPriorityClasses, "
                        "deniedNodeKeys, allowedServiceTypes, allowUnauthenticatedExternal); a key left out keeps "
                        "its default (values.yaml)")
    o.add_argument("--apply-crd", action="store_true",
                   help="server-side apply the H3Deployment CRD this operator was built with, at start (how "
                        "`helm upgrade` upgrades it)")
    o.add_argument("--verbose", action="store_true")
    o.set_defaults(func=_cmd_operator)


def _load_docs(path: str) -> list[dict]:
    text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    return [d for d in yaml.safe_load_all(text) if d]


def _cmd_render(args: argparse.Namespace) -> int:
    out = []
    if args.crd:
        out.append(crd.crd())
    docs = _load_docs(args.file)
    if not docs:
        raise H3Error(f"render: no document in {args.file}")
    for doc in docs:
        if doc.get("kind") == KIND:
            md = doc.get("metadata") or {}
            name = args.name or md.get("name")
            ns = args.namespace or md.get("namespace") or "default"
            body = doc.get("spec") or {}
        else:
            name, ns, body = args.name, args.namespace or "default", doc
        if not name:
            raise H3Error("render: the resource has no metadata.name; pass --name")
        spec = parse_and_validate(body, name)
        out += manifests.render(spec, name, ns)
    sys.stdout.write(manifests.to_yaml(out))
    return 0


def _cmd_operator(args: argparse.Namespace) -> int:
    # lazy: kopf (the `operator` extra) loads only to run the operator; `render` needs no cluster libraries
    import kopf

    import h3serve.operator.handlers  # noqa: F401 - registers the handlers

    if args.all_namespaces:
        namespaces, clusterwide = [], True
    else:
        namespaces = args.namespace or [n for n in os.environ.get("H3SERVE_WATCH_NAMESPACES", "").split(",") if n]
        if not namespaces:
            own = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
            if os.path.exists(own):
                namespaces = [open(own).read().strip()]
        if not namespaces:
            raise H3Error("operator: pass --namespace NS (repeatable) or --all-namespaces")
        clusterwide = False
    kopf.configure(verbose=args.verbose)
    logging.getLogger("h3serve").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    from h3serve.operator import handlers, kube

    try:
        values = json.loads(args.policy)
    except ValueError as e:
        raise H3Error(f"operator: --policy is not JSON ({e})") from None
    if not isinstance(values, dict):
        raise H3Error(f"operator: --policy must be a JSON object of the chart's policy keys, not {args.policy!r}")
    handlers.SETTINGS.policy = AdmissionPolicy.from_values(values)
    if args.apply_crd:
        kube.load_config()
        ours = crd.crd()
        try:
            stored = kube.get_crd(ours["metadata"]["name"])
            newer = crd.newer_than_ours(stored, ours) if stored else None
            if newer is None:
                kube.apply_crd(ours)
        except Exception as e:  # noqa: BLE001 - one line, not a traceback
            raise H3Error(f"operator: --apply-crd: could not apply the CRD: {kube._reason(e)}") from None
        if newer is not None:  # a rollback, or an older replica in a mixed rollout: never lower the stored CRD
            by = stored["metadata"]["annotations"][crd.VERSION_ANNOTATION]
            shown = ", ".join(newer[:6]) + (f" and {len(newer) - 6} more" if len(newer) > 6 else "")
            raise H3Error(f"operator: --apply-crd: the stored CRD {ours['metadata']['name']} is {by}'s, newer than "
                          f"this operator's ({ours['metadata']['annotations'][crd.VERSION_ANNOTATION]})"
                          + (f"; it declares {shown}, which applying this one would erase from every H3Deployment"
                             if newer else "") + ": this operator does not start. Run the newer operator, or "
                          "replace the CRD by hand to downgrade on purpose")
    kube.check_access(namespaces)  # bad credentials or RBAC: exit now, not retry forever
    leader = None
    if not args.no_leader_election:
        from h3serve.operator.leader import Leader

        lease_ns = args.leader_election_namespace or _own_namespace() or (namespaces[0] if namespaces else None)
        if not lease_ns:
            raise H3Error("operator: pass --leader-election-namespace NS (or --no-leader-election)")
        leader = Leader(lease_ns, kube.INSTANCE, duration=args.lease_seconds, renew=max(1.0, args.lease_seconds / 3),
                        on_elected=handlers.wake_all)
        handlers.SETTINGS.leader = leader.start()
    try:
        asyncio.run(kopf.operator(standalone=True, clusterwide=clusterwide, namespaces=namespaces,
                                  liveness_endpoint=args.liveness))
    finally:
        if leader is not None:
            leader.stop()
    return 0


def _own_namespace() -> str | None:
    own = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
    return open(own).read().strip() if os.path.exists(own) else os.environ.get("POD_NAMESPACE")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="h3serve", description="h3serve operator commands")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_subcommands(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except H3Error as e:
        print(f"h3serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
