"""The user's path on a real single-node cluster (cluster.py): `helm install` the operator, `kubectl apply` the CPU
example, every stage Ready in real containers of the project's image, then a video through the gateway Service with
the SDK, curl and the OpenAI SDK, byte-identical to the embedded `h3serve generate` of the same request; day 2 on
real pods; and at the end nothing left behind."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import cluster as C  # noqa: E402

pytestmark = pytest.mark.realcluster

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "h3serve-operator"
SYSTEM_NS, APPS_NS, RELEASE = "h3-system", "apps", "h3op"
KEY_A = "h3k-realcluster-caller-a"
REQUEST = {"prompt": "a kite over the sea", "seconds": 5, "size": "256x256", "seed": 0, "num_inference_steps": 3}
FIGURES: dict = {}


def log_figure(key: str, value) -> None:
    FIGURES[key] = value
    print(f"FIGURE {key} = {value}")


# ---- fixtures -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(image, request):
    run = pathlib.Path(tempfile.mkdtemp(prefix="h3serve-cluster-", dir="/tmp"))
    images = [{"image": image["image"], "archive": image["archive"]},
              {"image": image["pause"], "archive": image["pause_archive"]}]
    c = C.Cluster.up(run, images)
    log_figure("cluster_up_s", c.state["timings"])
    try:
        yield c
    finally:
        if os.environ.get("H3SERVE_DUMP_CLUSTER_LOGS"):
            c.dump_logs()
        escapes, where = c.escapes(), c.escaped_to()
        if request.session.testsfailed:  # keep the logs (components' and pods') of a failed run
            keep = pathlib.Path(tempfile.mkdtemp(prefix="h3serve-cluster-logs-"))
            for d in ("logs", "pod-logs"):
                shutil.copytree(c.run / d, keep / d, dirs_exist_ok=True, ignore_dangling_symlinks=True)
            print(f"cluster logs kept in {keep}")
        c.down()
        log_figure("figures", json.dumps(FIGURES))
        assert escapes == 0, f"{escapes} packets tried to leave the test's networks, to:\n{where}"
        assert C.leftovers() == []


@pytest.fixture(scope="module")
def weights(cluster, operator):
    """The tiny checkpoint on a local PersistentVolume (the volume kind the operator's policy allows)."""
    models = cluster.run / "models"
    subprocess.run([sys.executable, "-m", "h3serve.cli", "checkpoint", "init", "--preset", "tiny",
                    str(models / "tiny")], check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    for p in [models, *models.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    os.chmod(cluster.run, 0o755)  # the pods (uid 65532) read the volume through it
    apply(cluster, weights_objects(str(models), APPS_NS))
    return models / "tiny"


def weights_objects(path: str, ns: str) -> list[dict]:
    return [
        {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "local-weights"},
         "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "Immediate"},
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "h3-tiny-weights"},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"],
                  "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "local-weights",
                  "local": {"path": path},
                  "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                      {"key": "kubernetes.io/hostname", "operator": "In", "values": [C.NODE]}]}]}}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "h3-tiny-weights", "namespace": ns},
         "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "local-weights",
                  "volumeName": "h3-tiny-weights", "resources": {"requests": {"storage": "1Gi"}}}},
    ]


def apply(cluster, objs: list[dict]) -> None:
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}))


@pytest.fixture(scope="module")
def operator(cluster, image):
    """helm install: the operator runs as a pod of the image, with the chart's RBAC."""
    repo, tag = image["image"].rsplit(":", 1)
    t0 = time.monotonic()
    cluster.kubectl("create", "namespace", APPS_NS)  # the chart's Role for the namespace it watches goes there
    cluster.helm("install", RELEASE, str(CHART), "--namespace", SYSTEM_NS, "--create-namespace",
                 "--set", f"image.repository={repo}", "--set-string", f"image.tag={tag}",   # tests/helm: digits
                 "--set", "image.pullPolicy=Never",
                 "--set", f"watchNamespaces={{{APPS_NS}}}", "--set", "operator.resyncSeconds=15")
    wait_pods_ready(cluster, SYSTEM_NS, "app.kubernetes.io/name=h3serve-operator", 1, timeout=300)
    log_figure("operator_ready_s", round(time.monotonic() - t0, 1))
    return {"repo": repo, "tag": tag}


@pytest.fixture(scope="module")
def api_keys(cluster, weights):
    keys = f"caller-a sha256:{hashlib.sha256(KEY_A.encode()).hexdigest()}\n"
    apply(cluster, [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "h3-api-keys", "namespace": APPS_NS},
                     "stringData": {"keys": keys}}])
    return KEY_A


@pytest.fixture(scope="module")
def embedded(weights):
    """`h3serve generate` of REQUEST in this process's venv, on the same checkpoint: the bytes to match."""
    out = weights.parent.parent / "embedded.mp4"
    r = subprocess.run([sys.executable, "-m", "h3serve.cli", "generate", "--checkpoint", str(weights),
                        "--prompt", REQUEST["prompt"], "--seconds", str(REQUEST["seconds"]), "--size", REQUEST["size"],
                        "--seed", str(REQUEST["seed"]), "--steps", str(REQUEST["num_inference_steps"]),
                        "--no-progress", "-o", str(out)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return out.read_bytes()


# ---- helpers --------------------------------------------------------------------------------------------------

def pods(cluster, ns: str, selector: str) -> list[dict]:
    r = cluster.kubectl("get", "pods", "-n", ns, "-l", selector, "-o", "json")
    return json.loads(r.stdout)["items"]


def is_ready(pod: dict) -> bool:
    return pod["metadata"].get("deletionTimestamp") is None and any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def wait_pods_ready(cluster, ns: str, selector: str, count: int, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    last = []
    while time.monotonic() < deadline:
        last = pods(cluster, ns, selector)
        ready = [p for p in last if is_ready(p)]
        if len(ready) == count and len(last) == count:
            return ready
        time.sleep(1)
    cluster.dump_logs()
    desc = cluster.kubectl("describe", "pods", "-n", ns, "-l", selector, check=False).stdout
    logs = cluster.kubectl("logs", "-n", ns, "-l", selector, "--tail=40", "--all-containers", check=False)
    raise AssertionError(f"{count} ready pods {selector} in {ns} not reached in {timeout}s:\n{desc[-6000:]}\n"
                         f"{logs.stdout[-4000:]}{logs.stderr[-1000:]}")


def cr_ready(cluster, name: str) -> bool:
    r = cluster.kubectl("get", "h3d", name, "-n", APPS_NS, "-o", "json", check=False)
    if r.returncode:
        return False
    conds = json.loads(r.stdout).get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def deploy(cluster, operator, name: str, patch: dict | None = None, timeout: float = 600) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / "cpu-tiny.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": APPS_NS}
    doc["spec"]["image"] = f"{operator['repo']}:{operator['tag']}"
    merge(doc["spec"], patch or {})
    t0 = time.monotonic()
    apply(cluster, [doc])
    deadline = time.monotonic() + timeout
    while not cr_ready(cluster, name):
        if time.monotonic() > deadline:
            wait_pods_ready(cluster, APPS_NS, f"app.kubernetes.io/instance={name}", 99, 1)  # raises with details
        time.sleep(2)
    started = pods(cluster, APPS_NS, f"app.kubernetes.io/instance={name}")
    return {"ready_s": round(time.monotonic() - t0, 1), "pods": len(started), "doc": doc}


def merge(into: dict, patch: dict) -> None:
    for k, v in patch.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            merge(into[k], v)
        else:
            into[k] = v


def in_node(cluster, argv: list[str], timeout: float = 600, input: str | None = None) -> subprocess.CompletedProcess:
    """A client process inside the node's network namespace: it reaches Services by their cluster DNS names."""
    return subprocess.run(cluster.in_node(*argv), capture_output=True, text=True, timeout=timeout, input=input,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "NO_PROXY": "*", "no_proxy": "*"})


def svc(name: str) -> str:
    return f"{name}-gateway.{APPS_NS}.svc.cluster.local"


def sdk_argv(name: str, out: pathlib.Path, key: str = KEY_A, extra: tuple = ()) -> list[str]:
    return [sys.executable, "-m", "h3serve.cli", "generate", "--server", f"{svc(name)}:50051", "--api-key", key,
            "--prompt", REQUEST["prompt"], "--seconds", str(REQUEST["seconds"]), "--size", REQUEST["size"],
            "--seed", str(REQUEST["seed"]), "--steps", str(REQUEST["num_inference_steps"]), "--no-progress", "--json",
            *extra, "-o", str(out)]


def sdk_generate(cluster, name: str, out: pathlib.Path, key: str = KEY_A, extra: tuple = ()) -> subprocess.CompletedProcess:
    return in_node(cluster, sdk_argv(name, out, key, extra))


def curl_job(cluster, name: str, out: pathlib.Path, key: str = KEY_A, ca: pathlib.Path | None = None,
             body: dict | None = None) -> dict:
    """POST /v1/videos, poll the job, GET its content: curl, as a user would type it (HTTPS when `ca`)."""
    base = f"{'https' if ca else 'http'}://{svc(name)}:8000/v1/videos"
    auth = ["-H", f"authorization: Bearer {key}", *(["--cacert", str(ca)] if ca else [])]
    body = json.dumps(body or {"prompt": REQUEST["prompt"], "seconds": str(REQUEST["seconds"]),
                               "size": REQUEST["size"], "seed": REQUEST["seed"],
                               "num_inference_steps": REQUEST["num_inference_steps"]})
    r = in_node(cluster, ["curl", "-sS", "--fail-with-body", *auth, "-H", "content-type: application/json",
                          "-d", body, base])
    assert r.returncode == 0, r.stdout + r.stderr
    job = json.loads(r.stdout)
    deadline = time.monotonic() + 600
    while job["status"] not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(1)
        job = json.loads(in_node(cluster, ["curl", "-sS", *auth, f"{base}/{job['id']}"]).stdout)
    assert job["status"] == "completed", job
    r = in_node(cluster, ["curl", "-sS", "--fail-with-body", *auth, "-o", str(out), f"{base}/{job['id']}/content"])
    assert r.returncode == 0, r.stderr
    return job


OPENAI_CLIENT = textwrap.dedent("""
    import json, sys, warnings
    warnings.simplefilter("ignore")
    import openai
    base, key, req, out = sys.argv[1:5]
    req = json.loads(req)
    sdk = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=600)
    v = sdk.videos.create_and_poll(prompt=req["prompt"], size=req["size"], seconds=str(req["seconds"]),
                                   extra_body={"seed": req["seed"], "num_inference_steps": req["num_inference_steps"]},
                                   poll_interval_ms=500)
    assert v.status == "completed", v
    open(out, "wb").write(sdk.videos.download_content(v.id).read())
    print(json.dumps({"id": v.id, "status": v.status}))
""")


def ffprobe_ok(path: pathlib.Path) -> dict:
    r = subprocess.run(["ffprobe", "-v", "error", "-show_streams", "-of", "json", str(path)], capture_output=True,
                       text=True, check=True)
    streams = {s["codec_type"]: s for s in json.loads(r.stdout)["streams"]}
    assert streams["video"]["codec_name"] == "h264" and streams["audio"]["codec_name"] == "aac"
    assert streams["audio"]["sample_rate"] == "32000" and streams["audio"]["channels"] == 2
    return streams


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


# ---- the tests ------------------------------------------------------------------------------------------------

def test_operator_runs_as_a_pod_of_the_image_with_the_charts_rbac(cluster, operator):
    [pod] = pods(cluster, SYSTEM_NS, "app.kubernetes.io/name=h3serve-operator")
    c = pod["spec"]["containers"][0]
    assert c["image"] == f"{operator['repo']}:{operator['tag']}" and c["imagePullPolicy"] == "Never"
    st = pod["status"]["containerStatuses"][0]
    assert st["ready"] and st["restartCount"] == 0, st
    # it reached the API server through the kubernetes Service with its own ServiceAccount: the CRD it applies
    crd = cluster.kubectl("get", "crd", "h3deployments.h3serve.io", "-o", "json")
    assert json.loads(crd.stdout)["metadata"]["name"] == "h3deployments.h3serve.io"


def test_cpu_tiny_colocated_serves_the_embedded_bytes_through_the_gateway_service(
        cluster, operator, api_keys, embedded, tmp_path):
    d = deploy(cluster, operator, "h3-tiny")
    log_figure("colocated_pods", d["pods"])
    log_figure("colocated_ready_s", d["ready_s"])
    [pod] = pods(cluster, APPS_NS, "app.kubernetes.io/instance=h3-tiny")
    assert pod["spec"]["securityContext"]["runAsUser"] == 65532
    assert pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    want = sha(embedded)

    out = cluster.run / "sdk.mp4"
    r = sdk_generate(cluster, "h3-tiny", out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sha(out.read_bytes()) == want
    ffprobe_ok(out)

    out = cluster.run / "curl.mp4"
    curl_job(cluster, "h3-tiny", out)
    assert sha(out.read_bytes()) == want

    out = cluster.run / "openai.mp4"
    r = in_node(cluster, [sys.executable, "-c", OPENAI_CLIENT, f"http://{svc('h3-tiny')}:8000/v1", KEY_A,
                          json.dumps(REQUEST), str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert sha(out.read_bytes()) == want

    # the keys come from the Secret: no key, or a wrong one, is refused
    r = in_node(cluster, ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", f"http://{svc('h3-tiny')}:8000/v1/videos"])
    assert r.stdout == "401", r.stdout
    r = sdk_generate(cluster, "h3-tiny", cluster.run / "x.mp4", key="wrong")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    cluster.kubectl("delete", "h3d", "h3-tiny", "-n", APPS_NS, "--wait=false")  # its CPU is the next tests'




# ---- disaggregated, TLS on, day 2 -----------------------------------------------------------------------------

LONG = {**REQUEST, "seconds": 8, "size": "256x256", "num_inference_steps": 40}  # long enough to act mid-job
ROLLING = {**LONG, "num_inference_steps": 160}  # outlasts a new DiT pod's start-up (the rolling update's surge)


@pytest.fixture(scope="module")
def disaggregated(cluster, operator, api_keys):
    """cpu-tiny, one workload per stage, TLS at the front door and mTLS between the stages, from a Secret whose
    certificate names what the renderer's own cert-manager Certificate would name."""
    from h3serve.config.spec import H3DeploymentSpec
    from h3serve.operator import manifests as M

    name = "h3-tiny-d"
    patch = {"placement": "disaggregated", "tls": {"secretName": f"{name}-tls"}}
    doc = yaml.safe_load((ROOT / "examples" / "cpu-tiny.yaml").read_text())
    # the names of the Services with a FastH3 pool too (a later test adds one)
    pool = {"adapter": {"path": "/models/fasth3.safetensors", "sha256": "0" * 64}}
    merge(doc["spec"], {**patch, "fasth3": pool,
                        "tls": {"secretName": f"{name}-tls", "certManager": {"issuerRef": {"name": "x"}}}})
    [cert] = [o for o in M.render(H3DeploymentSpec.from_dict(doc["spec"]), name, APPS_NS) if o["kind"] == "Certificate"]
    pki = cluster.run / "deployment-pki"
    pki.mkdir()
    o = lambda *a: subprocess.run(["openssl", *a], cwd=pki, check=True, capture_output=True)  # noqa: E731
    o("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "30", "-subj",
      "/CN=h3-tiny-d-ca", "-keyout", "ca.key", "-out", "ca.crt")
    sans = [*(f"DNS:{d}" for d in cert["spec"]["dnsNames"]), *(f"IP:{i}" for i in cert["spec"]["ipAddresses"])]
    (pki / "ext").write_text(f"subjectAltName={','.join(sans)}\nextendedKeyUsage=serverAuth,clientAuth\n"
                             "keyUsage=critical,digitalSignature\n")
    o("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", f"/CN={name}",
      "-keyout", "tls.key", "-out", "tls.csr")
    o("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "30",
      "-extfile", "ext", "-out", "tls.crt")
    cluster.kubectl("create", "secret", "generic", f"{name}-tls", "-n", APPS_NS, "--type=kubernetes.io/tls",
                    f"--from-file=tls.crt={pki / 'tls.crt'}", f"--from-file=tls.key={pki / 'tls.key'}",
                    f"--from-file=ca.crt={pki / 'ca.crt'}")
    d = deploy(cluster, operator, name, patch)
    log_figure("disaggregated_pods", d["pods"])
    log_figure("disaggregated_ready_s", d["ready_s"])
    return {"name": name, "ca": pki / "ca.crt"}


def tls_generate(cluster, dep, out: pathlib.Path, req: dict = REQUEST) -> subprocess.Popen:
    argv = cluster.in_node(sys.executable, "-m", "h3serve.cli", "generate", "--server", f"{svc(dep['name'])}:50051",
                           "--tls-ca", str(dep["ca"]), "--api-key", KEY_A, "--prompt", req["prompt"],
                           "--seconds", str(req["seconds"]), "--size", req["size"], "--seed", str(req["seed"]),
                           "--steps", str(req["num_inference_steps"]), "--no-progress", "--json", "-o", str(out))
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "NO_PROXY": "*", "no_proxy": "*"})


def finish(p: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def stage_pod(cluster, dep, stage: str) -> dict:
    [pod] = [p for p in pods(cluster, APPS_NS, f"app.kubernetes.io/instance={dep['name']},"
                                              f"app.kubernetes.io/component={stage}") if is_ready(p)]
    return pod


def wait_all_ready(cluster, dep, timeout: float = 600) -> None:
    """Every pod Ready, the H3Deployment Ready, and the gateway's own /ready: it sees every stage SERVING."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ps = pods(cluster, APPS_NS, f"app.kubernetes.io/instance={dep['name']}")
        if ps and all(is_ready(p) for p in ps) and cr_ready(cluster, dep["name"]):
            r = in_node(cluster, ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "5",
                                  "--cacert", str(dep["ca"]), f"https://{svc(dep['name'])}:8000/ready"], timeout=15)
            if r.stdout == "200":
                return
        time.sleep(1)
    raise AssertionError(f"{dep['name']} not Ready again after {timeout}s")


def wait_degraded(cluster, name: str, reason: str, timeout: float = 120) -> dict:
    """The H3Deployment's Degraded condition, once its reason is `reason` (asserted within `timeout`)."""
    deadline, degraded = time.monotonic() + timeout, {}
    while time.monotonic() < deadline and degraded.get("reason") != reason:
        conds = json.loads(cluster.kubectl("get", "h3d", name, "-n", APPS_NS, "-o", "json").stdout).get(
            "status", {}).get("conditions", [])
        degraded = next((c for c in conds if c["type"] == "Degraded"), {})
        time.sleep(1)
    assert degraded.get("reason") == reason, degraded
    return degraded


def wait_busy(cluster, dep, stage: str = "dit", timeout: float = 120) -> None:
    """Until `stage` reports a job in flight (its /metrics, scraped inside the node as Prometheus would). The VAE and
    the muxer join a job only once the DiT is done (the gateway relays the latents)."""
    pod = stage_pod(cluster, dep, stage)
    [port] = [p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])
              if p["name"].startswith("metrics")]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = in_node(cluster, ["curl", "-s", "--max-time", "2", f"http://{pod['status']['podIP']}:{port}/metrics"],
                    timeout=10)
        busy = [ln for ln in r.stdout.splitlines() if ln.startswith(f'h3serve_stage_active_requests{{stage="{stage}"}}')]
        if busy and float(busy[0].split()[1]) > 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"the {stage} never reported an active request: {r.stdout[-800:]}")


def test_disaggregated_with_tls_serves_the_embedded_bytes(cluster, disaggregated, embedded):
    out = cluster.run / "tls.mp4"
    code, so, se = finish(tls_generate(cluster, disaggregated, out))
    assert code == 0, se[-3000:]
    assert sha(out.read_bytes()) == sha(embedded)
    # the front door is TLS only: plaintext HTTP is refused
    r = in_node(cluster, ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "10",
                          f"http://{svc(disaggregated['name'])}:8000/v1/models"])
    assert r.stdout != "200"
    r = in_node(cluster, ["curl", "-sS", "--cacert", str(disaggregated["ca"]), "-H", f"authorization: Bearer {KEY_A}",
                          f"https://{svc(disaggregated['name'])}:8000/v1/models"])
    assert r.returncode == 0 and "data" in json.loads(r.stdout), r.stdout + r.stderr
    # Behind the NetworkPolicies (kube-router enforces them), mTLS: a client that reaches a stage port without the
    # deployment's certificate gets no answer from it (the node itself may reach its pods: kubelet, this client)
    dit = stage_pod(cluster, disaggregated, "dit")["status"]["podIP"]
    r = in_node(cluster, [sys.executable, "-c", STRANGER, f"{dit}:50051", str(disaggregated["ca"])], timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["refused", "refused"], r.stdout + r.stderr


def test_network_policies_keep_a_pod_outside_the_deployment_off_the_stage_ports(cluster, image, disaggregated):
    """A pod without the deployment's labels reaches the gateway's ports and no stage's; one with them reaches the
    stages too (where mTLS then asks for the certificate)."""
    name = disaggregated["name"]
    policies = json.loads(cluster.kubectl("get", "networkpolicy", "-n", APPS_NS, "-o", "json").stdout)["items"]
    assert {p["metadata"]["name"] for p in policies} >= {f"{name}-stages", f"{name}-gateway"}, policies
    stages = {s: f"{stage_pod(cluster, disaggregated, s)['status']['podIP']}:50051"
              for s in ("encoder", "dit", "vae", "muxer")}
    gateway = stage_pod(cluster, disaggregated, "gateway")["status"]["podIP"]
    targets = [*stages.values(), f"{gateway}:50051", f"{gateway}:8000"]
    outside = tcp_reach_from_pod(cluster, image, "outsider", {"app": "outsider"}, targets)
    assert outside == {**{t: "blocked" for t in stages.values()}, f"{gateway}:50051": "connected",
                       f"{gateway}:8000": "connected"}, outside
    member = tcp_reach_from_pod(cluster, image, "member", {"app.kubernetes.io/name": "h3serve",
                                                            "app.kubernetes.io/instance": name}, targets,
                                patience_s=60)
    assert set(member.values()) == {"connected"}, member


REACH = textwrap.dedent("""
    import socket, sys, time
    patience = float(sys.argv[1])    # a policy that admits this pod lands only once the firewall has seen its IP
    for target in sys.argv[2:]:
        host, port = target.rsplit(":", 1)
        deadline = time.monotonic() + patience
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=5).close()
                print(target, "connected")
                break
            except OSError:
                if time.monotonic() >= deadline:
                    print(target, "blocked")
                    break
                time.sleep(1)
""")


def tcp_reach_from_pod(cluster, image: dict, name: str, labels: dict, targets: list[str],
                      patience_s: float = 0) -> dict[str, str]:
    """{target: "connected" | "blocked"}: TCP connects from a pod of the project's image in the apps namespace, each
    target retried for patience_s (kube-router admits a new pod's IP on its next sync, seconds after the pod starts)."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": APPS_NS, "labels": labels},
           "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 65532,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [{"name": "reach", "image": image["image"], "imagePullPolicy": "Never",
                                    "command": ["python", "-c", REACH, str(patience_s), *targets],
                                    "resources": {"requests": {"cpu": "50m"}},
                                    "securityContext": {"allowPrivilegeEscalation": False,
                                                        "readOnlyRootFilesystem": True,
                                                        "capabilities": {"drop": ["ALL"]}}}]}}
    apply(cluster, [pod])
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            phase = json.loads(cluster.kubectl("get", "pod", name, "-n", APPS_NS, "-o", "json").stdout)[
                "status"].get("phase")
            if phase in ("Succeeded", "Failed"):
                break
            time.sleep(1)
        logs = cluster.kubectl("logs", name, "-n", APPS_NS).stdout
        assert phase == "Succeeded", f"{name}: {phase}\n{logs}"
        return dict(ln.split() for ln in logs.splitlines() if ln.strip())
    finally:
        cluster.kubectl("delete", "pod", name, "-n", APPS_NS, "--grace-period=0", "--force", check=False)


STRANGER = textwrap.dedent("""
    import sys, grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    target, ca = sys.argv[1:3]
    for creds in (None, grpc.ssl_channel_credentials(open(ca, "rb").read())):   # plaintext; TLS with no client cert
        ch = grpc.insecure_channel(target) if creds is None else grpc.secure_channel(
            target, creds, options=[("grpc.ssl_target_name_override", "x")])
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            print("answered")
        except grpc.RpcError:
            print("refused")
""")


def metric(cluster, pod: dict, port: int, name: str) -> float:
    r = in_node(cluster, ["curl", "-s", "--max-time", "5", f"http://{pod['status']['podIP']}:{port}/metrics"], timeout=15)
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith(name)]
    return float(rows[0].split()[-1]) if rows else 0.0


def test_dit_scaled_to_two_serves_and_restarts_no_other_pod(cluster, disaggregated, embedded):
    sel = f"app.kubernetes.io/instance={disaggregated['name']}"
    before = {p["metadata"]["uid"]: p["status"]["containerStatuses"][0]["restartCount"] for p in pods(cluster, APPS_NS, sel)}
    t0 = time.monotonic()
    cluster.kubectl("scale", "h3d", disaggregated["name"], "-n", APPS_NS, "--replicas=2")
    ready = wait_pods_ready(cluster, APPS_NS, f"{sel},app.kubernetes.io/component=dit", 2, timeout=600)
    log_figure("dit_scale_1_to_2_ready_s", round(time.monotonic() - t0, 1))
    now = {p["metadata"]["uid"]: p["status"]["containerStatuses"][0]["restartCount"] for p in pods(cluster, APPS_NS, sel)}
    assert set(before) <= set(now) and all(now[u] == before[u] for u in before)  # no other pod replaced or restarted
    [new] = [p for p in ready if p["metadata"]["uid"] not in before]
    # the gateway balances per call over the headless Service: the new DiT gets calls
    try:
        # the gateway balances per call over the headless Service; its channel finds the new replica when the old
        # connection ages out (the servers' max connection age)
        served, deadline = 0.0, time.monotonic() + 120
        i = 0
        while not served and time.monotonic() < deadline:
            out = cluster.run / f"scaled-{i}.mp4"
            code, so, se = finish(tls_generate(cluster, disaggregated, out))
            assert code == 0 and sha(out.read_bytes()) == sha(embedded), se[-3000:]
            served = metric(cluster, new, 9402, 'h3serve_stage_requests_total{stage="dit"}')
            i += 1
        assert served >= 1, f"the new DiT pod got no call in {i} jobs"
        log_figure("dit_scaled_new_pod_first_call_after_jobs", i)
    finally:
        cluster.kubectl("scale", "h3d", disaggregated["name"], "-n", APPS_NS, "--replicas=1")
        wait_pods_ready(cluster, APPS_NS, f"{sel},app.kubernetes.io/component=dit", 1, timeout=300)


def test_a_quota_that_refuses_a_new_dit_pod_is_degraded_naming_it_while_the_rest_serves(cluster, disaggregated,
                                                                                         embedded):
    """A ResourceQuota with room for the pods that run and no more: the DiT scaled to two asks for one more pod, which
    the quota refuses; the H3Deployment says so (Degraded=PodCreationFailed, the API server's words) while the
    running pods serve the embedded bytes; with the quota gone the second DiT comes."""
    name, quota = disaggregated["name"], "h3-room-for-what-runs"
    sel = f"app.kubernetes.io/instance={name},app.kubernetes.io/component=dit"
    every = json.loads(cluster.kubectl("get", "pods", "-n", APPS_NS, "-o", "json").stdout)["items"]
    running = [p for p in every if p["status"].get("phase") not in ("Succeeded", "Failed")]
    apply(cluster, [{"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": quota, "namespace": APPS_NS},
                     "spec": {"hard": {"pods": str(len(running))}}}])
    try:
        cluster.kubectl("scale", "h3d", name, "-n", APPS_NS, "--replicas=2")
        degraded = wait_degraded(cluster, name, "PodCreationFailed")
        assert "exceeded quota" in degraded["message"] and quota in degraded["message"], degraded
        out = cluster.run / "under-quota.mp4"
        code, so, se = finish(tls_generate(cluster, disaggregated, out))
        assert code == 0 and sha(out.read_bytes()) == sha(embedded), se[-3000:]
        cluster.kubectl("delete", "resourcequota", quota, "-n", APPS_NS)
        wait_pods_ready(cluster, APPS_NS, sel, 2, timeout=600)
    finally:
        cluster.kubectl("delete", "resourcequota", quota, "-n", APPS_NS, "--ignore-not-found")
        cluster.kubectl("scale", "h3d", name, "-n", APPS_NS, "--replicas=1")
        wait_pods_ready(cluster, APPS_NS, sel, 1, timeout=300)
    wait_all_ready(cluster, disaggregated)


def test_a_rolling_update_of_the_dit_drains_its_job_and_loses_none(cluster, disaggregated, embedded):
    """A DiT-only spec change mid-job: the operator rolls the DiT Deployment, a new pod first (CPU pods surge: the
    capacity never drops), then the old pod is deleted while it holds the job and drains it to the end; no other
    stage's pod is replaced."""
    sel = f"app.kubernetes.io/instance={disaggregated['name']}"
    others = {p["metadata"]["uid"] for p in pods(cluster, APPS_NS, sel)
              if p["metadata"]["labels"]["app.kubernetes.io/component"] != "dit"}
    out = cluster.run / "drain.mp4"
    job = tls_generate(cluster, disaggregated, out, ROLLING)
    wait_busy(cluster, disaggregated)
    old = stage_pod(cluster, disaggregated, "dit")
    t0 = time.monotonic()
    cluster.kubectl("patch", "h3d", disaggregated["name"], "-n", APPS_NS, "--type=merge", "-p",
                    json.dumps({"spec": {"dit": {"resources": {"requests": {"cpu": "110m", "memory": "1Gi"},
                                                                "limits": {"memory": "6Gi"}}}}}))
    deadline = t0 + 300
    while time.monotonic() < deadline:
        r = cluster.kubectl("get", "pod", old["metadata"]["name"], "-n", APPS_NS, "-o", "json", check=False)
        if r.returncode or json.loads(r.stdout)["metadata"].get("deletionTimestamp"):
            break
        time.sleep(0.5)
    else:
        raise AssertionError("the rolling update never deleted the old DiT pod")
    log_figure("rolling_update_old_dit_deleted_after_s", round(time.monotonic() - t0, 1))
    surge = [p for p in pods(cluster, APPS_NS, f"{sel},app.kubernetes.io/component=dit")
             if p["metadata"]["uid"] != old["metadata"]["uid"] and is_ready(p)]
    assert surge, "the old DiT pod went before a new one was Ready"
    assert job.poll() is None, "the job ended before the update reached its pod: make ROLLING longer"
    t1 = time.monotonic()
    code, so, se = finish(job)
    assert code == 0, se[-3000:]  # finished on the pod being deleted
    log_figure("drained_job_done_after_delete_s", round(time.monotonic() - t1, 1))
    ffprobe_ok(out)
    wait_all_ready(cluster, disaggregated)
    log_figure("dit_rolled_ready_s", round(time.monotonic() - t0, 1))
    rolled = [p for p in pods(cluster, APPS_NS, f"{sel},app.kubernetes.io/component=dit")
              if p["metadata"]["uid"] != old["metadata"]["uid"]]
    assert rolled and all(p["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "110m" for p in rolled)
    assert others <= {p["metadata"]["uid"] for p in pods(cluster, APPS_NS, sel)}  # only the DiT rolled
    out = cluster.run / "after-drain.mp4"
    code, so, se = finish(tls_generate(cluster, disaggregated, out))
    assert code == 0 and sha(out.read_bytes()) == sha(embedded), se[-3000:]


# The encoder is left out: its part is over before the DiT starts (a job no longer needs it then; the watchdog
# knows), so killing it mid-job loses nothing, which the drain and the DiT cases already show.
@pytest.mark.parametrize("stage", ["dit", "vae", "muxer"])
def test_a_stage_pod_killed_mid_job_fails_it_naming_the_stage_then_recovers(cluster, disaggregated, embedded, stage):
    out = cluster.run / f"killed-{stage}.mp4"
    job = tls_generate(cluster, disaggregated, out, LONG)
    wait_busy(cluster, disaggregated, stage)
    victim = stage_pod(cluster, disaggregated, stage)
    t0 = time.monotonic()
    cluster.kubectl("delete", "pod", "-n", APPS_NS, victim["metadata"]["name"], "--grace-period=0", "--force",
                    "--wait=false")
    code, so, se = finish(job)
    FIGURES.setdefault("killed_to_client_error_s", {})[stage] = round(time.monotonic() - t0, 1)
    assert code != 0 and stage in se.lower() and "Traceback" not in se, se[-3000:]
    assert not out.exists()  # nothing half-written presented as done
    wait_all_ready(cluster, disaggregated)
    FIGURES.setdefault("killed_to_recovered_s", {})[stage] = round(time.monotonic() - t0, 1)
    out = cluster.run / f"after-{stage}.mp4"
    code, so, se = finish(tls_generate(cluster, disaggregated, out))
    assert code == 0 and sha(out.read_bytes()) == sha(embedded), se[-3000:]


def test_a_fasth3_pool_beside_the_base_one_is_routed_by_model(cluster, disaggregated, weights, embedded):
    """spec.fasth3: a second DiT pool with its adapter; `model: FastH3` goes there, no model to the base pool."""
    adapter = weights.parent / "fasth3.safetensors"
    subprocess.run([sys.executable, "-m", "h3serve.cli", "checkpoint", "init-adapter", "--checkpoint", str(weights),
                    "-o", str(adapter)], check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    adapter.chmod(0o644)
    digest = hashlib.sha256(adapter.read_bytes()).hexdigest()
    fast_out = weights.parent.parent / "embedded-fasth3.mp4"
    r = subprocess.run([sys.executable, "-m", "h3serve.cli", "generate", "--checkpoint", str(weights), "--profile",
                        "fasth3", "--adapter", str(adapter), "--adapter-sha256", digest, "--prompt", REQUEST["prompt"],
                        "--seconds", str(REQUEST["seconds"]), "--size", REQUEST["size"], "--seed",
                        str(REQUEST["seed"]), "--no-progress", "-o", str(fast_out)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    patch = {"spec": {"fasth3": {"adapter": {"path": "/models/fasth3.safetensors", "sha256": digest},
                                 "replicas": 1, "resources": {"requests": {"cpu": "100m", "memory": "1Gi"}}}}}
    t0 = time.monotonic()
    cluster.kubectl("patch", "h3d", disaggregated["name"], "-n", APPS_NS, "--type=merge", "-p", json.dumps(patch))
    wait_pods_ready(cluster, APPS_NS, f"app.kubernetes.io/instance={disaggregated['name']},"
                                      f"app.kubernetes.io/component=dit-fasth3", 1, timeout=600)
    wait_all_ready(cluster, disaggregated)
    log_figure("fasth3_pool_ready_s", round(time.monotonic() - t0, 1))
    body = {"prompt": REQUEST["prompt"], "seconds": str(REQUEST["seconds"]), "size": REQUEST["size"],
            "seed": REQUEST["seed"], "model": "FastH3"}
    out = cluster.run / "fasth3.mp4"
    job = curl_job(cluster, disaggregated["name"], out, ca=disaggregated["ca"], body=body)
    assert job["model"] == "FastH3" and sha(out.read_bytes()) == sha(fast_out.read_bytes())
    out = cluster.run / "base-beside-fasth3.mp4"   # no model: the deployment's own pool
    code, so, se = finish(tls_generate(cluster, disaggregated, out))
    assert code == 0 and sha(out.read_bytes()) == sha(embedded), se[-3000:]


def container_main_pid(pod: dict) -> int:
    """The host PID of a pod's first container's main process (the one its cgroup names the pod by)."""
    uid = pod["metadata"]["uid"].replace("-", "_")
    want = (pod["metadata"]["uid"], uid)
    cid = pod["status"]["containerStatuses"][0]["containerID"].split("//")[-1]
    for p in pathlib.Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cg = (p / "cgroup").read_text()
            status = (p / "status").read_text()
        except OSError:
            continue
        if cid in cg and any(w in cg for w in want):
            ppid = int(status.split("PPid:")[1].split()[0])
            try:
                parent_cg = pathlib.Path(f"/proc/{ppid}/cgroup").read_text()
            except OSError:
                parent_cg = ""
            if cid not in parent_cg:  # the container's first process: its parent is the shim
                return int(p.name)
    raise AssertionError(f"no process of container {cid}")


def test_a_stopped_stage_container_is_restarted_by_its_liveness_probe(cluster, disaggregated, embedded):
    """SIGSTOP: the process keeps its port open and answers nothing; the exec liveness probe finds it."""
    pod = stage_pod(cluster, disaggregated, "vae")
    before = pod["status"]["containerStatuses"][0]["restartCount"]
    os.kill(container_main_pid(pod), 19)  # SIGSTOP
    t0 = time.monotonic()
    deadline = t0 + 420
    while time.monotonic() < deadline:
        r = cluster.kubectl("get", "pod", "-n", APPS_NS, pod["metadata"]["name"], "-o", "json")
        st = json.loads(r.stdout)["status"]["containerStatuses"][0]
        if st["restartCount"] > before and st.get("ready"):
            break
        time.sleep(2)
    else:
        raise AssertionError(f"the stopped VAE container was not restarted: {st}")
    log_figure("sigstop_to_restarted_ready_s", round(time.monotonic() - t0, 1))
    events = cluster.kubectl("get", "events", "-n", APPS_NS, "--field-selector",
                             f"involvedObject.name={pod['metadata']['name']}", "-o", "json")
    assert any("Liveness probe failed" in (e.get("message") or "") for e in json.loads(events.stdout)["items"])
    wait_all_ready(cluster, disaggregated)
    out = cluster.run / "after-sigstop.mp4"
    code, so, se = finish(tls_generate(cluster, disaggregated, out))
    assert code == 0 and sha(out.read_bytes()) == sha(embedded), se[-3000:]


# ---- DiT gangs on real pods -----------------------------------------------------------------------------------
# A CPU "node" of one core: gpusPerNode 1 with ulysses 2 makes each DiT replica a gang of two pods, one rank each,
# one torch.distributed (gloo) world across them over the pod network, found through the gang's headless Service.
# Two replicas are two gangs; the tiny checkpoint's bytes are those of degree 1 (tests/parallel shows it).

GANG = "h3-tiny-g"


@pytest.fixture(scope="module")
def gangs(cluster, operator, api_keys):
    d = deploy(cluster, operator, GANG, {"placement": "disaggregated", "gpusPerNode": 1, "drainSeconds": 20,
                                         "dit": {"ulysses": 2, "replicas": 2}})
    log_figure("gangs_ready_s", d["ready_s"])
    yield {"name": GANG}
    cluster.kubectl("delete", "h3d", GANG, "-n", APPS_NS, "--wait=true", "--timeout=300s")
    deadline = time.monotonic() + 300
    while pods(cluster, APPS_NS, f"app.kubernetes.io/instance={GANG}") and time.monotonic() < deadline:
        time.sleep(1)


def gang_members(cluster) -> dict[str, list[dict]]:
    """gang StatefulSet name -> its member pods (deleting ones too)."""
    out: dict[str, list[dict]] = {}
    for p in pods(cluster, APPS_NS, f"app.kubernetes.io/instance={GANG},app.kubernetes.io/component=dit"):
        out.setdefault(p["metadata"]["labels"]["h3serve.io/gang"], []).append(p)
    return out


def whole(members: list[dict], size: int = 2) -> bool:
    return len(members) == size and all(is_ready(p) for p in members)


def recorded_world(cluster, gang: str) -> set[str]:
    sts = json.loads(cluster.kubectl("get", "statefulset", gang, "-n", APPS_NS, "-o", "json").stdout)
    return set(filter(None, sts["metadata"].get("annotations", {}).get("h3serve.io/world", "").split(",")))


def wait_gangs_whole(cluster, timeout: float = 600) -> dict[str, list[dict]]:
    """Both gangs whole and each one's recorded world its live members."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        g = gang_members(cluster)
        if len(g) == 2 and all(whole(m) and recorded_world(cluster, n) == {p["metadata"]["uid"] for p in m}
                               for n, m in g.items()):
            return g
        time.sleep(1)
    raise AssertionError(f"the gangs were not whole again in {timeout}s: "
                         f"{ {n: [(p['metadata']['name'], is_ready(p)) for p in m] for n, m in gang_members(cluster).items()} }")


def evict(cluster, pod: dict) -> subprocess.CompletedProcess:
    """The Eviction API, as `kubectl drain` calls it: 201, or 429 while the disruption budget allows none."""
    body = {"apiVersion": "policy/v1", "kind": "Eviction",
            "metadata": {"name": pod["metadata"]["name"], "namespace": APPS_NS}}
    return cluster.kubectl("create", "--raw", f"/api/v1/namespaces/{APPS_NS}/pods/{pod['metadata']['name']}/eviction",
                           "-f", "-", input=json.dumps(body), check=False)


def test_two_cpu_gangs_of_two_pods_each_serve_the_embedded_bytes(cluster, gangs, embedded):
    g = wait_gangs_whole(cluster)
    assert sorted(g) == [f"{GANG}-dit-0", f"{GANG}-dit-1"]
    for members in g.values():
        ranks = sorted(int(p["metadata"]["labels"]["apps.kubernetes.io/pod-index"]) for p in members)
        assert ranks == [0, 1]
        for p in members:  # Ready through the operator's gate: each is in its gang's recorded world
            assert p["spec"]["readinessGates"] == [{"conditionType": "h3serve.io/in-gang-world"}]
            assert any(c["type"] == "h3serve.io/in-gang-world" and c["status"] == "True"
                       for c in p["status"]["conditions"]), p["status"]["conditions"]
    for i in range(2):  # the gateway balances per call over the gangs' leaders
        out = cluster.run / f"gang-{i}.mp4"
        r = sdk_generate(cluster, GANG, out)
        assert r.returncode == 0 and sha(out.read_bytes()) == sha(embedded), r.stderr[-3000:]
    served = {n: metric(cluster, next(p for p in m if p["metadata"]["labels"]["apps.kubernetes.io/pod-index"] == "0"),
                        9402, 'h3serve_stage_requests_total{stage="dit"}') for n, m in g.items()}
    log_figure("gang_leader_calls", served)
    assert sum(served.values()) >= 2, served


def test_a_drain_evicts_one_gang_pod_and_no_other_until_that_gang_is_whole_again(cluster, gangs, embedded):
    """`kubectl drain` through the Eviction API: one pod of gang 0 goes; every eviction of a gang-1 pod is refused
    (429) until gang 0 has restarted whole, its new world recorded; meanwhile gang 1 serves."""
    g = wait_gangs_whole(cluster)
    first, other = g[f"{GANG}-dit-0"], g[f"{GANG}-dit-1"]
    old = {p["metadata"]["uid"] for p in first}
    worker = next(p for p in first if p["metadata"]["labels"]["apps.kubernetes.io/pod-index"] == "1")
    t0 = time.monotonic()
    r = evict(cluster, worker)
    assert r.returncode == 0, r.stderr
    out = cluster.run / "during-drain.mp4"
    job = subprocess.Popen(cluster.in_node(*sdk_argv(GANG, out)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "NO_PROXY": "*", "no_proxy": "*"})
    refused, deadline = 0, t0 + 600
    while True:
        assert time.monotonic() < deadline, f"no eviction of gang 1 was allowed in 600 s ({refused} refused)"
        r = evict(cluster, other[refused % 2])
        if r.returncode == 0:
            break
        assert "disruption budget" in r.stderr, r.stderr
        refused += 1
        time.sleep(0.5)
    allowed_after = round(time.monotonic() - t0, 1)
    # the eviction that was allowed came after gang 0 was whole again: new members only, running together
    now = gang_members(cluster)[f"{GANG}-dit-0"]
    assert whole(now) and not old & {p["metadata"]["uid"] for p in now}, [
        (p["metadata"]["name"], p["metadata"]["uid"] in old, is_ready(p)) for p in now]
    assert recorded_world(cluster, f"{GANG}-dit-0") == {p["metadata"]["uid"] for p in now}
    log_figure("gang_drain", {"refused": refused, "next_eviction_allowed_after_s": allowed_after})
    assert refused >= 1
    code, so, se = finish(job)
    assert code == 0 and sha(out.read_bytes()) == sha(embedded), se[-3000:]
    wait_gangs_whole(cluster)
    out = cluster.run / "after-gang-drain.mp4"
    r = sdk_generate(cluster, GANG, out)
    assert r.returncode == 0 and sha(out.read_bytes()) == sha(embedded), r.stderr[-3000:]


def test_dit_gangs_roll_one_at_a_time_on_real_pods_and_one_always_serves(cluster, gangs, embedded):
    """A DiT spec change: gang 1 waits while gang 0 takes the new template, then rolls; polled every 0.5 s, never 0
    whole gangs; every member at the new template after."""
    wait_gangs_whole(cluster)
    t0 = time.monotonic()
    cluster.kubectl("patch", "h3d", GANG, "-n", APPS_NS, "--type=merge", "-p",
                    json.dumps({"spec": {"dit": {"resources": {"requests": {"cpu": "110m", "memory": "1Gi"},
                                                                "limits": {"memory": "6Gi"}}}}}))
    fewest, polls, deadline = 2, 0, t0 + 900
    new = lambda p: p["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "110m"  # noqa: E731
    while time.monotonic() < deadline:
        g = gang_members(cluster)
        n_whole = sum(whole([p for p in m if not p["metadata"].get("deletionTimestamp")]) for m in g.values())
        fewest, polls = min(fewest, n_whole), polls + 1
        assert n_whole >= 1, f"0 whole gangs {round(time.monotonic() - t0, 1)} s after the patch"
        if len(g) == 2 and all(whole(m) and all(new(p) for p in m) for m in g.values()):
            break
        time.sleep(0.5)
    else:
        raise AssertionError("the gangs did not both take the new template in 900 s")
    log_figure("gang_roll", {"done_s": round(time.monotonic() - t0, 1), "polls": polls, "fewest_whole": fewest})
    # with dit.rollout.maxSurge 1 (the default) a surge gang may keep both old gangs whole (2); in place, 1
    assert fewest >= 1
    wait_gangs_whole(cluster)
    out = cluster.run / "after-gang-roll.mp4"
    r = sdk_generate(cluster, GANG, out)
    assert r.returncode == 0 and sha(out.read_bytes()) == sha(embedded), r.stderr[-3000:]


def test_a_quota_that_refuses_a_third_gang_is_degraded_naming_its_statefulset(cluster, gangs, embedded):
    """dit.replicas 2 -> 3 under a ResourceQuota with room for the pods that run: the third gang's StatefulSet gets
    no pod, which its FailedCreate Events say (a StatefulSet has no ReplicaFailure condition), so the H3Deployment is
    Degraded=PodCreationFailed naming it while the two gangs serve; without the quota the third gang forms."""
    quota, third = "h3-room-for-two-gangs", f"{GANG}-dit-2"
    wait_gangs_whole(cluster)
    every = json.loads(cluster.kubectl("get", "pods", "-n", APPS_NS, "-o", "json").stdout)["items"]
    running = [p for p in every if p["status"].get("phase") not in ("Succeeded", "Failed")]
    apply(cluster, [{"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": quota, "namespace": APPS_NS},
                     "spec": {"hard": {"pods": str(len(running))}}}])
    try:
        cluster.kubectl("patch", "h3d", GANG, "-n", APPS_NS, "--type=merge", "-p",
                        json.dumps({"spec": {"dit": {"replicas": 3}}}))
        degraded = wait_degraded(cluster, GANG, "PodCreationFailed")
        msg = degraded["message"]
        assert msg.startswith(f"StatefulSet/{third}:") and "exceeded quota" in msg and quota in msg, msg
        out = cluster.run / "gangs-under-quota.mp4"
        r = sdk_generate(cluster, GANG, out)
        assert r.returncode == 0 and sha(out.read_bytes()) == sha(embedded), r.stderr[-3000:]
        cluster.kubectl("delete", "resourcequota", quota, "-n", APPS_NS)
        deadline = time.monotonic() + 600
        while not whole(gang_members(cluster).get(third, [])):
            assert time.monotonic() < deadline, "the third gang did not form once the quota was gone"
            time.sleep(1)
    finally:
        cluster.kubectl("delete", "resourcequota", quota, "-n", APPS_NS, "--ignore-not-found")
        cluster.kubectl("patch", "h3d", GANG, "-n", APPS_NS, "--type=merge", "-p",
                        json.dumps({"spec": {"dit": {"replicas": 2}}}))
    wait_gangs_whole(cluster)


def paths_that_differ(a, b, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [x for k in sorted(set(a) | set(b)) for x in
                ([f"{path}/{k}: only one side"] if (k in a) != (k in b) else paths_that_differ(a[k], b[k], f"{path}/{k}"))]
    return [] if a == b else [f"{path}: {str(a)[:60]} != {str(b)[:60]}"]


def strict_dry_run(cluster, cr: dict) -> subprocess.CompletedProcess:
    """A server-side dry run of creating `cr` that refuses a field the stored CRD does not know."""
    return cluster.kubectl("create", "--dry-run=server", "--validate=strict", "-f", "-", input=json.dumps(cr),
                           check=False)


def test_helm_upgrade_with_a_crd_change_rolls_only_the_operator_and_uninstall_leaves_what_it_says(
        cluster, operator, disaggregated):
    """The release before this one had a CRD without a field this one has (the stored CRD is set back to that):
    `helm upgrade` never touches crds/, so the new operator pod applies its CRD at start; the users' H3Deployments
    keep their spec and no serving pod restarts."""
    crd_name = "h3deployments.h3serve.io"
    current = json.loads(cluster.kubectl("get", "crd", crd_name, "-o", "json").stdout)
    crs = json.loads(cluster.kubectl("get", "h3d", "-A", "-o", "json").stdout)["items"]
    used = {k for cr in crs for k in cr["spec"]}
    field = next(f for f in ("priorityClassName", "tolerations", "nodeSelector") if f not in used)
    older = json.loads(json.dumps(current))
    del older["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][field]
    cluster.kubectl("replace", "-f", "-", input=json.dumps(older))
    [mine] = [cr for cr in crs if cr["metadata"]["name"] == disaggregated["name"]]
    probe = {"apiVersion": mine["apiVersion"], "kind": mine["kind"],
             "metadata": {"name": "crd-probe", "namespace": APPS_NS},
             "spec": {**mine["spec"], field: "x" if field == "priorityClassName" else ({} if field == "nodeSelector"
                                                                                       else [])}}
    deadline = time.monotonic() + 30  # the API server serves the replaced schema within moments
    while strict_dry_run(cluster, probe).returncode == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    refused = strict_dry_run(cluster, probe)
    assert refused.returncode != 0 and field in refused.stderr, refused.stderr

    workload_pods = {p["metadata"]["uid"] for p in pods(cluster, APPS_NS, "app.kubernetes.io/part-of=h3serve")}
    [old_op] = pods(cluster, SYSTEM_NS, "app.kubernetes.io/name=h3serve-operator")
    cluster.helm("upgrade", RELEASE, str(CHART), "--namespace", SYSTEM_NS, "--reuse-values",
                 "--set", "operator.resyncSeconds=20")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        ops = pods(cluster, SYSTEM_NS, "app.kubernetes.io/name=h3serve-operator")
        if len(ops) == 1 and ops[0]["metadata"]["uid"] != old_op["metadata"]["uid"] and is_ready(ops[0]):
            break
        time.sleep(1)
    else:
        raise AssertionError("the upgraded operator pod did not take over")
    assert cr_ready(cluster, disaggregated["name"])
    after = {p["metadata"]["uid"] for p in pods(cluster, APPS_NS, "app.kubernetes.io/part-of=h3serve")}
    assert after == workload_pods  # an operator upgrade restarts no serving pod
    # the CRD the new operator applied is the one it was built with: the field is known again
    from h3serve.operator import crd as crd_module
    stored = json.loads(cluster.kubectl("get", "crd", crd_name, "-o", "json").stdout)
    differ = paths_that_differ(stored["spec"]["versions"][0]["schema"], crd_module.crd()["spec"]["versions"][0]["schema"])
    [new_op] = pods(cluster, SYSTEM_NS, "app.kubernetes.io/name=h3serve-operator")
    assert not differ, (differ[:20], new_op["spec"]["containers"][0].get("args"),
                        cluster.kubectl("logs", "-n", SYSTEM_NS, new_op["metadata"]["name"]).stdout[-3000:])
    accepted = strict_dry_run(cluster, probe)
    assert accepted.returncode == 0, accepted.stderr
    after_cr = json.loads(cluster.kubectl("get", "h3d", disaggregated["name"], "-n", APPS_NS, "-o", "json").stdout)
    assert after_cr["spec"] == mine["spec"]
    log_figure("helm_upgrade_crd_field_restored", field)

    cluster.helm("uninstall", RELEASE, "--namespace", SYSTEM_NS, "--wait")
    deadline = time.monotonic() + 120  # the operator pod takes its grace period to go
    while pods(cluster, SYSTEM_NS, "app.kubernetes.io/name=h3serve-operator") and time.monotonic() < deadline:
        time.sleep(1)
    left = cluster.kubectl("get", "all,sa,role,rolebinding,lease", "-n", SYSTEM_NS, "-o", "name").stdout.split()
    left = [x for x in left if not x.endswith("/default") and "kube-root-ca" not in x]
    # Helm removes everything of the release; the operator's leader Lease (it wrote it, not Helm) is the one thing left
    assert all(x.startswith("lease.coordination.k8s.io/") for x in left), left
    # by Helm's rule for crds/ the CRD stays, and with it the users' H3Deployments and what serves them
    assert cluster.kubectl("get", "crd", "h3deployments.h3serve.io", check=False).returncode == 0
    assert cr_ready(cluster, disaggregated["name"]) or cluster.kubectl(
        "get", "h3d", disaggregated["name"], "-n", APPS_NS, check=False).returncode == 0
    log_figure("left_after_uninstall", left + ["crd/h3deployments.h3serve.io", "the H3Deployments and their children"])


def test_nothing_dialled_outside_the_tests_networks(cluster):
    assert cluster.escapes() == 0, cluster.escaped_to()
