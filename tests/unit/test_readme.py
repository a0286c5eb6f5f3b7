"""The README's commands as written: every flag of an `h3serve` line exists on that subcommand, every path it names
exists in the repository (none outside it), the `serve` it shows serves what its curls ask for, curl sends `<...`
values with --form-string, the CPU examples are CPU-sized; and the docs' claims the issue found stale stay fixed."""

from __future__ import annotations

import re
from pathlib import Path

from h3serve.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def _blocks(text: str) -> list[str]:
    """The bash code blocks, continuation lines joined."""
    return [b.replace("\\\n", " ") for b in re.findall(r"```bash\n(.*?)```", text, re.S)]


def _commands(prefix: str) -> list[str]:
    return [line.strip() for b in _blocks(README) for line in b.splitlines()
            if re.match(rf"^(\.venv/bin/)?{prefix}\b", line.strip())]


def _flags(parser, path: list[str]) -> set[str]:
    p = parser
    for name in path:
        p = next(a for a in p._actions if a.__class__.__name__ == "_SubParsersAction").choices[name]
    return {o for a in p._actions for o in a.option_strings}


def test_every_flag_of_every_h3serve_line_exists():
    parser = build_parser()
    lines = _commands("h3serve")
    assert len(lines) >= 8
    for line in lines:
        words = line.split("#")[0].split()[1:]
        path = [words[0]] + ([words[1]] if words[0] == "checkpoint" else [])
        known = _flags(parser, path)
        unknown = [w.split("=")[0] for w in words if w.startswith("-") and w.split("=")[0] not in known]
        assert not unknown, f"{line}: {unknown} not in `h3serve {' '.join(path)} --help`"


def test_the_paths_it_names_exist_inside_the_repository():
    named = set(re.findall(r"`((?:docs|scripts|examples|charts|bench|tests|h3serve|protos)/[\w./-]+)`", README))
    assert len(named) > 20
    missing = [p for p in named if not (REPO / p.rstrip(".")).exists()]
    assert not missing, missing
    assert "../" not in README, "the README links outside the repository"


def test_the_serve_it_shows_serves_what_its_curls_ask_for():
    serve = next(line for line in _commands("h3serve") if line.split()[1] == "serve")
    tasks = re.search(r"--tasks (\S+)", serve).group(1).split(",")
    curls = [line for b in _blocks(README) for line in b.splitlines() if line.strip().startswith("curl")]
    for curl in curls:
        if "image_reference" in curl or "audio_reference" in curl:
            assert "ref2va" in tasks, (serve, curl)
        if "input_reference" in curl:
            assert "fl2va" in tasks, (serve, curl)
        # curl -F name=<file reads a file: a value starting with < must go as --form-string
        assert not re.search(r"-F ['\"]?\w+=<", curl), curl


def test_the_cpu_examples_are_cpu_sized_and_the_venv_is_explained():
    for line in _commands("h3serve"):
        if line.split()[1] == "generate":
            assert "--size 256x256" in line, line
            assert "--steps" in line or "fasth3" in line, line
    assert "source .venv/bin/activate" in README


def test_the_docs_claims_found_stale_stay_fixed():
    printed = set(re.findall(r'timings\["(\w+)"\]', (REPO / "h3serve/pipeline.py").read_text()))
    printed |= set(re.findall(r'"(t_client|t_media|rtf_client)"', (REPO / "h3serve/pipeline.py").read_text()))
    intro = README.split("## Using it")[0]
    for name in re.findall(r"`(\w+_s|t_\w+|rtf_\w+)`", intro):
        assert name in printed, f"the README names the timing {name}, which generate does not print"
    helm = re.compile(r"helm install h3serve charts/h3serve-operator -n h3-system --create-namespace "
                      r"--set watchNamespaces=\{apps\}")
    assert helm.search(README) and helm.search((REPO / "docs/operator-dev.md").read_text().replace("\n", " "))
    for doc in re.findall(r"docs/[\w.-]+\.md", (REPO / "charts/h3serve-operator/values.yaml").read_text()):
        assert (REPO / doc).exists(), doc
    services = (REPO / "docs/services.md").read_text()
    assert "TLS / authentication on the gRPC and HTTP ports" not in services.split("## Not done here")[1]
