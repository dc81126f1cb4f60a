"""The four console scripts as a user runs them from the virtual environment."""

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from edge_agent.config import load as load_agent_config
from export import bundle as bundle_mod
from fleet.cli.main import main as fleet_main
from fleet.data.bundles import ensure_bundle
from runtime import cliutil
from runtime.cliutil import make_parser

BIN = Path(sys.executable).parent
SCRIPTS = ["edge-export", "edge-agent", "edge-coordinator", "edge-fleet"]


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=120
    )


def run_many(argvs: list[list[str]]) -> list[subprocess.CompletedProcess[str]]:
    """``run`` for each argv, four at a time: each is a new interpreter, and the cases are
    independent."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda argv: run(*argv), argvs))


def _fleet_usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, str]:
    """``edge-fleet argv`` run in this process (the console script's path is its main,
    which test_help_works runs as a program): its exit status and standard error."""
    try:
        code: object = fleet_main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_works(script):
    result = run(script, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {script}")


@pytest.mark.slow
def test_a_reader_that_goes_away_ends_the_command_quietly():
    # `edge-agent privacy-plan ... | head -1`: the JSON meets a closed pipe. The read end
    # is closed before the command starts, so the write fails every time.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        argv = ["privacy-plan", "--epsilon", "8", "--rounds", "3", "--dataset-size", "100"]
        done = subprocess.run(
            [str(BIN / "edge-agent"), *argv], stdout=write_end, stderr=subprocess.PIPE,
            text=True, timeout=120,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert done.returncode == 128 + signal.SIGPIPE, done.stderr
    assert done.stderr == ""  # no traceback, no "Exception ignored" at exit


def test_option_checks_and_help_do_not_import_torch():
    # Importing torch costs seconds (more on a Jetson): --help, a usage error or a
    # misspelt config must not wait for it, nor `edge-agent status`. Every command line's
    # module, as its console script loads it, plus what checks a fleet's options, reads an
    # agent's config file and its state folder.
    code = (
        "import sys\n"
        "import coordinator.service.cli, edge_agent.cli, export.cli, fleet.cli.main\n"
        "from edge_agent.config import AgentConfig\n"
        "from edge_agent.state import StateDir\n"
        "from fleet.transports.spec import RunSpec\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'onnx')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "script, loader",
    [("edge-agent", "edge_agent.config"), ("edge-coordinator", "coordinator.config")],
)
def test_the_example_config_is_printed_and_loads(script, loader, tmp_path):
    result = run(script, "example-config")
    assert result.returncode == 0, result.stderr
    path = tmp_path / "example.toml"
    path.write_text(result.stdout)
    cfg = __import__(loader, fromlist=["load"]).load(path)
    assert cfg.fleet == "lab"
    assert "Every key below is shown with its default" in result.stdout


@pytest.mark.slow
def test_the_wheel_ships_the_example_configs(tmp_path):
    # A device installed from a wheel has no docs/ folder: `example-config` reads the
    # file from inside the package. Built from a copy, so the tree is left as it is.
    root = Path(__file__).resolve().parent.parent
    src = tmp_path / "src"
    packages = (
        "protocol", "closed_form", "runtime", "secagg", "export", "edge_agent", "coordinator",
        "fleet",
    )  # fmt: skip
    for name in packages:
        shutil.copytree(root / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert {"edge_agent/agent.toml", "coordinator/coordinator.toml"} <= names
    # Every package the console scripts import is in it.
    assert {f"{name}/__init__.py" for name in packages} | {"runtime/transport.py"} <= names


@pytest.mark.slow
def test_unusable_broker_files_are_one_line_before_anything_starts(tmp_path):
    # A missing or wrong CA or password file used to be an ssl traceback, and for the agent
    # only after its backbones had run over the whole data set.
    (tmp_path / "garbage.pem").write_text("not a certificate")
    (tmp_path / "latin1.txt").write_bytes(b"\xff\xfe secret")
    agent_state, coordinator_state = tmp_path / "agent-state", tmp_path / "coordinator-state"
    agent = (
        f'agent_id = "dev-a"\nfleet = "lab"\nstate_dir = "{agent_state}"\n'
        f'bundle = "{tmp_path / "zoo"}"\n[data]\ntrain = "{tmp_path / "train.npz"}"\n'
        "[security]\ninsecure = true\n"
    )
    coordinator = (
        f'fleet = "lab"\nstate_dir = "{coordinator_state}"\n[model]\nmethod = "fedpcl"\n'
        'bundle = "b"\nclasses = ["a", "b"]\ndim = 4\n[security]\ninsecure = true\n'
    )
    cases = [
        ("edge-agent", agent, 'tls_ca = "{d}/ca.crt"', "mqtt.tls_ca {d}/ca.crt: No such file"),
        (
            "edge-agent", agent, 'tls_ca = "{d}/garbage.pem"',
            "mqtt.tls_ca {d}/garbage.pem: not a usable PEM CA certificate",
        ),
        (
            "edge-coordinator", coordinator, 'username = "c"\npassword_file = "{d}/pw"',
            "mqtt.password_file {d}/pw: No such file",
        ),
        (
            "edge-coordinator", coordinator, 'username = "c"\npassword_file = "{d}/latin1.txt"',
            "mqtt.password_file {d}/latin1.txt: not a UTF-8 text file",
        ),
    ]  # fmt: skip
    argvs = []
    for n, (script, body, mqtt, _) in enumerate(cases):
        config = tmp_path / f"{n}.toml"
        config.write_text(body + "[mqtt]\n" + mqtt.format(d=tmp_path) + "\n")
        argvs.append([script, "run", "--config", str(config)])
    for (script, _, _, message), result in zip(cases, run_many(argvs), strict=True):
        assert result.returncode == 2, result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith(f"{script}: error: " + message.format(d=tmp_path)), line
    # Refused before the agent's state (and feature cache) or the database was created.
    assert not agent_state.exists() and not coordinator_state.exists()


@pytest.mark.parametrize("script", SCRIPTS)
def test_version_is_reported(script):
    result = run(script, "--version")
    assert result.returncode == 0
    assert result.stdout.split() == [script, "0.1.0"]


def test_no_command_prints_help_and_fails():
    result = run("edge-fleet")
    assert result.returncode == 2
    assert "demo" in result.stdout


@pytest.mark.slow
def test_unknown_option_is_a_usage_error_not_a_traceback(tmp_path, capsys):
    (tmp_path / "not-a-bundle.txt").write_text("x")
    (tmp_path / "text.npz").write_text("train_x_0")
    with (tmp_path / "array.npz").open("wb") as handle:
        np.save(handle, np.zeros((2, 3, 8, 8), np.float32))  # an .npy under an .npz name
    cases = [
        (["demo", "--clients", "many"], "invalid int value"),
        (["demo", "--methods", "solo,magic"], "unknown methods magic"),
        (["compare", "--seeds", "0,x"], "--seeds must be integers"),
        (["run", "--data", str(tmp_path / "missing.npz")], "does not exist"),
        (["run", "--data", str(tmp_path / "text.npz")], "not an .npz archive"),
        (["run", "--data", str(tmp_path / "array.npz")], "a single .npy array"),
        (["run", "--broker", "http://x"], "--broker must look like mqtt://host:port"),
        (["run", "--bundle", str(tmp_path)], "holds no bundle.json"),
    ]
    for argv, message in cases:  # in this process, as the bad-options cases below
        code, err = _fleet_usage(argv, capsys)
        assert code == 2 and message in err, (argv, err)
        assert "Traceback" not in err


@pytest.mark.slow
def test_bad_fleet_options_fail_before_the_zoo_is_built(tmp_path, capsys):
    # The bundle folder does not exist: any of these reaching the zoo build would start
    # minutes of training and create the folder.
    bundle = tmp_path / "zoo"
    a_file = tmp_path / "report.txt"
    a_file.write_text("not a folder")
    data = tmp_path / "fleet.npz"
    x, y = np.zeros((4, 3, 8, 8), np.uint8), np.arange(4) % 2
    np.savez(data, train_x_0=x, train_y_0=y, test_x_0=x, test_y_0=y)
    cases = [
        (["compare", "--seeds", "0,1,0"], "--seeds lists 0 more than once"),
        (["run", "--data", str(data), "--clients", "3"], "--clients shapes the built-in digits-5"),
        (
            ["compare", "--data", str(data), "--split", "label", "--train", "9"],
            "--split, --train shape the built-in digits-5 data and do not apply to --data",
        ),
        (["privacy", "--data", str(data), "--splits", "label"], "--splits chooses digits-5"),
        (["privacy", "--split", "label"], "not --split: for this one alone give --splits label"),
        (["run", "--alpha", "0.1"], "--alpha applies to --split label and feature-label only"),
        (["run", "--split", "feature-label", "--domain", "photo"], "--domain applies to --split"),
        (["privacy", "--splits", "feature", "--alpha", "0.1"], "not to feature"),
        (["run", "--transport", "memory", "--broker", "mqtt://h:1"], "--broker applies to"),
        (["compare", "--transport", "memory", "--workers", "4"], "--workers applies to"),
        (["run", "--data", str(data), "--image-size", "64"], "applies to --data image folders"),
        (["run", "--data", str(tmp_path), "--image-size", "0"], "--image-size must be positive"),
        (["run", "--rounds", "0"], "--rounds"),
        (["run", "--out-dim", "0"], "--out-dim must be at least 1"),
        (["compare", "--clients", "0"], "at least 1 client"),
        (["run", "--split", "label", "--alpha", "-1"], "--alpha must be positive"),
        (["privacy", "--epsilons", "-1"], "no dp plan for epsilon -1"),
        (["privacy", "--mechanisms", "dp,laplace"], "unknown mechanisms laplace"),
        (["privacy", "--train", "50", "--dataset-size", "40"], "--dataset-size 40 is below"),
        (["privacy", "--delta", "2"], "delta must be in (0, 1)"),
        (["run", "--train-param", "tau=-1"], "tau and fpl_tau must be positive"),
        (["compare", "--train-param", "taus=0.2"], "unknown key(s) ['taus']"),
        (["run", "--train-param", "norm=layer"], "train.norm: 'layer' is not one of"),
        (["run", "--train-param", "tau"], "expects KEY=VALUE"),
        (["run", "--train-param", "epochs=3"], "use --epochs"),
        (["compare", "--out", str(a_file)], "exists and is not a folder"),
        (["run", "--out", str(a_file / "o")], f"{a_file} is not a folder"),
    ]
    # In this process: 27 interpreters would cost seconds each on 2 cores.
    for argv, message in cases:
        code, err = _fleet_usage(
            [argv[0], "--bundle", str(bundle), "--out", str(tmp_path / "o"), *argv[1:]], capsys
        )
        assert code == 2 and message in err, (argv, err)
        assert "Traceback" not in err
    assert not bundle.exists()  # no case reached the zoo build


@pytest.mark.slow
@pytest.mark.broker
def test_demo_compares_methods_over_mqtt_and_reports(small_zoo, tmp_path):
    result = run(
        "edge-fleet", "demo", "--bundle", str(small_zoo), "--out", str(tmp_path),
        "--clients", "2", "--rounds", "2", "--train", "30", "--test", "20",
        "--methods", "solo,fedpcl", "--out-dim", "32", "--no-progress",
        "--train-param", "tau=0.2", "--train-param", "lr=2e-3",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    # --train-param reaches every agent's configuration and the report.
    configs = list(tmp_path.glob("runs/*/*/clients/*/agent.toml"))
    assert len(configs) == 4  # two methods, two clients
    for path in configs:
        train = load_agent_config(path).train
        assert (train.tau, train.lr, train.out_dim) == (0.2, 2e-3, 32)
        assert train.classifier == "linear"  # the fair protocol, every method
    assert "| solo |" in result.stdout and "| fedpcl |" in result.stdout
    assert "| central (ceiling) |" in result.stdout
    for name in ("report.json", "report.md", "accuracy_vs_round.png", "backbone_contribution.png"):
        assert (tmp_path / name).exists()
        assert str(tmp_path / name) in result.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["methods"]) == {"solo", "fedpcl", "central"}
    assert report["config"]["transport"] == "mqtt" and report["config"]["protocol"] == "fair"
    assert report["config"]["train_param"] == {"tau": 0.2, "lr": 2e-3}
    assert report["methods"]["solo"]["train"] == {"tau": 0.2, "lr": 2e-3}
    for method in ("solo", "fedpcl", "central"):
        m = report["methods"][method]
        assert 0 <= m["final_mean"] <= 1 and m["final_mean"] <= m["best_mean"] <= 1
        assert m["settings"]["train"]["classifier"] == "linear"
    table = (tmp_path / "report.md").read_text()
    assert table.startswith("# Fleet report, fair protocol: ")
    assert "train: lr=0.002, tau=0.2." in table


@pytest.fixture
def root_logging():
    """cliutil.run configures the root logger as an entry point does; put it back after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_sigterm_runs_the_commands_clean_up_once_and_exits_143(root_logging, capsys):
    parser = make_parser("demo-cli", "a command that is sent SIGTERM")
    parser.add_subparsers(dest="command").add_parser("work")
    steps: list[str] = []

    def work(args: object) -> int:
        try:
            signal.raise_signal(signal.SIGTERM)
            steps.append("went on after SIGTERM")
        finally:
            # A second SIGTERM (an impatient supervisor) must not cut the clean-up short.
            signal.raise_signal(signal.SIGTERM)
            steps.append("cleaned up")
        return 0

    assert cliutil.run(parser, ["work"], handlers={"work": work}) == 128 + signal.SIGTERM
    assert steps == ["cleaned up"]
    assert "demo-cli: terminated" in capsys.readouterr().err
    # The default comes back: the handler belongs to the command's run, not the process.
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_file_error_is_one_line_naming_the_file_and_exit_1(root_logging, capsys):
    parser = make_parser("demo-cli", "a command whose disk is full")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("full")
    sub.add_parser("bug")

    def full(args: argparse.Namespace) -> int:
        raise OSError(28, "No space left on device", "/data/report.json")

    def bug(args: argparse.Namespace) -> int:
        raise OSError("no file involved")

    handlers = {"full": full, "bug": bug}
    assert cliutil.run(parser, ["full"], handlers=handlers) == 1
    err = capsys.readouterr().err
    assert err == "demo-cli: error: /data/report.json: No space left on device\n"
    # An OSError naming no file is not a user's to fix: it surfaces whole.
    with pytest.raises(OSError, match="no file involved"):
        cliutil.run(parser, ["bug"], handlers=handlers)


@pytest.mark.slow
def test_the_zoo_is_built_aside_and_moved_into_place_whole(tmp_path):
    target = tmp_path / "zoo"
    staging = tmp_path / ".zoo.building"
    staging.mkdir()
    (staging / "letters.fp32.onnx").write_bytes(b"half of a file")  # a build cut short
    assert ensure_bundle(target, "small") == target
    assert not staging.exists()
    bundle = bundle_mod.load(target)  # checks every file's hash: a whole bundle
    assert [m.name for m in bundle.members] == ["letters", "shapes", "fontdigits"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["zoo"]
    assert ensure_bundle(target, "small") == target  # built once


@pytest.mark.parametrize("script", ["edge-agent", "edge-coordinator"])
def test_a_config_that_is_not_utf8_or_not_finite_is_one_line_naming_it(script, tmp_path):
    latin = tmp_path / "latin1.toml"
    latin.write_bytes(b'fleet = "caf\xe9"\n')
    infinite = tmp_path / "inf.toml"
    infinite.write_text(
        'agent_id = "a"\nfleet = "lab"\nstate_dir = "s"\nbundle = "b"\n[data]\ntrain = "t"\n'
        "[security]\ninsecure = true\n[mqtt]\nresend_s = inf\n"
        if script == "edge-agent"
        else 'fleet = "lab"\nstate_dir = "s"\n[rounds]\ntimeout_s = inf\n'
    )
    for config, message in (
        (latin, f"{latin}: not a UTF-8 text file (byte 0xe9 at offset 12)"),
        (
            infinite,
            "must be a finite number, got inf",
        ),
    ):
        result = subprocess.run(
            [str(BIN / script), "run", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith(f"{script}: error: ") and message in line, line
        if config is infinite:  # the key as written in the file, not an internal name
            key = "mqtt.resend_s" if script == "edge-agent" else "rounds.timeout_s"
            assert f": {key}: must be" in line, line
