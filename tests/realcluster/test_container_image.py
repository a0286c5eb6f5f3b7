"""The image the test cluster runs (scripts/image.sh): what it contains, and that it runs as the pods run it.

Each archive is unpacked with umoci and run with Debian's runc the way the operator's pods run: as the image's user
(65532:65532), with a read-only root file system and /tmp a tmpfs, with no network but loopback.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import time
import uuid
from dataclasses import dataclass

import pytest

from h3serve.config.metrics import METRICS_PORT
from h3serve.config.vocab import GRPC_PORT, HTTP_PORT, PIPELINE_STAGES, PORT_OFFSETS

pytestmark = pytest.mark.realcluster

ROOT = pathlib.Path(__file__).resolve().parents[2]
PREFIX = "/opt/h3serve"


@dataclass
class Bundle:
    dir: pathlib.Path
    config: dict  # the OCI image config (what the archive says)
    spec: dict  # the runtime spec umoci derived from it

    @property
    def rootfs(self) -> pathlib.Path:
        return self.dir / "rootfs"


def _unpack(archive: str, name: str, dest: pathlib.Path) -> Bundle:
    layout = dest / "layout"
    layout.mkdir(parents=True)
    subprocess.run(["tar", "-xf", archive, "-C", str(layout)], check=True)
    index = json.loads((layout / "index.json").read_text())
    [desc] = index["manifests"]
    # `ctr images import` names the image by these annotations
    assert desc["annotations"]["io.containerd.image.name"] == name
    assert desc["annotations"]["org.opencontainers.image.ref.name"] == name
    blob = lambda d: json.loads((layout / "blobs/sha256" / d.split(":")[1]).read_text())  # noqa: E731
    config = blob(blob(desc["digest"])["config"]["digest"])
    desc["annotations"]["org.opencontainers.image.ref.name"] = "test"  # a plain tag for umoci's image:tag syntax
    (layout / "index.json").write_text(json.dumps(index))
    subprocess.run(["umoci", "unpack", "--image", f"{layout}:test", str(dest / "bundle")], check=True,
                   stdout=subprocess.DEVNULL)
    shutil.rmtree(layout)
    spec = json.loads((dest / "bundle" / "config.json").read_text())
    return Bundle(dest / "bundle", config, spec)


@pytest.fixture(scope="module")
def bundle(image, tmp_path_factory):
    d = tmp_path_factory.mktemp("image")
    try:
        yield _unpack(image["archive"], image["image"], d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def pause_bundle(image, tmp_path_factory):
    d = tmp_path_factory.mktemp("pause")
    try:
        yield _unpack(image["pause_archive"], image["pause"], d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


class Container:
    """One runc container of a bundle: read-only root, /tmp a tmpfs, the image's user unless told otherwise."""

    def __init__(self, runc: str, b: Bundle, args: list[str], env: dict[str, str] | None = None):
        self.runc, self.bundle = runc, b
        self.id = f"h3serve-test-{uuid.uuid4().hex[:8]}"
        self.state = b.dir.parent / "runc-state"
        spec = json.loads(json.dumps(b.spec))
        proc = spec["process"]
        proc.update(args=args, terminal=False)
        proc["env"] = [e for e in proc.get("env", []) if e.split("=", 1)[0] not in (env or {})]
        proc["env"] += [f"{k}={v}" for k, v in (env or {}).items()]
        spec["root"] = {"path": "rootfs", "readonly": True}
        spec["mounts"] = [m for m in spec["mounts"] if m["destination"] != "/tmp"] + [
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "nodev", "mode=1777", "size=2g"]}]
        spec.setdefault("linux", {}).setdefault("namespaces", [])
        assert {"type": "network"} in spec["linux"]["namespaces"] or any(
            n["type"] == "network" for n in spec["linux"]["namespaces"]), "a network namespace of its own"
        (b.dir / "config.json").write_text(json.dumps(spec))

    def run(self, timeout: float) -> subprocess.CompletedProcess:
        try:
            return subprocess.run([self.runc, "--root", str(self.state), "run", "--bundle", str(self.bundle.dir),
                                   self.id], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=timeout)
        finally:
            self.delete()

    def start(self) -> subprocess.Popen:
        return subprocess.Popen([self.runc, "--root", str(self.state), "run", "--bundle", str(self.bundle.dir),
                                 self.id], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def call(self, command: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([self.runc, "--root", str(self.state), command, self.id, *args], capture_output=True,
                              text=True, timeout=30)

    def delete(self) -> None:
        subprocess.run([self.runc, "--root", str(self.state), "delete", "--force", self.id],
                       capture_output=True, timeout=60)


def run_in(runc, b: Bundle, args: list[str], timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    r = Container(runc, b, args, **kw).run(timeout)
    print(r.stdout[-3000:], r.stderr[-3000:], sep="\n")
    return r


def python(code: str) -> list[str]:
    return ["python", "-c", code]


# --- what the image says -----------------------------------------------------------------------------------------


def test_config_is_what_the_pods_expect(bundle):
    c = bundle.config["config"]
    assert c["User"] == "65532:65532"
    assert c["WorkingDir"] == "/tmp"
    assert c["Cmd"] == ["h3serve", "--help"] and not c.get("Entrypoint")
    env = dict(e.split("=", 1) for e in c["Env"])
    assert env["PATH"].split(":")[0] == f"{PREFIX}/bin"
    assert {k: env[k] for k in ("PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "HF_HUB_OFFLINE", "HOME")} == {
        "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HOME": "/tmp"}
    exposed = {int(p.split("/")[0]) for p in c["ExposedPorts"]}
    dockerfile = {int(p) for p in re.search(r"^EXPOSE (.+)$", (ROOT / "Dockerfile").read_text(), re.M)
                  .group(1).split()}
    assert exposed == dockerfile
    assert {GRPC_PORT, HTTP_PORT, *(METRICS_PORT + PORT_OFFSETS[s] for s in PIPELINE_STAGES)} <= exposed
    assert bundle.config["os"] == "linux" and bundle.config["architecture"] == "amd64"
    assert bundle.spec["process"]["user"]["uid"] == 65532 and bundle.spec["process"]["user"]["gid"] == 65532


def test_contents(bundle):
    r = bundle.rootfs
    site = next(r.glob("opt/h3serve/lib/python3.*/site-packages"))
    # h3serve is the wheel's, not the checkout's editable install
    assert not list(site.glob("__editable__*")) and not list(site.glob("*.egg-link"))
    [info] = site.glob("h3serve-*.dist-info")
    assert (info / "RECORD").exists() and (site / "h3serve" / "cli.py").exists()
    assert (r / "opt/h3serve/bin/h3serve").read_text().startswith(f"#!{PREFIX}/bin/python\n")
    assert os.readlink(r / "opt/h3serve/bin/python").startswith("/opt/python/bin/python3")
    cfg = (r / "opt/h3serve/pyvenv.cfg").read_text()
    assert "home = /opt/python/bin\n" in cfg and "include-system-site-packages = false" in cfg
    # nothing in the venv skeleton names the machine the image was built on
    for f in ("opt/h3serve/pyvenv.cfg", "opt/h3serve/bin/h3serve"):
        assert str(ROOT) not in (r / f).read_text() and str(pathlib.Path.home()) not in (r / f).read_text()
    # CPU torch: no Triton, no CUDA Python bindings, no cuDNN engines; test-only packages stay out
    for gone in ("triton", "cuda", "_pytest", "schemathesis", "kubernetes_validate", "openai",
                 "nvidia/cudnn/lib/libcudnn_engines_precompiled.so.9", "nixl"):
        assert not (site / gone).exists(), gone
    for kept in ("torch", "av", "grpc", "kopf", "kubernetes", "nvidia/cu13/lib/libcudart.so.13"):
        assert (site / kept).exists(), kept
    # the interpreter's trimmed copy
    lib = next(r.glob("opt/python/lib/python3.*"))
    assert (lib / "os.py").exists() and not (lib / "test").exists() and not list(lib.glob("config-*/*.a"))
    assert not list((lib / "site-packages").iterdir())
    sizes = {p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink()) >> 20
             for p in (r / "opt/python", site / "torch", site / "nvidia")}
    print(f"MiB: {sizes}")


def test_every_shared_library_is_there(bundle):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "image_layers.py"), "check-libs", str(bundle.rootfs)],
                       capture_output=True, text=True)
    print(r.stderr)
    assert r.returncode == 0, r.stderr


# --- what it does, run as the pods run it -------------------------------------------------------------------------


def test_help_as_nonroot_on_a_readonly_root(runc, bundle):
    r = run_in(runc, bundle, ["h3serve", "--help"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "generate" in r.stdout and "operator" in r.stdout
    r = run_in(runc, bundle, python(
        "import errno, json, os, sys\n"
        "def w(p):\n"
        "    try:\n"
        "        open(p, 'w').close(); return 'ok'\n"
        "    except OSError as e:\n"
        "        return errno.errorcode[e.errno]\n"
        "print(json.dumps({'uid': os.getuid(), 'gid': os.getgid(), 'cwd': os.getcwd(), 'home': os.path.expanduser('~'),"
        " 'prefix': sys.prefix, 'base': sys.base_prefix, 'root': w('/x'), 'opt': w('/opt/h3serve/x'),"
        " 'tmp': w('/tmp/x'), 'cache': sys.dont_write_bytecode}))"), timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"uid": 65532, "gid": 65532, "cwd": "/tmp", "home": "/tmp", "prefix": PREFIX, "base": "/opt/python",
                   "root": "EROFS", "opt": "EROFS", "tmp": "ok", "cache": True}


MODULES = ["h3serve.services.encoder", "h3serve.services.dit", "h3serve.services.vae", "h3serve.services.muxer",
           "h3serve.services.gateway.server", "h3serve.operator.cli", "kopf", "av", "grpc", "torch"]


def test_every_stage_imports(runc, bundle):
    code = (
        "import importlib, json, time, traceback\n"
        "out = {}\n"
        f"for m in {MODULES!r}:\n"
        "    t = time.monotonic()\n"
        "    try:\n"
        "        importlib.import_module(m); out[m] = round(time.monotonic() - t, 2)\n"
        "    except BaseException:\n"
        "        out[m] = traceback.format_exc()\n"
        "import torch\n"
        "out['torch'] = [torch.__version__, torch.cuda.is_available(), float(torch.ones(3, 3).sum())]\n"
        "print(json.dumps(out))\n")
    r = run_in(runc, bundle, python(code), timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    failed = {m: v for m, v in got.items() if isinstance(v, str)}
    assert not failed, "\n".join(f"{m}:\n{v}" for m, v in failed.items())
    assert got["torch"][1:] == [False, 9.0]  # CPU: CUDA torch without a driver


def test_pause(runc, pause_bundle):
    b = pause_bundle
    assert b.config["config"]["User"] == "65535:65535" and b.config["config"]["Entrypoint"] == ["/pause"]
    assert [p.name for p in b.rootfs.iterdir()] == ["pause"]
    c = Container(runc, b, ["/pause"])
    p = c.start()
    try:
        for _ in range(100):
            st = c.call("state")
            if st.returncode == 0 and json.loads(st.stdout)["status"] == "running":
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"pause never ran: {st.stderr}")
        time.sleep(0.5)
        assert p.poll() is None, p.communicate()
        assert c.call("kill", "TERM").returncode == 0
        assert p.wait(timeout=20) == 0, p.communicate()
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate()
        c.delete()


def test_rebuild_with_nothing_changed_is_a_noop(image):
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(ROOT / "scripts" / "image.sh")], capture_output=True, text=True, timeout=600)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == image
    assert "up to date" in r.stderr
    assert took < 30, took
    with tarfile.open(image["archive"]) as t:
        assert {"oci-layout", "index.json"} <= set(t.getnames())
