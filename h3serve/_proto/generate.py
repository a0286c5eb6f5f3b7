"""Generate the gRPC Python modules of `protos/h3serve/v1/*.proto` into this package.

    python -m h3serve._proto.generate           # rewrite the committed modules
    python -m h3serve._proto.generate --check   # exit 1 if they are not current

grpcio-tools writes `h3serve/v1/x_pb2.py` importing `from h3serve.v1 import y_pb2`; that path would collide with
the `h3serve` package, so the modules are flattened into `h3serve._proto` and those imports rewritten. The
generated files are committed (no build step at install time); `tests/service/test_protos.py` checks they are
current for the grpcio-tools version recorded in `GENERATED_WITH`.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parents[1]
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_DIR = PROTO_ROOT / "h3serve" / "v1"
_IMPORT = re.compile(r"^from h3serve\.v1 import (\w+_pb2)", re.M)


def tools_version() -> str:
    from importlib.metadata import version

    return version("grpcio-tools")


def generate(out_dir: Path) -> dict[str, str]:
    """Run protoc over every proto; return {file name: text} of the flattened, import-rewritten modules."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(PROTO_DIR.glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_DIR}")
    with tempfile.TemporaryDirectory() as tmp:
        args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", *[str(p.relative_to(PROTO_ROOT)) for p in protos]]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        files = {}
        for path in sorted((Path(tmp) / "h3serve" / "v1").iterdir()):
            text = _IMPORT.sub(r"from h3serve._proto import \1", path.read_text())
            files[path.name] = text
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out_dir / name).write_text(text)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed modules, write nothing")
    args = parser.parse_args(argv)
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            files = generate(Path(tmp))
        stale = [n for n, text in files.items()
                 if not (PACKAGE_DIR / n).is_file() or (PACKAGE_DIR / n).read_text() != text]
        if stale:
            print("stale generated modules: " + ", ".join(stale) + " (run python -m h3serve._proto.generate)")
            return 1
        print("generated modules are current")
        return 0
    files = generate(PACKAGE_DIR)
    init = PACKAGE_DIR / "__init__.py"
    text = init.read_text()
    text = re.sub(r'GENERATED_WITH = "[^"]*"', f'GENERATED_WITH = "{tools_version()}"', text)
    init.write_text(text)
    print(f"wrote {len(files)} modules into {PACKAGE_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
