from pathlib import Path

import pytest

from coordinator.config import load
from coordinator.service.cli import EXAMPLE
from runtime.settings import ConfigError, parse_value


def test_documented_example_loads():
    cfg = load(EXAMPLE)
    assert cfg.fleet == "lab" and cfg.model.method == "fedpcl" and cfg.model.dim == 256
    assert cfg.mqtt.max_payload_bytes == 4 << 20


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text, key",
    [
        ('fleet = "lab"\nstate_dir = "/tmp/x"\n[rounds]\nmin_clinets = 2\n', "rounds"),
        (
            'fleet = "lab"\nstate_dir = "/tmp/x"\n[rounds]\nmin_clients = "2"\n',
            "rounds.min_clients",
        ),
        ('state_dir = "/tmp/x"\n', "fleet"),
        ('fleet = "a/b"\nstate_dir = "/tmp/x"\n', ""),
        ('fleet = "lab"\nstate_dir = "/tmp/x"\n[model]\nmethod = "fedsgd"\n', "model"),
        ('fleet = "lab"\nstate_dir = "/tmp/x"\n[robust]\nrule = "mode"\n', "robust.rule"),
        # Checked as the file is read, not by the first round or the endpoint's bind.
        (
            'fleet = "lab"\nstate_dir = "/tmp/x"\n[model]\nmethod = "feddbp"\n'
            '[model.strategy]\ntop_k = "many"\n',
            "model",
        ),
        ('fleet = "lab"\nstate_dir = "/tmp/x"\n[metrics]\nport = 70000\n', "metrics"),
        ('fleet = "lab"\nstate_dir = "/tmp/x"\n[rounds]\nkeep_rounds = -1\n', "rounds"),
    ],
)
def test_bad_configs_name_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError) as info:
        load(write(tmp_path, text))
    assert info.value.key == key
    assert str(tmp_path) in str(info.value)
    if key:  # named once: "file: rounds.min_clients: expected int, got str"
        assert str(info.value).count(f"{key}:") == 1, str(info.value)


def test_not_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(write(tmp_path, "fleet = = 1"))
    with pytest.raises(ConfigError, match="file not found"):
        load(tmp_path / "nope.toml")


def test_command_line_values_read_as_toml_or_as_a_bare_string():
    assert parse_value("0.2") == 0.2 and parse_value("1e-4") == 1e-4
    assert parse_value("3") == 3 and parse_value("true") is True
    assert parse_value('"quoted"') == "quoted"
    assert parse_value("group") == "group"  # a bare word is not TOML: the word itself
    assert parse_value("") == ""


def test_relative_paths_are_read_from_the_files_folder(tmp_path, monkeypatch):
    # Under systemd the working directory is /: "state" must not become /state.
    monkeypatch.chdir("/")
    (tmp_path / "etc").mkdir()
    path = write(
        tmp_path / "etc",
        'fleet = "lab"\nstate_dir = "../var/state"\n[mqtt]\ntls_ca = "ca.crt"\n'
        'tls_cert = "/abs/c.crt"\ntls_key = "~/c.key"\n'
        '[security]\nkey = "keys/coordinator.key"\ndevices = "devices"\n',
    )
    cfg = load(path)
    assert cfg.state_dir == tmp_path / "etc" / ".." / "var" / "state"
    assert cfg.database.parent == cfg.state_dir
    assert cfg.mqtt.tls_ca == tmp_path / "etc" / "ca.crt"
    assert cfg.mqtt.tls_cert == Path("/abs/c.crt")
    assert cfg.mqtt.tls_key == Path.home() / "c.key"
    assert cfg.security.key == tmp_path / "etc" / "keys" / "coordinator.key"
    assert cfg.security.devices == tmp_path / "etc" / "devices"
