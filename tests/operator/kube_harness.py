"""A real Kubernetes control plane on loopback for the operator tests.

etcd + kube-apiserver + kube-controller-manager + kube-scheduler, built from source by `tools.sh` (cached in
$H3SERVE_TOOLS_CACHE, default $HOME/.cache/h3serve-k8s), plus kwok managing simulated GPU nodes so that pods
schedule, turn Running and Ready. Every server listens on 127.0.0.1; nothing ever connects to a pod or node IP.

    cp = ControlPlane.start(nodes=8, gpus_per_node=8)
    ...  # cp.kubeconfig, cp.bin("helm"), cp.env
    cp.stop()

Plus the test helpers: `wait_for`, `Operator` (the operator as a child process), `load_example`.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request

import yaml

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TOOLS = HERE / "tools.sh"
CACHE = pathlib.Path(os.environ.get("H3SERVE_TOOLS_CACHE", pathlib.Path.home() / ".cache" / "h3serve-k8s"))


def ensure_tools(*tools: str) -> pathlib.Path:
    """Build the tools if missing (the first build of Kubernetes takes minutes), return the bin directory."""
    r = subprocess.run(["bash", str(TOOLS), *tools], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"tools.sh failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return pathlib.Path(r.stdout.strip().splitlines()[-1])


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on (from /proc; IPv4 and IPv6)."""
    import ipaddress

    inodes = set()
    for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A = LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            if v6:
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                addr = str(ipaddress.IPv6Address(raw))
                if addr.startswith("::ffff:"):
                    addr = addr[7:]
            else:
                addr = str(ipaddress.IPv4Address(raw[::-1]))
            out.append((addr, int(hexport, 16)))
    return out


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the test process dies (even when pytest itself is killed)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _openssl(*args: str, cwd: pathlib.Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: pathlib.Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650", "-subj", "/CN=h3serve-test-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=d)
    (d / "srv.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
        "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,"
        "DNS:custom-metrics.kube-system.svc\n"  # the metrics adapter serves with this certificate too
        "extendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n")
    (d / "cli.ext").write_text("extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n")
    for name, subj, ext in (("apiserver", "/CN=kube-apiserver", "srv.ext"),
                            ("admin", "/O=system:masters/CN=admin", "cli.ext"),
                            ("front-proxy-client", "/CN=front-proxy-client", "cli.ext")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subj, "-keyout", f"{name}.key", "-out",
                 f"{name}.csr", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "3650", "-extfile", ext, "-out", f"{name}.crt", cwd=d)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


def write_kubeconfig(path: pathlib.Path, server: str, ca: pathlib.Path, user: dict) -> None:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "u"}}],
        "current-context": "local",
    }))


def gpu_node(name: str, gpus: int) -> dict:
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"},
                     "labels": {"type": "kwok", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                "kubernetes.io/arch": "amd64", "nvidia.com/gpu.product": "NVIDIA-H200"}},
        "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]},
        "status": {"allocatable": {"cpu": "128", "memory": "2Ti", "pods": "110", "nvidia.com/gpu": str(gpus)},
                   "capacity": {"cpu": "128", "memory": "2Ti", "pods": "110", "nvidia.com/gpu": str(gpus)}},
    }


def cpu_node(name: str) -> dict:
    n = gpu_node(name, 0)
    n["spec"] = {}
    for k in ("allocatable", "capacity"):
        n["status"][k].pop("nvidia.com/gpu")
        n["status"][k]["cpu"] = "64"
        n["status"][k]["memory"] = "256Gi"
    n["metadata"]["labels"].pop("nvidia.com/gpu.product")
    return n


class ControlPlane:
    def __init__(self, run: pathlib.Path, bindir: pathlib.Path):
        self.run, self.bindir = run, bindir
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.ports = {k: free_port() for k in ("etcd", "peer", "api", "kcm", "sched", "kwok")}
        self.server = f"https://127.0.0.1:{self.ports['api']}"
        self.pki = run / "pki"
        self.kubeconfig = run / "admin.kubeconfig"
        self.env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "HOME": str(run / "home"),
                    "HELM_CACHE_HOME": str(run / "helm" / "cache"), "HELM_CONFIG_HOME": str(run / "helm" / "config"),
                    "HELM_DATA_HOME": str(run / "helm" / "data"), "NO_PROXY": "127.0.0.1,localhost",
                    "no_proxy": "127.0.0.1,localhost"}
        (run / "home").mkdir(parents=True, exist_ok=True)
        self.timings: dict[str, float] = {}

    def bin(self, name: str) -> str:
        return str(self.bindir / name)

    # ---- lifecycle ------------------------------------------------------------------------------------------
    @classmethod
    def start(cls, nodes: int = 8, gpus_per_node: int = 8, cpu_nodes: int = 1) -> "ControlPlane":
        t0 = time.monotonic()
        bindir = ensure_tools()
        run = pathlib.Path(tempfile.mkdtemp(prefix="h3serve-k8s-"))
        cp = cls(run, bindir)
        cp.timings["tools"] = time.monotonic() - t0
        try:
            cp._start(nodes, gpus_per_node, cpu_nodes)
        except BaseException:
            cp.dump_logs()
            cp.stop()
            raise
        cp.timings["total"] = time.monotonic() - t0
        return cp

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.run / f"{name}.log", "wb")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.run,
                             start_new_session=True, preexec_fn=die_with_parent)
        self.procs.append((name, p))
        return p

    def _wait(self, what: str, fn, timeout: float = 90.0, proc: subprocess.Popen | None = None) -> None:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode}; see {self.run}")
            try:
                if fn():
                    return
            except Exception as e:  # noqa: BLE001 - not up yet
                last = e
            time.sleep(0.25)
        raise TimeoutError(f"{what} not ready after {timeout}s (last error: {last})")

    def _get(self, url: str, insecure: bool = False) -> str:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt")) if not insecure else \
            ssl._create_unverified_context()
        if url.startswith("http://"):
            ctx = None
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                             urllib.request.HTTPSHandler(context=ctx) if ctx else
                                             urllib.request.HTTPHandler())
        with opener.open(url, timeout=5) as r:
            return r.read().decode()

    def _start(self, nodes: int, gpus_per_node: int, cpu_nodes: int) -> None:
        P, B, D = self.ports, self.bin, self.pki
        t = time.monotonic()
        make_pki(D)
        write_kubeconfig(self.kubeconfig, self.server, D / "ca.crt",
                         {"client-certificate": str(D / "admin.crt"), "client-key": str(D / "admin.key")})
        self.timings["pki"] = time.monotonic() - t

        t = time.monotonic()
        etcd = self._spawn("etcd", [
            B("etcd"), "--name=default", f"--data-dir={self.run / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{P['etcd']}", f"--advertise-client-urls=http://127.0.0.1:{P['etcd']}",
            f"--listen-peer-urls=http://127.0.0.1:{P['peer']}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{P['peer']}",
            f"--initial-cluster=default=http://127.0.0.1:{P['peer']}", "--unsafe-no-fsync=true",
            "--listen-metrics-urls=", "--log-level=warn"])
        self._wait("etcd", lambda: '"health":"true"' in self._get(f"http://127.0.0.1:{P['etcd']}/health"), proc=etcd)
        self.timings["etcd"] = time.monotonic() - t

        t = time.monotonic()
        # what ServiceAccounts (the operator's) do, for the least-privilege test: one JSON line per request
        self.audit_log = self.run / "audit.log"
        policy = self.run / "audit-policy.yaml"
        policy.write_text(yaml.safe_dump({"apiVersion": "audit.k8s.io/v1", "kind": "Policy",
                                      "omitStages": ["RequestReceived"], "rules": [
                                          {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
                                          {"level": "None"}]}))
        api = self._spawn("kube-apiserver", [
            B("kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{P['etcd']}",
            "--bind-address=127.0.0.1", f"--secure-port={P['api']}",
            "--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none",
            f"--tls-cert-file={D / 'apiserver.crt'}", f"--tls-private-key-file={D / 'apiserver.key'}",
            f"--client-ca-file={D / 'ca.crt'}", f"--cert-dir={self.run / 'apiserver-certs'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={D / 'sa.pub'}", f"--service-account-signing-key-file={D / 'sa.key'}",
            "--service-cluster-ip-range=10.96.0.0/16", "--authorization-mode=Node,RBAC",
            "--allow-privileged=false", "--profiling=false", "--v=0",
            f"--audit-policy-file={policy}", f"--audit-log-path={self.audit_log}", "--audit-log-format=json",
            "--audit-log-maxsize=200",
            # gang scheduling (PodGroup, all or nothing): beta in 1.37, off by default
            "--feature-gates=GenericWorkload=true", "--runtime-config=scheduling.k8s.io/v1beta1=true",
            # the aggregation layer (custom.metrics.k8s.io is served by an aggregated API server)
            f"--requestheader-client-ca-file={D / 'ca.crt'}", "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={D / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={D / 'front-proxy-client.key'}"])
        self._wait("kube-apiserver", lambda: self._get(f"{self.server}/readyz") == "ok", timeout=120, proc=api)
        self.timings["apiserver"] = time.monotonic() - t

        t = time.monotonic()
        common = [f"--kubeconfig={self.kubeconfig}", f"--authentication-kubeconfig={self.kubeconfig}",
                  f"--authorization-kubeconfig={self.kubeconfig}", "--bind-address=127.0.0.1", "--leader-elect=false",
                  "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics", "--profiling=false"]
        kcm = self._spawn("kube-controller-manager", [
            B("kube-controller-manager"), *common, f"--secure-port={P['kcm']}",
            f"--service-account-private-key-file={D / 'sa.key'}", f"--root-ca-file={D / 'ca.crt'}",
            "--use-service-account-credentials=false", "--controllers=*",
            "--concurrent-gc-syncs=10", "--node-monitor-grace-period=60s",
            "--horizontal-pod-autoscaler-sync-period=3s", "--feature-gates=GenericWorkload=true"])
        sched = self._spawn("kube-scheduler", [B("kube-scheduler"), *common, f"--secure-port={P['sched']}",
                                               "--feature-gates=GenericWorkload=true"])
        self._wait("kube-controller-manager", lambda: self._get(f"https://127.0.0.1:{P['kcm']}/healthz", True) == "ok",
                   proc=kcm)
        self._wait("kube-scheduler", lambda: self._get(f"https://127.0.0.1:{P['sched']}/healthz", True) == "ok",
                   proc=sched)
        self.timings["kcm+scheduler"] = time.monotonic() - t

        t = time.monotonic()
        kwok = self._spawn("kwok", [
            B("kwok"), f"--kubeconfig={self.kubeconfig}", f"--config={CACHE / 'share' / 'kwok-stages.yaml'}",
            "--manage-all-nodes=false", "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            "--cidr=10.244.0.0/16", "--node-ip=127.0.0.1", f"--server-address=127.0.0.1:{P['kwok']}",
            f"--node-port={P['kwok']}", "--node-lease-duration-seconds=40"])
        from kubernetes import client, config

        self.api = config.new_client_from_config(str(self.kubeconfig))
        core = client.CoreV1Api(self.api)
        self._wait("default service account", lambda: core.read_namespaced_service_account("default", "default"))
        for i in range(nodes):
            core.create_node(gpu_node(f"gpu-{i}", gpus_per_node))
        for i in range(cpu_nodes):
            core.create_node(cpu_node(f"cpu-{i}"))

        def nodes_ready():
            ns = core.list_node().items
            return len(ns) == nodes + cpu_nodes and all(
                any(c.type == "Ready" and c.status == "True" for c in (n.status.conditions or []))
                and not any(t.key.startswith("node.kubernetes.io/") for t in (n.spec.taints or []))
                for n in ns)
        self._wait("kwok nodes Ready and untainted", nodes_ready, timeout=120, proc=kwok)
        self.timings["nodes"] = time.monotonic() - t

    def stop(self) -> None:
        for name, p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for name, p in reversed(self.procs):
            try:
                p.wait(timeout=5)  # the state is thrown away: no need for a long graceful shutdown
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs.clear()
        if os.environ.get("H3SERVE_KEEP_CLUSTER_DIR"):
            print(f"control plane files kept in {self.run}")
        else:
            shutil.rmtree(self.run, ignore_errors=True)

    def dump_logs(self, lines: int = 40) -> str:
        out = []
        for f in sorted(self.run.glob("*.log")):
            tail = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"==== {f.name} ====\n" + "\n".join(tail))
        text = "\n".join(out)
        print(text)
        return text


class MetricsAdapter:
    """sigs.k8s.io/custom-metrics-apiserver's test adapter as the cluster's custom.metrics.k8s.io (an aggregated API
    server on loopback). A test writes per-pod values, as Prometheus would scrape them from the stage processes (kwok
    runs no containers); the HPA controller reads them through the kube-apiserver like any metrics API."""

    GROUP_VERSION = ("custom.metrics.k8s.io", "v1beta2")

    def __init__(self, cp: "ControlPlane"):
        self.cp = cp
        self.port, self.write_port = free_port(), free_port()
        self.url = f"https://127.0.0.1:{self.port}"

    def start(self) -> "MetricsAdapter":
        import base64

        from kubernetes import client

        bindir = ensure_tools("metrics-adapter")
        D = self.cp.pki
        self.proc = self.cp._spawn("custom-metrics-adapter", [
            str(bindir / "custom-metrics-adapter"), f"--secure-port={self.port}", "--bind-address=127.0.0.1",
            f"--tls-cert-file={D / 'apiserver.crt'}", f"--tls-private-key-file={D / 'apiserver.key'}",
            f"--lister-kubeconfig={self.cp.kubeconfig}",
            f"--authentication-kubeconfig={self.cp.kubeconfig}", f"--authorization-kubeconfig={self.cp.kubeconfig}",
            f"--cert-dir={self.cp.run / 'adapter-certs'}", f"--write-address=127.0.0.1:{self.write_port}", "--v=1"])
        self.cp._wait("custom-metrics-adapter", lambda: self.cp._get(f"{self.url}/healthz", True) == "ok",
                      proc=self.proc)
        core = client.CoreV1Api(self.cp.api)
        # ExternalName: the aggregator dials <externalName>:<APIService port>, i.e. this loopback server (a
        # ClusterIP needs a kube-proxy, and Endpoints may not hold loopback addresses).
        core.create_namespaced_service("kube-system", {
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": "custom-metrics"},
            "spec": {"type": "ExternalName", "externalName": "localhost"}})
        group, version = self.GROUP_VERSION
        client.ApiregistrationV1Api(self.cp.api).create_api_service({
            "apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
            "metadata": {"name": f"{version}.{group}"},
            "spec": {"group": group, "version": version, "groupPriorityMinimum": 100, "versionPriority": 200,
                     "service": {"namespace": "kube-system", "name": "custom-metrics", "port": self.port},
                     "caBundle": base64.b64encode((D / "ca.crt").read_bytes()).decode()}})

        def available():
            s = client.ApiregistrationV1Api(self.cp.api).read_api_service(f"{version}.{group}")
            return any(c.type == "Available" and c.status == "True" for c in (s.status.conditions or []))
        self.cp._wait("custom.metrics.k8s.io Available", available, timeout=60, proc=self.proc)
        return self

    def write(self, namespace: str, pod: str, metric: str, value: str) -> None:
        """Set `metric` of one pod (what a scrape of that pod's /metrics would report)."""
        import json

        req = urllib.request.Request(
            f"http://127.0.0.1:{self.write_port}/write-metrics/namespaces/{namespace}/pods/{pod}/{metric}",
            data=json.dumps(value).encode(), method="POST", headers={"Content-Type": "application/json"})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(req, timeout=10) as r:
            assert r.status == 200, r.status


def wait_for(what: str, fn, timeout: float = 60.0, interval: float = 0.5):
    """Poll fn() until it returns something truthy; fail with the last value/error after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            v = fn()
            if v:
                return v
            last = v
        except Exception as e:  # noqa: BLE001
            last = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


class Operator:
    """`python -m h3serve.operator.cli operator` as a child process, with the credentials it is given."""

    def __init__(self, kubeconfig: pathlib.Path, namespaces: list[str], log: pathlib.Path, env: dict,
                 args: list[str] | None = None, identity: str = "operator-a"):
        self.kubeconfig, self.namespaces, self.log, self.env = kubeconfig, namespaces, log, env
        self.args = list(args or [])
        self.identity = identity  # the pod name it would have: its Lease holder identity and Events' reportingInstance
        self.proc: subprocess.Popen | None = None
        self.port = free_port()

    def start(self) -> "Operator":
        args = [sys.executable, "-m", "h3serve.operator.cli", "operator",
                *[f"--namespace={n}" for n in self.namespaces], f"--liveness=http://127.0.0.1:{self.port}/healthz",
                *self.args]
        env = {**self.env, "KUBECONFIG": str(self.kubeconfig), "H3SERVE_RESYNC_SECONDS": "20",
               "PYTHONUNBUFFERED": "1", "POD_NAME": self.identity}
        self.proc = subprocess.Popen(args, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=env,
                                     cwd=ROOT, start_new_session=True, preexec_fn=die_with_parent)
        wait_for("operator liveness", self.alive, timeout=60)
        return self

    def alive(self) -> bool:
        import urllib.request

        if self.proc is None or self.proc.poll() is not None:
            raise AssertionError(f"operator exited: {self.tail()}")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as r:
            return r.status == 200

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=30)

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def load_example(name: str, namespace: str) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
    doc["metadata"]["namespace"] = namespace
    return doc
