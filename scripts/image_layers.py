"""What goes into each layer of the test image that scripts/image.sh builds, and the keys that decide a rebuild.

Run with the venv's interpreter (it reads the venv's installed distributions). Sub-commands:

  python-key HOME                  key of the interpreter layer (HOME: the `home =` of the venv's pyvenv.cfg)
  stage-python HOME OUT            OUT/ := the interpreter's prefix, trimmed to what runs (hard links where possible)
  site-key VENV EXTRAS             key of the site-packages layer (the distributions h3serve[EXTRAS] needs)
  stage-site VENV EXTRAS OUT       OUT/ := those distributions' files (no h3serve, no editable hooks, CPU torch)
  app-key ROOT                     key of the h3serve layer (h3serve/**, pyproject.toml, README.md)
  stage-app WHEEL PYVER OUT        OUT/ := the venv skeleton at /opt/h3serve and the h3serve wheel installed in it
  check-libs ROOTFS                every shared library that an ELF file under ROOTFS needs is in ROOTFS
  export LAYOUT TAG NAME OUT       OUT (a tar) := an OCI layout holding only LAYOUT:TAG, named NAME for containerd
  gc LAYOUT                        remove the blobs of LAYOUT that no tag reaches
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

# Bump when a staging rule below changes, so that the cached layer is rebuilt.
RULES = "3"

PREFIX = "/opt/h3serve"  # the venv skeleton in the image
INTERP = "/opt/python"  # the interpreter's prefix in the image

# --- ELF: the NEEDED and SONAME entries of a shared object, without binutils ---------------------------------------


def elf_dynamic(path: str) -> tuple[str | None, list[str]] | None:
    """(SONAME, NEEDED) of a 64-bit little-endian ELF file, or None when `path` is not one."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
                return None
            shoff, = struct.unpack_from("<Q", head, 0x28)
            shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
            if not shoff or not shnum:
                return None
            f.seek(shoff)
            sh = f.read(shentsize * shnum)
            secs = [struct.unpack_from("<IIQQQQIIQQ", sh, i * shentsize) for i in range(shnum)]
            dyn = next((s for s in secs if s[1] == 6), None)  # SHT_DYNAMIC
            if dyn is None:
                return None
            strtab = secs[dyn[6]]  # sh_link: the dynamic string table
            f.seek(strtab[4])
            strs = f.read(strtab[5])
            f.seek(dyn[4])
            raw = f.read(dyn[5])
    except OSError:
        return None

    def s(off: int) -> str:
        return strs[off:strs.index(b"\0", off)].decode()

    soname, needed = None, []
    for i in range(0, len(raw) - 15, 16):
        tag, val = struct.unpack_from("<qQ", raw, i)
        if tag == 0:
            break
        if tag == 1:
            needed.append(s(val))
        elif tag == 14:
            soname = s(val)
    return soname, needed


# --- keys ---------------------------------------------------------------------------------------------------------


def _sha(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()


def _tree_key(root: Path, skip) -> str:
    """Hash of the names, sizes and mtimes of the files under `root` (the interpreter: 10k files, a second)."""
    rows = []
    for d, dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        dirs[:] = sorted(x for x in dirs if not skip(os.path.normpath(os.path.join(rel, x))))
        for name in sorted(files):
            r = os.path.normpath(os.path.join(rel, name))
            if skip(r):
                continue
            st = os.lstat(os.path.join(d, name))
            rows.append(f"{r} {st.st_size} {int(st.st_mtime)}")
    return _sha(RULES, *rows)


# --- the interpreter ----------------------------------------------------------------------------------------------

_PY_SKIP = re.compile(
    r"^(include|share|lib/pkgconfig"
    r"|lib/python3\.\d+/(site-packages/.+|test|idlelib|tkinter|turtledemo|turtle\.py|lib2to3/tests"
    r"|config-[^/]+/libpython[^/]*\.a|lib-dynload/_tkinter[^/]*)"
    r"|bin/(?!python3(\.\d+)?$)[^/]+)$"
)


def _py_skip(rel: str) -> bool:
    return bool(_PY_SKIP.match(rel))


def python_key(home: str) -> str:
    return _tree_key(Path(home).parent, _py_skip)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _stage_tree(src_root: Path, out: Path, skip) -> None:
    for d, dirs, files in os.walk(src_root):
        rel = os.path.relpath(d, src_root)
        dirs[:] = [x for x in dirs if not skip(os.path.normpath(os.path.join(rel, x)))]
        os.makedirs(out / rel, exist_ok=True)
        for name in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            r = os.path.normpath(os.path.join(rel, name))
            if skip(r):
                continue
            s, t = os.path.join(d, name), out / r
            if os.path.islink(s):
                os.symlink(os.readlink(s), t)
            elif os.path.isfile(s):
                _link_or_copy(s, str(t))


def stage_python(home: str, out: str) -> None:
    prefix = Path(home).parent
    _stage_tree(prefix, Path(out), _py_skip)
    # The interpreter's binary is patched (its run path) by image.sh: give it its own inode.
    for b in Path(out, "bin").glob("python3.*"):
        if b.is_file() and not b.is_symlink():
            tmp = b.with_suffix(".tmp")
            shutil.copy2(b, tmp)
            os.replace(tmp, b)


# --- site-packages: the distributions h3serve[extras] needs ---------------------------------------------------------


def _site(venv: str) -> Path:
    found = list(Path(venv).glob("lib/python3.*/site-packages"))
    if len(found) != 1:
        sys.exit(f"no single site-packages under {venv}: {found}")
    return found[0]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class Dist:
    def __init__(self, info: Path):
        self.info = info
        self.meta = Parser().parsestr((info / "METADATA").read_text(encoding="utf-8", errors="replace"),
                                      headersonly=True)
        self.name = _norm(self.meta["Name"])
        self.version = self.meta["Version"]
        rec = info / "RECORD"
        self.record = rec.read_bytes() if rec.exists() else b""

    def files(self) -> list[str]:
        """Paths relative to site-packages (scripts outside it, ../../bin/..., are left out)."""
        out = []
        for line in self.record.decode(errors="replace").splitlines():
            p = line.rsplit(",", 2)[0] if line.count(",") >= 2 else line
            p = p.strip('"')
            if p and not p.startswith(("../", "/")):
                out.append(p)
        return out


def _dists(site: Path) -> dict[str, Dist]:
    out = {}
    for info in sorted(site.glob("*.dist-info")):
        if (info / "METADATA").exists():
            d = Dist(info)
            out[d.name] = d
    return out


def closure(site: Path, extras: list[str]) -> list[Dist]:
    """The distributions `h3serve[extras]` needs, by the installed metadata's Requires-Dist (markers evaluated)."""
    from packaging.requirements import Requirement

    dists = _dists(site)
    want: dict[str, set[str]] = {}
    todo = [("h3serve", set(extras))]
    missing = []
    while todo:
        name, ex = todo.pop()
        seen = want.get(name)
        if seen is not None and ex <= seen:
            continue
        want[name] = (seen or set()) | ex
        d = dists.get(name)
        if d is None:
            missing.append(name)
            continue
        for r in d.meta.get_all("Requires-Dist") or []:
            req = Requirement(r)
            envs = [{"extra": e} for e in sorted(want[name])] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(e) for e in envs + [{"extra": ""}]):
                todo.append((_norm(req.name), set(req.extras)))
    if missing:
        sys.exit(f"not installed in the venv but required: {sorted(set(missing))}")
    return [dists[n] for n in sorted(want) if n != "h3serve"]


# CPU torch for the test image. PyPI's torch 2.13.0 is the CUDA build, and `import torch` needs the CUDA libraries
# libtorch_cuda.so links (it fails with "libcublasLt.so.*[0-9] not found" without nvidia/), so the nvidia-*
# distributions keep only the shared objects that torch's own libraries need at load time (NEEDED, transitively):
# cudart, cublas(Lt), cufft, curand, cusparse(Lt), nvJitLink, nccl, nvrtc, cupti, cufile, nvshmem_host and cudnn's
# loader. The rest (cuDNN's engines, cusolver, headers, static libraries: about 1 GB) is dlopened only on a GPU
# and left out. Triton (only the fused GPU kernels import it, guarded) and cuda-bindings / cuda-pathfinder /
# cuda-toolkit (GPU-only Python bindings) are left out whole.
DROP = {"triton", "cuda-bindings", "cuda-pathfinder", "cuda-toolkit"}


def _is_nvidia(d: Dist) -> bool:
    return d.name.startswith("nvidia-")


def site_key(venv: str, extras: list[str]) -> str:
    site = _site(venv)
    return _sha(RULES, ",".join(extras), *(f"{d.name}=={d.version} {_sha(d.record)}" for d in closure(site, extras)))


def _needed_closure(site: Path, keep: list[str], nvidia: list[str]) -> set[str]:
    """The nvidia/ files that the ELF files in `keep` need at load time, transitively (by SONAME or file name)."""
    by_name: dict[str, str] = {}
    deps: dict[str, list[str]] = {}
    for rel in nvidia:
        dyn = elf_dynamic(str(site / rel))
        if dyn is None:
            continue
        by_name.setdefault(os.path.basename(rel), rel)
        if dyn[0]:
            by_name.setdefault(dyn[0], rel)
        deps[rel] = dyn[1]
    todo = []
    for rel in keep:
        if rel.endswith(".so") or ".so." in rel:
            dyn = elf_dynamic(str(site / rel))
            if dyn:
                todo.extend(dyn[1])
    got: set[str] = set()
    while todo:
        rel = by_name.get(todo.pop())
        if rel and rel not in got:
            got.add(rel)
            todo.extend(deps.get(rel, []))
    return got


def stage_site(venv: str, extras: list[str], out: str) -> None:
    site = _site(venv)
    keep: list[str] = []
    nvidia: list[str] = []
    nvidia_meta: list[str] = []
    dropped = []
    for d in closure(site, extras):
        if d.name in DROP:
            dropped.append(d.name)
            continue
        for rel in d.files():
            if _is_nvidia(d) and ".dist-info/" not in rel:
                nvidia.append(rel)
            elif _is_nvidia(d):
                nvidia_meta.append(rel)
            else:
                keep.append(rel)
    needed = _needed_closure(site, keep, nvidia)
    dst = Path(out) / PREFIX.lstrip("/") / site.relative_to(venv)
    n = size = 0
    for rel in keep + nvidia_meta + sorted(needed):
        s = site / rel
        if not s.is_file() and not s.is_symlink():
            continue  # a RECORD entry that pip never wrote (a .pyc of a skipped file, say)
        t = dst / rel
        t.parent.mkdir(parents=True, exist_ok=True)
        if s.is_symlink():
            os.symlink(os.readlink(s), t)
        else:
            _link_or_copy(str(s), str(t))
            size += s.stat().st_size
        n += 1
    print(f"site-packages: {n} files, {size / 2**20:.0f} MiB; nvidia libraries kept: "
          f"{sorted(os.path.basename(x) for x in needed)}; dropped: {sorted(dropped)}", file=sys.stderr)


# --- h3serve itself -----------------------------------------------------------------------------------------------


def app_key(root: str) -> str:
    r = Path(root)
    rows = []
    for p in sorted((r / "h3serve").rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
            rows.append(f"{p.relative_to(r)} {hashlib.sha256(p.read_bytes()).hexdigest()}")
    for name in ("pyproject.toml", "README.md"):
        rows.append(f"{name} {hashlib.sha256((r / name).read_bytes()).hexdigest()}")
    here = Path(__file__).resolve()
    return _sha(RULES, here.read_bytes(), *rows)


def stage_app(wheel: str, pyver: str, out: str) -> None:
    """The venv skeleton (bin/python, pyvenv.cfg, the console scripts) and the wheel unpacked into site-packages."""
    top = Path(out) / PREFIX.lstrip("/")
    site = top / f"lib/python{'.'.join(pyver.split('.')[:2])}/site-packages"
    (top / "bin").mkdir(parents=True)
    site.mkdir(parents=True)
    os.symlink(f"{INTERP}/bin/python{'.'.join(pyver.split('.')[:2])}", top / "bin/python")
    os.symlink("python", top / "bin/python3")
    (top / "pyvenv.cfg").write_text(
        f"home = {INTERP}/bin\ninclude-system-site-packages = false\nversion = {pyver}\n"
        f"executable = {INTERP}/bin/python{'.'.join(pyver.split('.')[:2])}\n")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
        eps = next(n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt"))
        text = z.read(eps).decode()
    section = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]")
        elif section == "console_scripts" and "=" in line:
            name, target = (x.strip() for x in line.split("=", 1))
            mod, func = target.split(":")
            script = top / "bin" / name
            script.write_text(
                f"#!{PREFIX}/bin/python\nimport sys\nfrom {mod} import {func}\n"
                f"if __name__ == '__main__':\n    sys.exit({func}())\n")
            script.chmod(0o755)
    (site / next(site.glob("*.dist-info")).name / "INSTALLER").write_text("h3serve image.sh\n")


# --- a check: every shared library is there -----------------------------------------------------------------------

# Provided by the host at run time (the GPU driver), never by an image.
HOST_LIBS = {"libcuda.so.1", "libnvidia-ml.so.1"}


def check_libs(rootfs: str) -> None:
    """Exit 1, naming them, if an ELF file under ROOTFS needs a shared library that is nowhere in ROOTFS."""
    have: set[str] = set(HOST_LIBS)
    needs: dict[str, str] = {}
    for d, _, files in os.walk(rootfs):
        for f in files:
            p = os.path.join(d, f)
            have.add(f)
            if os.path.islink(p) or not (".so" in f or os.access(p, os.X_OK)):
                continue
            dyn = elf_dynamic(p)
            if dyn is None:
                continue
            if dyn[0]:
                have.add(dyn[0])
            for n in dyn[1]:
                needs.setdefault(n, os.path.relpath(p, rootfs))
    missing = {n: p for n, p in needs.items() if n not in have}
    for n, p in sorted(missing.items()):
        print(f"missing shared library {n} (needed by /{p})", file=sys.stderr)
    print(f"{len(needs)} shared libraries needed, {len(missing)} missing", file=sys.stderr)
    sys.exit(1 if missing else 0)


# --- the archive containerd imports -------------------------------------------------------------------------------


def export(layout: str, tag: str, name: str, out: str) -> None:
    """A tar of an OCI layout with only LAYOUT:TAG in its index, annotated so that `ctr images import` names it NAME."""
    lay = Path(layout)
    index = json.loads((lay / "index.json").read_text())
    desc = next(m for m in index["manifests"]
                if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag)
    manifest = json.loads((lay / "blobs/sha256" / desc["digest"].split(":")[1]).read_text())
    config = json.loads((lay / "blobs/sha256" / manifest["config"]["digest"].split(":")[1]).read_text())
    blobs = [desc["digest"], manifest["config"]["digest"], *(x["digest"] for x in manifest["layers"])]
    desc = dict(desc, annotations={"org.opencontainers.image.ref.name": name, "io.containerd.image.name": name},
                platform={"architecture": config["architecture"], "os": config["os"]})
    new_index = {"schemaVersion": 2, "manifests": [desc]}
    tmp = out + ".tmp"
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as t:
        def add_bytes(arc: str, data: bytes) -> None:
            info = tarfile.TarInfo(arc)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            t.addfile(info, fileobj=__import__("io").BytesIO(data))

        add_bytes("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add_bytes("index.json", json.dumps(new_index).encode())
        for dig in dict.fromkeys(blobs):
            p = lay / "blobs/sha256" / dig.split(":")[1]
            info = t.gettarinfo(str(p), f"blobs/sha256/{dig.split(':')[1]}")
            info.mode, info.mtime, info.uid, info.gid, info.uname, info.gname = 0o644, 0, 0, 0, "", ""
            with open(p, "rb") as f:
                t.addfile(info, f)
    os.replace(tmp, out)
    size = sum(x["size"] for x in manifest["layers"])
    print(json.dumps({"manifest": desc["digest"], "layers": len(manifest["layers"]), "compressed_bytes": size}),
          file=sys.stderr)


def gc(layout: str) -> None:
    """Remove the blobs that no tag of LAYOUT reaches (`umoci gc` re-hashes every blob: a minute for this image)."""
    lay = Path(layout)
    blob = lambda d: lay / "blobs/sha256" / d.split(":")[1]  # noqa: E731
    live: set[str] = set()
    todo = list(json.loads((lay / "index.json").read_text()).get("manifests") or [])
    while todo:
        d = todo.pop()
        if d["digest"] in live:
            continue
        live.add(d["digest"])
        if d["mediaType"].endswith((".manifest.v1+json", ".index.v1+json")):
            m = json.loads(blob(d["digest"]).read_text())
            todo += m.get("manifests", []) + m.get("layers", []) + ([m["config"]] if "config" in m else [])
    for p in (lay / "blobs/sha256").iterdir():
        if f"sha256:{p.name}" not in live:
            p.unlink()


def main(argv: list[str]) -> None:
    cmd, args = argv[0], argv[1:]
    if cmd == "python-key":
        print(python_key(args[0]))
    elif cmd == "stage-python":
        stage_python(*args)
    elif cmd == "site-key":
        print(site_key(args[0], [e for e in args[1].split(",") if e]))
    elif cmd == "stage-site":
        stage_site(args[0], [e for e in args[1].split(",") if e], args[2])
    elif cmd == "app-key":
        print(app_key(args[0]))
    elif cmd == "stage-app":
        stage_app(*args)
    elif cmd == "check-libs":
        check_libs(args[0])
    elif cmd == "gc":
        gc(args[0])
    elif cmd == "export":
        export(*args)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
