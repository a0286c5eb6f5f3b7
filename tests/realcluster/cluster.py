"""A real single-node Kubernetes cluster on this machine, for the tests and for a developer to poke at.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler, containerd (runc), kubelet, kube-proxy, CoreDNS and
kube-router's network policy controller (the pods' NetworkPolicies enforced, in iptables and ipsets), all built by
tests/operator/tools.sh (runc, the CNI plugins, iptables and ipset are Debian's packages). Everything runs in
one network namespace the harness creates (the "node"), joined to this host by one veth pair; inside it:

    10.250.0.1   this host's end of the veth (the tests' clients reach the API server from here)
    10.250.0.2   the node: API server :6443, kubelet :10250, CoreDNS :53 (the kube-dns Service's endpoint)
    10.244.0.0/24 pods, on the bridge cni0 inside the node (CNI bridge + host-local)
    10.96.0.0/16 Services (kube-proxy, iptables mode, its rules inside the node's namespace only)

Confinement: the node's only routes are its own subnets and a default route into a veth pair that ends nowhere, behind an
iptables chain (H3S-NO-ESCAPE) that rejects and counts every packet to any other address; `escapes()` reads that
counter. CoreDNS serves the cluster zone only (no forwarding), containerd has no registry to pull from (the images
are imported from local OCI archives). The node's processes share a private mount namespace (`unshare --mount`), so
every mount they make (overlay root file systems, volumes) goes when they go; their cgroups live under one root,
removed at the end. The kernel tunables the kubelet insists on are shown to it, and only to it, as files bind-mounted
in that private mount namespace: the host's sysctls are never written.

    python tests/realcluster/cluster.py up   [--dir DIR]    # prints `export KUBECONFIG=...`
    python tests/realcluster/cluster.py down [--dir DIR]
    python tests/realcluster/cluster.py leftovers            # what a cluster of this harness left behind (none)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests" / "operator"))
import kube_harness as kh  # noqa: E402

NODE = "h3node"
HOST_IP, NODE_IP, NET = "10.250.0.1", "10.250.0.2", "10.250.0.0/24"
POD_NET, POD_CIDR, SVC_CIDR = "10.244.0.0/16", "10.244.0.0/24", "10.96.0.0/16"
API_SVC_IP, DNS_IP = "10.96.0.1", "10.96.0.10"
# where the node may send: itself, the host's end of the veth, pods, Services, and link-local multicast (the kernel's
# own IGMP reports for the node's interfaces: a router never forwards them off the link)
ALLOWED = ("127.0.0.0/8", NET, POD_NET, SVC_CIDR, "224.0.0.0/24")
PREFIX = "h3s-"  # network namespace, host veth and cgroup root of every cluster of this harness
CGROUPS = pathlib.Path("/sys/fs/cgroup")
DEBIAN = {"runc": "/usr/sbin/runc", "containernetworking-plugins": "/usr/lib/cni/bridge",
          "iptables": "/usr/sbin/iptables", "conntrack": "/usr/sbin/conntrack", "ipset": "/usr/sbin/ipset"}
CNI_BIN = "/usr/lib/cni"
# What the kubelet requires of the kernel (pkg/kubelet/cm: setupKernelTunables); with protectKernelDefaults it only
# checks, and these files in its own mount namespace are what it reads.
KUBELET_SYSCTLS = {"vm/overcommit_memory": "1", "vm/panic_on_oom": "0", "kernel/panic": "10",
                   "kernel/panic_on_oops": "1", "kernel/keys/root_maxkeys": "1000000",
                   "kernel/keys/root_maxbytes": "25000000"}
DEFAULT_DIR = pathlib.Path(os.environ.get("H3SERVE_CLUSTER_DIR", "/tmp/h3serve-cluster"))


def log(msg: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sh(*argv: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), capture_output=True, text=True, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    return r


def ensure_debian_packages() -> None:
    missing = [p for p, f in DEBIAN.items() if not os.path.exists(f)]
    if missing:
        log(f"installing Debian packages {' '.join(missing)}")
        sh("apt-get", "update", "-qq")
        sh("apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing,
           env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


# ---- PKI ------------------------------------------------------------------------------------------------------

def make_pki(d: pathlib.Path) -> None:
    """A CA; the API server's and the kubelet's serving certificates; one client certificate per component."""
    o = lambda *a: kh._openssl(*a, cwd=d)  # noqa: E731
    d.mkdir(parents=True, exist_ok=True)
    o("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650", "-subj", "/CN=h3serve-realcluster-ca",
      "-keyout", "ca.key", "-out", "ca.crt")
    usage = "keyUsage=critical,digitalSignature,keyEncipherment\n"
    (d / "api.ext").write_text(
        f"subjectAltName=IP:{NODE_IP},IP:{API_SVC_IP},IP:127.0.0.1,DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n"
        "extendedKeyUsage=serverAuth\n" + usage)
    (d / "kubelet.ext").write_text(f"subjectAltName=IP:{NODE_IP},DNS:{NODE}\nextendedKeyUsage=serverAuth\n" + usage)
    (d / "cli.ext").write_text("extendedKeyUsage=clientAuth\n" + usage)
    for name, subj, ext in (("apiserver", "/CN=kube-apiserver", "api.ext"),
                            ("kubelet-serving", f"/CN={NODE}", "kubelet.ext"),
                            ("admin", "/O=system:masters/CN=admin", "cli.ext"),
                            ("kubelet", f"/O=system:nodes/CN=system:node:{NODE}", "cli.ext"),
                            ("kube-proxy", "/CN=system:kube-proxy", "cli.ext"),
                            ("coredns", "/O=system:masters/CN=coredns", "cli.ext"),
                            ("kube-router", "/CN=kube-router", "cli.ext")):
        o("req", "-newkey", "rsa:2048", "-nodes", "-subj", subj, "-keyout", f"{name}.key", "-out", f"{name}.csr")
        o("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days",
          "3650", "-extfile", ext, "-out", f"{name}.crt")
    o("genrsa", "-out", "sa.key", "2048")
    o("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub")


# ---- configuration files --------------------------------------------------------------------------------------

def write_configs(run: pathlib.Path, cg_root: str, pause_image: str) -> None:
    D = run / "pki"
    for who in ("admin", "kubelet", "kube-proxy", "coredns", "kube-router"):
        kh.write_kubeconfig(run / f"{who}.kubeconfig", f"https://{NODE_IP}:6443", D / "ca.crt",
                            {"client-certificate": str(D / f"{who}.crt"), "client-key": str(D / f"{who}.key")})
    cd = run / "containerd"
    (cd / "root").mkdir(parents=True, exist_ok=True)
    (run / "cni" / "net.d").mkdir(parents=True, exist_ok=True)
    (cd / "config.toml").write_text(f"""version = 3
root = "{cd / 'root'}"
state = "{cd / 'state'}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.blockfile",
                    "io.containerd.snapshotter.v1.erofs", "io.containerd.nri.v1.nri",
                    "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{cd / 'containerd.sock'}"
[ttrpc]
  address = "{cd / 'containerd.sock.ttrpc'}"
[debug]
  level = "info"
[plugins.'io.containerd.internal.v1.opt']
  path = "{cd / 'opt'}"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{pause_image}"
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = "{cd / 'no-registries'}"
[plugins.'io.containerd.cri.v1.runtime']
  enable_selinux = false
  # Root here lacks CAP_SYS_RESOURCE, so no process may lower its OOM score (the kubelet asks -998 for sandboxes,
  # -997 for Guaranteed pods): keep every container's score at or above containerd's own, as rootless setups do.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "{os.environ.get('H3SERVE_RUNC', DEBIAN['runc'])}"
        Root = "{run / 'runc'}"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{CNI_BIN}"]
    conf_dir = "{run / 'cni' / 'net.d'}"
    max_conf_num = 1
""")
    (run / "cni" / "net.d" / "10-h3s.conflist").write_text(json.dumps({
        "cniVersion": "1.0.0", "name": "h3s", "plugins": [
            {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": True, "hairpinMode": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR}]], "routes": [{"dst": "0.0.0.0/0"}],
                      "dataDir": str(run / "cni" / "ipam")}},
            {"type": "portmap", "capabilities": {"portMappings": True}}]}, indent=1))
    (run / "resolv.conf").write_text("")  # the node's own resolver: none (pods get the cluster DNS)
    yaml_dump(run / "kubelet.yaml", {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "failCgroupV1": False, "cgroupDriver": "cgroupfs", "cgroupRoot": f"/{cg_root}",
        "containerRuntimeEndpoint": f"unix://{cd / 'containerd.sock'}",
        "address": NODE_IP, "port": 10250, "readOnlyPort": 0, "healthzBindAddress": "127.0.0.1",
        "tlsCertFile": str(D / "kubelet-serving.crt"), "tlsPrivateKeyFile": str(D / "kubelet-serving.key"),
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": str(D / "ca.crt")}},
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDomain": "cluster.local", "clusterDNS": [DNS_IP], "resolvConf": str(run / "resolv.conf"),
        "podLogsDir": str(run / "pod-logs"), "protectKernelDefaults": True, "failSwapOn": False,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False, "rotateCertificates": False, "maxPods": 60,
        "syncFrequency": "10s", "fileCheckFrequency": "10s", "nodeStatusReportFrequency": "10s"})
    yaml_dump(run / "kube-proxy.yaml", {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(run / "kube-proxy.kubeconfig")}, "mode": "iptables",
        "clusterCIDR": POD_NET, "hostnameOverride": NODE, "bindAddress": NODE_IP,
        "healthzBindAddress": "127.0.0.1:10256", "metricsBindAddress": "127.0.0.1:10249",
        "nodePortAddresses": [f"{NODE_IP}/32"],
        # 0 = leave the kernel's conntrack settings alone (they are not this namespace's alone)
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        "iptables": {"localhostNodePorts": False}})
    (run / "Corefile").write_text(f"""cluster.local:53 in-addr.arpa:53 ip6.arpa:53 {{
    bind {NODE_IP}
    errors
    health 127.0.0.1:8181
    ready 127.0.0.1:8182
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {run / 'coredns.kubeconfig'}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 30
    loadbalance
}}
.:53 {{
    bind {NODE_IP}
    errors
}}
""")


def yaml_dump(path: pathlib.Path, obj: dict) -> None:
    import yaml

    path.write_text(yaml.safe_dump(obj, sort_keys=False))


# ---- inside the node: the supervisor ---------------------------------------------------------------------------

def kube_router_argv(run: pathlib.Path) -> list[str]:
    """kube-router as the NetworkPolicy enforcer only: no BGP routing, no service proxy (kube-proxy's), no CNI
    (the bridge plugin's); health and metrics servers off (they would listen on every address)."""
    return [str(kh.CACHE / "bin" / "kube-router"), f"--kubeconfig={run / 'kube-router.kubeconfig'}",
            f"--hostname-override={NODE}", "--run-firewall=true", "--run-router=false", "--run-service-proxy=false",
            "--enable-cni=false", "--enable-ipv6=false", f"--service-cluster-ip-range={SVC_CIDR}",
            "--health-port=0", "--metrics-port=0", "--v=1"]



def supervise(run: pathlib.Path) -> None:
    """Runs inside the node's network namespace and private mount namespace: starts every component, then waits;
    SIGTERM stops them in order (pods first), so that nothing outlives it."""
    B = lambda n: str(kh.CACHE / "bin" / n)  # noqa: E731
    D, logs = run / "pki", run / "logs"
    logs.mkdir(exist_ok=True)
    procs: list[tuple[str, subprocess.Popen]] = []

    def spawn_detached(name: str, argv: list[str]) -> subprocess.Popen:
        return subprocess.Popen(argv, stdout=open(logs / f"{name}.log", "ab"), stderr=subprocess.STDOUT, cwd=run,
                                env={**os.environ, "PATH": f"{kh.CACHE / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin"})

    def spawn(name: str, argv: list[str]) -> subprocess.Popen:
        p = spawn_detached(name, argv)
        procs.append((name, p))
        return p

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))

    # /sys as this network namespace sees it (the kubelet reads the node's interfaces there), cgroups kept.
    keep = run / "cgroup-mounts"
    keep.mkdir(exist_ok=True)
    sh("mount", "--rbind", str(CGROUPS), str(keep))
    sh("mount", "-t", "sysfs", "sysfs", "/sys")
    sh("mount", "--move", str(keep), str(CGROUPS))
    # The kernel tunables the kubelet checks, seen by this mount namespace only.
    for key, value in KUBELET_SYSCTLS.items():
        shadow = run / "sysctl" / key.replace("/", ".")
        shadow.parent.mkdir(exist_ok=True)
        shadow.write_text(value + "\n")
        sh("mount", "--bind", str(shadow), f"/proc/sys/{key}")
    # this network namespace's own settings: routing for the pods, iptables on bridged pod-to-pod traffic
    sh("sysctl", "-qw", "net.ipv4.ip_forward=1", "net.bridge.bridge-nf-call-iptables=1")

    spawn("etcd", [B("etcd"), "--name=default", f"--data-dir={run / 'etcd'}", "--unsafe-no-fsync=true",
                   "--listen-client-urls=http://127.0.0.1:2379", "--advertise-client-urls=http://127.0.0.1:2379",
                   "--listen-peer-urls=http://127.0.0.1:2380", "--listen-metrics-urls=", "--log-level=warn"])
    feature = "--feature-gates=GenericWorkload=true"
    spawn("kube-apiserver", [
        B("kube-apiserver"), "--etcd-servers=http://127.0.0.1:2379", f"--bind-address={NODE_IP}",
        "--secure-port=6443", f"--advertise-address={NODE_IP}",
        f"--tls-cert-file={D / 'apiserver.crt'}", f"--tls-private-key-file={D / 'apiserver.key'}",
        f"--client-ca-file={D / 'ca.crt'}", f"--cert-dir={run / 'apiserver-certs'}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={D / 'sa.pub'}", f"--service-account-signing-key-file={D / 'sa.key'}",
        f"--service-cluster-ip-range={SVC_CIDR}", "--authorization-mode=Node,RBAC", "--allow-privileged=false",
        f"--kubelet-client-certificate={D / 'admin.crt'}", f"--kubelet-client-key={D / 'admin.key'}",
        "--kubelet-preferred-address-types=InternalIP",  # the node by its IP: nothing resolves "h3node"
        "--profiling=false", feature, "--runtime-config=scheduling.k8s.io/v1beta1=true"])
    common = [f"--kubeconfig={run / 'admin.kubeconfig'}", f"--authentication-kubeconfig={run / 'admin.kubeconfig'}",
              f"--authorization-kubeconfig={run / 'admin.kubeconfig'}", "--bind-address=127.0.0.1",
              "--leader-elect=false", "--profiling=false", feature]
    spawn("kube-controller-manager", [
        B("kube-controller-manager"), *common, f"--service-account-private-key-file={D / 'sa.key'}",
        f"--root-ca-file={D / 'ca.crt'}", "--controllers=*", f"--service-cluster-ip-range={SVC_CIDR}",
        "--node-monitor-grace-period=40s", "--horizontal-pod-autoscaler-sync-period=5s"])
    spawn("kube-scheduler", [B("kube-scheduler"), *common])
    ctrd = spawn("containerd", [B("containerd"), f"--config={run / 'containerd' / 'config.toml'}"])
    sock, deadline = run / "containerd" / "containerd.sock", time.monotonic() + 60
    while not sock.exists() and ctrd.poll() is None and time.monotonic() < deadline:  # the kubelet needs its CRI
        time.sleep(0.2)
    spawn("kubelet", [B("kubelet"), f"--config={run / 'kubelet.yaml'}",
                      f"--kubeconfig={run / 'kubelet.kubeconfig'}", f"--root-dir={run / 'kubelet'}",
                      f"--hostname-override={NODE}", f"--node-ip={NODE_IP}", "--v=1"])
    spawn("kube-proxy", [B("kube-proxy"), f"--config={run / 'kube-proxy.yaml'}", "--v=1"])
    spawn("coredns", [B("coredns"), "-conf", str(run / "Corefile")])
    spawn("kube-router", kube_router_argv(run))
    (run / "supervisor.ready").write_text(json.dumps({n: p.pid for n, p in procs}))

    while not stopping:
        for i, (name, p) in enumerate(procs):
            if p.poll() is None or name == "coredns":
                continue
            if name == "kube-router":  # it exits until its node and RBAC exist: restarted, as its DaemonSet would be
                time.sleep(2)
                procs[i] = (name, spawn_detached(name, kube_router_argv(run)))
                continue
            log(f"{name} exited with {p.returncode}; see {logs / (name + '.log')}")
            stopping.append(1)
        time.sleep(0.5)

    # Pods first: the kubelet would restart what is killed under it, and a container outlives containerd.
    stop(procs, "kubelet")
    kill_containers(run)
    for name in ("kube-router", "kube-proxy", "coredns", "containerd", "kube-scheduler", "kube-controller-manager",
                 "kube-apiserver", "etcd"):
        stop(procs, name)


def stop(procs: list[tuple[str, subprocess.Popen]], name: str, grace: float = 10.0) -> None:
    for n, p in procs:
        if n == name and p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def kill_containers(run: pathlib.Path) -> None:
    """Every runc container of this node (pod sandboxes and their containers), then their shims."""
    root = run / "runc"
    for ns_root in sorted(root.glob("*")) if root.exists() else []:
        r = sh(DEBIAN["runc"], "--root", str(ns_root), "list", "-q", check=False)
        for cid in r.stdout.split():
            sh(DEBIAN["runc"], "--root", str(ns_root), "kill", "-a", cid, "KILL", check=False)
        deadline = time.monotonic() + 10
        for cid in r.stdout.split():
            while time.monotonic() < deadline:
                if sh(DEBIAN["runc"], "--root", str(ns_root), "delete", "-f", cid, check=False).returncode == 0:
                    break
                time.sleep(0.2)
    for pid in pids_matching(str(run), "containerd-shim"):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def pids_matching(*needles: str) -> list[int]:
    out = []
    for p in pathlib.Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(n in cmd for n in needles):
            out.append(int(p.name))
    return out


# ---- on the host: up / down -------------------------------------------------------------------------------------

class Cluster:
    def __init__(self, run: pathlib.Path):
        self.run = run
        self.kubeconfig = run / "admin.kubeconfig"
        self.state_file = run / "state.json"
        self.state = json.loads(self.state_file.read_text()) if self.state_file.exists() else {}

    @property
    def netns(self) -> str:
        return self.state["netns"]

    def bin(self, name: str) -> str:
        return str(kh.CACHE / "bin" / name)

    @property
    def env(self) -> dict:
        h = self.run / "home"
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "HELM_CACHE_HOME": str(h / "helm-cache"),
                "HELM_CONFIG_HOME": str(h / "helm-config"), "HELM_DATA_HOME": str(h / "helm-data"),
                "NO_PROXY": f"{NODE_IP},{HOST_IP},127.0.0.1,localhost,.svc,.cluster.local", "no_proxy": NODE_IP}

    def in_node(self, *argv: str) -> list[str]:
        """argv run inside the node's network namespace (a client reaching Services and pods)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    # -- up --
    @classmethod
    def up(cls, run: pathlib.Path, images: list[dict]) -> "Cluster":
        """images: [{"image": ref, "archive": path}] imported into containerd; the first whose ref contains
        "pause" is the sandbox image."""
        if (run / "state.json").exists():
            raise RuntimeError(f"a cluster already lives in {run}: `cluster.py down --dir {run}` first")
        reclaim_stale()
        left = leftovers()
        if left:
            raise RuntimeError(f"an earlier cluster left things behind (run `cluster.py down`): {left}")
        t0 = time.monotonic()
        ensure_debian_packages()
        kh.ensure_tools("etcd", "kubernetes", "node", "containerd", "coredns", "kube-router")
        run.mkdir(parents=True, exist_ok=True)
        sfx = os.urandom(2).hex()
        state = {"netns": PREFIX + sfx, "veth": PREFIX + sfx, "cgroup_root": PREFIX + sfx, "timings": {}}
        (run / "state.json").write_text(json.dumps(state))
        c = cls(run)
        try:
            c._up(images)
        except BaseException:
            c.dump_logs()
            c.down()
            raise
        c.state["timings"]["up"] = round(time.monotonic() - t0, 1)
        c.state_file.write_text(json.dumps(c.state))
        return c

    def _up(self, images: list[dict]) -> None:
        s, run = self.state, self.run
        t = time.monotonic()
        make_pki(run / "pki")
        pause = next(i["image"] for i in images if "pause" in i["image"])
        write_configs(run, s["cgroup_root"], pause)
        # the node's network: a namespace, one veth to the host, a default route to nowhere behind the no-escape chain
        ns, veth = s["netns"], s["veth"]
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", veth)
        sh("ip", "link", "set", veth, "up")
        x = lambda *a: sh("ip", "netns", "exec", ns, *a)  # noqa: E731
        # what a client in the node resolves with (`ip netns exec` shows it as /etc/resolv.conf): the cluster DNS
        etc = pathlib.Path("/etc/netns") / ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text(f"nameserver {DNS_IP}\nsearch svc.cluster.local cluster.local\n"
                                         "options ndots:5\n")
        x("ip", "link", "set", "lo", "up")
        x("ip", "addr", "add", f"{NODE_IP}/24", "dev", "eth0")
        x("ip", "link", "set", "eth0", "up")
        # (a veth pair with both ends inside: this kernel has no dummy devices)
        x("ip", "link", "add", "nowhere", "type", "veth", "peer", "name", "nowhere-end")
        x("ip", "link", "set", "nowhere", "up")
        x("ip", "link", "set", "nowhere-end", "up")
        x("ip", "route", "add", "default", "dev", "nowhere")
        x("iptables", "-N", "H3S-NO-ESCAPE")
        for cidr in ALLOWED:
            x("iptables", "-A", "H3S-NO-ESCAPE", "-d", cidr, "-j", "RETURN")
        # each destination it refused is remembered (xt_recent, this namespace's /proc/net/xt_recent/escapes)
        x("iptables", "-A", "H3S-NO-ESCAPE", "-m", "recent", "--name", "escapes", "--set", "--rdest")
        x("iptables", "-A", "H3S-NO-ESCAPE", "-j", "REJECT")
        for chain in ("OUTPUT", "FORWARD"):
            x("iptables", "-I", chain, "1", "-j", "H3S-NO-ESCAPE")
        # the cgroup root the kubelet puts every pod under (it must exist in each hierarchy)
        for h in cgroup_hierarchies():
            d = h / s["cgroup_root"]
            d.mkdir(exist_ok=True)
            if h.name == "cpuset":
                for f in ("cpuset.cpus", "cpuset.mems"):
                    (d / f).write_text((h / f).read_text())
        s["timings"]["prepare"] = round(time.monotonic() - t, 1)

        t = time.monotonic()
        # A private mount namespace (mounts propagate into it, never out) joined to the node's network namespace.
        # Not `ip netns exec`: that remounts /sys and so hides the cgroup hierarchies the kubelet and runc need.
        sup = subprocess.Popen(["unshare", "--mount", "--propagation", "slave", "nsenter", f"--net=/run/netns/{ns}",
                                sys.executable, __file__, "supervise", "--dir", str(run)],
                               stdout=open(run / "supervisor.log", "ab"), stderr=subprocess.STDOUT,
                               start_new_session=True, cwd=run)
        s["supervisor"] = sup.pid
        self.state_file.write_text(json.dumps(s))
        self.wait("API server", lambda: self.get("/readyz") == "ok", 120, sup)
        s["timings"]["control-plane"] = round(time.monotonic() - t, 1)

        t = time.monotonic()
        for img in images:
            self.import_image(img["archive"], img["image"])
        s["timings"]["images"] = round(time.monotonic() - t, 1)

        t = time.monotonic()
        self.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                           "items": dns_objects() + kube_router_rbac()}))
        self.wait("node Ready", self.node_ready, 180, sup)
        self.wait("default ServiceAccount", lambda: self.kubectl("get", "sa", "default", check=False).returncode == 0,
                  60, sup)
        s["timings"]["node"] = round(time.monotonic() - t, 1)

    def import_image(self, archive: str, ref: str) -> None:
        ctr = [self.bin("ctr"), "--address", str(self.run / "containerd" / "containerd.sock"), "-n", "k8s.io"]
        have = sh(*ctr, "images", "ls", "-q", check=False).stdout.split()
        if ref in have:
            return
        log(f"importing {ref}")
        sh(*ctr, "images", "import", "--no-unpack=false", "--snapshotter", "overlayfs", archive)
        if ref not in sh(*ctr, "images", "ls", "-q").stdout.split():
            raise RuntimeError(f"{archive} imported, but containerd has no image {ref}")

    def node_ready(self) -> bool:
        r = self.kubectl("get", "node", NODE, "-o", "json", check=False)
        if r.returncode:
            return False
        conds = json.loads(r.stdout)["status"].get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    def wait(self, what, fn, timeout, proc=None):
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the node's supervisor exited ({proc.returncode}) while waiting for {what}; "
                                   f"logs in {self.run / 'logs'}")
            try:
                if fn():
                    return
            except Exception as e:  # noqa: BLE001 - not up yet
                last = e
            time.sleep(0.5)
        raise TimeoutError(f"{what} not ready after {timeout}s (last error: {last}); logs in {self.run / 'logs'}")

    def get(self, path: str) -> str:
        D = self.run / "pki"
        ctx = ssl.create_default_context(cafile=str(D / "ca.crt"))
        ctx.load_cert_chain(str(D / "admin.crt"), str(D / "admin.key"))
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx))
        with opener.open(f"https://{NODE_IP}:6443{path}", timeout=5) as r:
            return r.read().decode()

    def kubectl(self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120):
        r = subprocess.run(["kubectl", f"--kubeconfig={self.kubeconfig}", *args], capture_output=True, text=True,
                           input=input, env=self.env, timeout=timeout)
        if check and r.returncode:
            raise RuntimeError(f"kubectl {' '.join(args)}: {r.stderr.strip()}")
        return r

    def helm(self, *args: str, check: bool = True):
        r = subprocess.run([self.bin("helm"), f"--kubeconfig={self.kubeconfig}", *args], capture_output=True,
                           text=True, env=self.env, timeout=300)
        if check and r.returncode:
            raise RuntimeError(f"helm {' '.join(args)}: {r.stdout}\n{r.stderr}")
        return r

    def escapes(self) -> int:
        """Packets the node's components or pods sent to an address outside loopback and the test's own networks."""
        r = sh("ip", "netns", "exec", self.netns, "iptables", "-L", "H3S-NO-ESCAPE", "-v", "-x", "-n")
        rows = [ln.split() for ln in r.stdout.splitlines() if "REJECT" in ln]
        return sum(int(row[0]) for row in rows)

    def escaped_to(self) -> str:
        """The destinations `escapes()` counted (xt_recent's table of them)."""
        return sh("ip", "netns", "exec", self.netns, "cat", "/proc/net/xt_recent/escapes", check=False).stdout

    def dump_logs(self, lines: int = 30) -> str:
        out = []
        for f in sorted((self.run / "logs").glob("*.log")) + [self.run / "supervisor.log"]:
            if f.exists():
                out.append(f"==== {f.name} ====\n" + "\n".join(f.read_text(errors="replace").splitlines()[-lines:]))
        text = "\n".join(out)
        print(text, file=sys.stderr)
        return text

    # -- down --
    def down(self) -> None:
        s = self.state
        pid = s.get("supervisor")
        if pid:
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and pid_alive(pid):
                time.sleep(0.2)
        # whatever is still alive of this node (a supervisor killed with -9 stops nothing)
        for p in pids_matching(str(self.run)):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        kill_containers(self.run)
        time.sleep(0.5)
        if s.get("netns"):
            sh("ip", "netns", "del", s["netns"], check=False)
            shutil.rmtree(pathlib.Path("/etc/netns") / s["netns"], ignore_errors=True)
        if s.get("veth"):
            sh("ip", "link", "del", s["veth"], check=False)
        if s.get("cgroup_root"):
            remove_cgroups(s["cgroup_root"])
        logs_dir = pathlib.Path("/var/log/containers")  # the kubelet's fixed symlink folder
        if logs_dir.is_dir():
            for ln in logs_dir.iterdir():
                if ln.is_symlink() and str(self.run) in os.readlink(ln):
                    ln.unlink()
        if not os.environ.get("H3SERVE_KEEP_CLUSTER_DIR"):
            shutil.rmtree(self.run, ignore_errors=True)
        else:
            self.state_file.unlink(missing_ok=True)


def cgroup_hierarchies() -> list[pathlib.Path]:
    return [p for p in CGROUPS.iterdir() if p.is_dir() and (p / "cgroup.procs").exists()]


def remove_cgroups(name: str) -> None:
    for h in cgroup_hierarchies():
        top = h / name
        if not top.exists():
            continue
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
        try:
            top.rmdir()
        except OSError:
            pass


def pid_alive(pid: int) -> bool:
    """False once `pid` has exited (a zombie child of ours is reaped here)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:  # not our child
        pass
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def leftovers() -> list[str]:
    """Everything a cluster of this harness could leave behind on the host; [] when it left nothing."""
    out = []
    netns = sh("ip", "netns", "list", check=False).stdout
    out += [f"netns {ln.split()[0]}" for ln in netns.splitlines() if ln.startswith(PREFIX)]
    links = sh("ip", "-o", "link", "show", check=False).stdout
    out += [f"link {ln.split(':')[1].strip().split('@')[0]}" for ln in links.splitlines()
            if ln.split(":")[1].strip().startswith(PREFIX)]
    etc = pathlib.Path("/etc/netns")
    out += [f"file {p}" for p in (etc.glob(PREFIX + "*") if etc.exists() else [])]
    out += [f"address {HOST_IP}" for _ in [0] if f"inet {HOST_IP}/" in sh("ip", "-o", "addr", check=False).stdout]
    for h in cgroup_hierarchies():
        out += [f"cgroup {p}" for p in h.glob(PREFIX + "*")]
    for line in pathlib.Path("/proc/self/mountinfo").read_text().splitlines():
        f = line.split()
        if PREFIX in f[4] or "h3serve-cluster" in f[4]:
            out.append(f"mount {f[4]}")
    for pid in pids_matching("h3serve-cluster"):  # a cluster's folder: DEFAULT_DIR or h3serve-cluster-XXXX
        if "pytest" not in (pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")):
            out.append(f"process {pid}")
    if os.path.exists(DEBIAN["iptables"]):
        rules = sh("iptables-save", check=False).stdout + sh("iptables-save", "-t", "nat", check=False).stdout
        out += [f"host iptables {ln}" for ln in rules.splitlines() if "KUBE-" in ln or "CNI-" in ln or "H3S-" in ln]
    return out


def reclaim_stale() -> list[str]:
    """Tear down what a dead cluster left behind (a test run killed mid-way never reaches `down`); returns what it
    found. A cluster with a live process is someone's running cluster and is left alone."""
    left = leftovers()
    if not left or any(x.startswith(("process ", "host iptables ")) for x in left):
        return []
    log(f"reclaiming what a dead cluster left: {left}")
    for d in sorted(pathlib.Path("/tmp").glob("h3serve-cluster*")) + [DEFAULT_DIR]:
        if (d / "state.json").exists():
            Cluster(d).down()
    # a container outlives its killed shim in the cluster's cgroups
    for h in cgroup_hierarchies():
        for top in h.glob(PREFIX + "*"):
            for procs in top.rglob("cgroup.procs"):
                for pid in procs.read_text().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
    time.sleep(0.5)
    for line in reversed(pathlib.Path("/proc/self/mountinfo").read_text().splitlines()):
        target = line.split()[4]
        if PREFIX in target or "h3serve-cluster" in target:
            sh("umount", "-l", target, check=False)
    for x in leftovers():
        kind, _, name = x.partition(" ")
        if kind == "netns":
            sh("ip", "netns", "del", name, check=False)
        elif kind == "link":
            sh("ip", "link", "del", name, check=False)
        elif kind == "file":
            shutil.rmtree(name, ignore_errors=True)
        elif kind == "cgroup":
            remove_cgroups(pathlib.Path(name).name)
    return left


def dns_objects() -> list[dict]:
    """The kube-dns Service on its fixed ClusterIP, its endpoint the node's CoreDNS (a node process, not a pod)."""
    ports = [{"name": "dns", "port": 53, "protocol": "UDP"}, {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]
    return [
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}},
         "spec": {"clusterIP": DNS_IP, "ports": [{**p, "targetPort": 53} for p in ports]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": "kube-dns-node", "namespace": "kube-system",
                      "labels": {"kubernetes.io/service-name": "kube-dns",
                                 "endpointslice.kubernetes.io/managed-by": "h3serve-test-harness"}},
         "addressType": "IPv4", "endpoints": [{"addresses": [NODE_IP], "conditions": {"ready": True}}],
         "ports": ports},
    ]


def kube_router_rbac() -> list[dict]:
    """What kube-router's firewall reads (upstream's ClusterRole, less what its router and proxy would write)."""
    rules = [{"apiGroups": [""], "resources": ["namespaces", "pods", "services", "nodes", "endpoints"],
              "verbs": ["get", "list", "watch"]},
             {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["get", "list", "watch"]},
             {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "kube-router"},
         "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "kube-router"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "kube-router"},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "kube-router"}]},
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cmd", choices=["up", "down", "leftovers", "supervise"])
    ap.add_argument("--dir", type=pathlib.Path, default=DEFAULT_DIR)
    a = ap.parse_args()
    run = a.dir.resolve()
    if a.cmd == "supervise":
        supervise(run)
    elif a.cmd == "up":
        images = build_images()
        c = Cluster.up(run, images)
        print(json.dumps(c.state["timings"]), file=sys.stderr)
        print(f"export KUBECONFIG={c.kubeconfig}")
        print(f"# clients reach Services from inside the node: ip netns exec {c.netns} curl http://<svc>.<ns>.svc:8000")
    elif a.cmd == "down":
        Cluster(run).down()
        left = leftovers()
        if left:
            print("\n".join(left))
            sys.exit(1)
    else:
        left = leftovers()
        print("\n".join(left) or "nothing left")
        sys.exit(1 if left else 0)


def build_images() -> list[dict]:
    """The project's image and the sandbox image, built (or found in the cache) by scripts/image.sh."""
    r = subprocess.run(["bash", str(ROOT / "scripts" / "image.sh")], stdout=subprocess.PIPE, text=True)
    if r.returncode:
        raise RuntimeError(f"scripts/image.sh failed ({r.returncode})")
    j = json.loads(r.stdout.strip().splitlines()[-1])
    return [{"image": j["image"], "archive": j["archive"]}, {"image": j["pause"], "archive": j["pause_archive"]}]


if __name__ == "__main__":
    main()
