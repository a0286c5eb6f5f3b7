"""scripts/constraints.txt (the versions the suite last passed with, installed by scripts/setup.sh and the
Dockerfile): one exact pin per package, and every requirement h3serve states is met by its pin."""

from __future__ import annotations

import pathlib
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parents[2]


def pins() -> dict[str, Version]:
    out: dict[str, Version] = {}
    for line in (ROOT / "scripts" / "constraints.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and name.strip() == name and " " not in version, f"not an exact pin: {line!r}"
        key = canonicalize_name(name)
        assert key not in out, f"{name} pinned twice"
        out[key] = Version(version)
    return out


def test_every_requirement_of_h3serve_and_its_test_extra_is_met_by_its_pin():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    got = pins()
    wanted = [Requirement(r) for r in (*project["dependencies"], *project["optional-dependencies"]["test"],
                                       *project["optional-dependencies"]["operator"],
                                       *project["optional-dependencies"]["nixl"])]
    missing = [str(r) for r in wanted if canonicalize_name(r.name) not in got]
    unmet = [f"{r} (pinned {got[canonicalize_name(r.name)]})" for r in wanted
             if canonicalize_name(r.name) in got and not r.specifier.contains(got[canonicalize_name(r.name)],
                                                                                prereleases=True)]
    assert not missing and not unmet, {"missing": missing, "unmet": unmet}
    assert "h3serve" not in got   # the project itself is installed from the checkout


def test_setup_and_the_dockerfile_install_with_it():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "scripts/constraints.txt" in setup and setup.count('${pins[@]+"${pins[@]}"}') == 2
    docker = (ROOT / "Dockerfile").read_text()
    assert "COPY scripts/constraints.txt" in docker and docker.count("-c /constraints.txt") == 2
