"""A launcher's child reads its knobs from the file the launcher writes (`$H3SERVE_STAGE_CONFIG`), not from a list
of flags forwarded in argv: every field arrives, whatever its type, and a file that is not a StageConfig is one
line naming the variable."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import fields, replace

import pytest

from h3serve.config.stage import KNOB_PART, KNOB_TYPES, KNOBS, STAGE_CONFIG_ENV, StageConfig
from h3serve.config.vocab import FASTH3_DIT, STAGES
from h3serve.errors import H3Error
from h3serve.runtime.launcher import Launcher, child_argv, child_config
from h3serve.runtime.prechecks import config_from_args, planned_ports, serve_order
from h3serve.testing.serve import launched_config

# set by the launcher per child, not carried from its own config
PER_CHILD = {"stage", "port", "advertise", "peers", "http_port", "fasth3_adapter", "fasth3_adapter_sha256",
             "encoder", "dit", "vae", "muxer", "fasth3_dit"}


def _changed(value, hint: str):
    """A value other than the default, of the field's type (each field of a nested part)."""
    if dataclasses.is_dataclass(value):
        hints = typing.get_type_hints(type(value))
        return replace(value, **{f.name: _changed(getattr(value, f.name), str(hints[f.name])) for f in fields(value)})
    if "bool" in hint:
        return not value
    if "int" in hint and "float" not in hint:
        return (value or 0) + 3
    if "float" in hint:
        return (value or 0.0) + 1.5
    if "dict" in hint:
        return {"k": 1}
    return f"/x/{hint.count('|')}" if value is None else f"{value}-x"


def _knob(config: StageConfig, name: str):
    return getattr(getattr(config, KNOB_PART[name]), name) if name in KNOB_PART else getattr(config, name)


def test_every_knob_the_launcher_has_reaches_its_child(tmp_path):
    default = StageConfig()
    changed = {name: _changed(_knob(default, name), str(KNOB_TYPES[name])) for name in KNOBS if name not in PER_CHILD}
    changed.update(degrees=_changed(default.degrees, ""), levers=_changed(default.levers, ""))
    config = StageConfig.from_knobs(**changed)
    addresses = {"encoder": "127.0.0.1:1", "dit": "127.0.0.1:2", "vae": "127.0.0.1:3", "muxer": "dns:///m.ns:4"}
    for stage in ("encoder", "dit", "vae", "muxer", "gateway"):
        got = launched_config(config, stage, 4242, addresses, 8080, tmp_path)
        assert got == child_config(config, stage, 4242, addresses, 8080)
        assert {name: _knob(got, name) for name in changed} == changed, stage
        assert (got.stage, got.server.port, got.server.peers) == (
            stage, 4242, "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3,m.ns:4")
        gateway = stage == "gateway"
        assert (got.gateway.http_port, got.gateway.dit, got.gateway.muxer) == (
            (8080, "127.0.0.1:2", "dns:///m.ns:4") if gateway else (None, None, None))
    assert child_argv("vae", "info")[-3:] == ["serve", "--stages", "vae"]  # nothing else in argv


@pytest.mark.parametrize("content,says", [("{not json", "cannot read the launcher's stage config"),
                                          ("[1, 2]", "is not one JSON object"),
                                          ('{"stage": "vae", "colour": 1}', "not a StageConfig")])
def test_a_stage_config_file_that_is_not_one_is_one_line_naming_the_variable(tmp_path, content, says):
    path = tmp_path / "vae.json"
    path.write_text(content)
    with pytest.raises(H3Error) as info:
        config_from_args(None, "vae", {STAGE_CONFIG_ENV: str(path)})
    text = str(info.value)
    assert text.startswith(f"{STAGE_CONFIG_ENV}={path}") and says in text and "\n" not in text
    missing = tmp_path / "gone.json"
    with pytest.raises(H3Error, match=f"{STAGE_CONFIG_ENV}={missing}: cannot read"):
        config_from_args(None, "vae", {STAGE_CONFIG_ENV: str(missing)})


def test_the_ports_checked_before_torch_are_the_ones_the_launcher_binds(tmp_path):
    # `serve` checks its ports before the launcher is imported (`planned_ports`): the FastH3 DiT pool's (+5) included
    config = StageConfig.from_knobs(stage="gateway", fasth3_adapter="a.safetensors", port=41000, http_port=8123,
                                    tmp_dir=str(tmp_path))
    launcher = Launcher(config, list(STAGES), base_port=41000, http_port=8123, start_timeout=1, restart=False,
                        log_level="INFO", json_output=False)
    checked = [port for _, port, _ in planned_ports(config, list(STAGES))]
    assert sorted(checked) == sorted([*launcher.ports.values(), launcher.http_port])
    assert launcher.ports[FASTH3_DIT] == 41005 and launcher.order == serve_order(config, list(STAGES))
