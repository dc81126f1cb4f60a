"""The installers: a Jetson's dry run, and the installed services for real. Both installers
run as root on this machine (not into a staged tree), then each unit's ExecStart runs as the
unit's User and Group, read from the installed unit file, against a real Mosquitto: the
coordinator and one agent serve a round and stop on SIGTERM. Everything the installers made
is removed afterwards. That test runs where the tests run as root (CI); elsewhere it is
skipped, saying so. The staged tree and the unit files: tests/test_deploy.py."""

from __future__ import annotations

import grp
import os
import pwd
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from export.bundle import load as load_bundle
from fleet.transports.broker import MosquittoBroker
from tests.agent_helpers import digits_npz
from tests.process_helpers import LoggedProcess
from tests.test_sdnotify import NotifySocket

ROOT = Path(__file__).resolve().parent.parent
SYSTEMD = ROOT / "systemd"
USER = "protofleet"
PREFIX = Path("/opt/protofleet")
CONFIG = Path("/etc/protofleet")
STATE = Path("/var/lib/protofleet")
UNITS = [
    Path("/etc/systemd/system") / name
    for name in (
        "edge-agent.service",
        "edge-coordinator.service",
        "edge-coordinator-worker@.service",
    )
]
MADE = [PREFIX, CONFIG, STATE, *UNITS]


def _exists(user: str) -> bool:
    try:
        pwd.getpwnam(user)
    except KeyError:
        return False
    return True


def _open_to_all(path: Path, bit: int = 0o001) -> bool:
    """Whether any user may run (``bit`` 0o001) or read (0o004) ``path``: the service user
    must, and a Python under /root (pyenv's) is out of its reach."""
    real = path.resolve()
    dirs_open = all(p.stat().st_mode & 0o001 for p in real.parents)
    return real.is_file() and bool(real.stat().st_mode & bit) and dirs_open


def service_python() -> Path | None:
    """A Python of this interpreter's version that the service user can run: the installed
    venv is made from it, and this interpreter's packages serve it (same ABI)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [Path(getattr(sys, "_base_executable", sys.executable))]
    candidates += [Path(d) / version for d in ("/usr/bin", "/usr/local/bin")]
    return next((c for c in candidates if c.exists() and _open_to_all(c)), None)


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root: it installs into /opt, /etc and /var/lib and adds a system user (CI runs as root)"
    if shutil.which("setpriv") is None or shutil.which("useradd") is None:
        return "needs setpriv and useradd (util-linux, passwd)"
    if service_python() is None:
        return (
            f"no python{sys.version_info.major}.{sys.version_info.minor} the service user may run"
        )
    numpy_init = Path(sysconfig.get_paths()["purelib"]) / "numpy" / "__init__.py"
    if not numpy_init.resolve().stat().st_mode & 0o004:
        return "the test's own packages are not readable by other users"
    present = [str(p) for p in MADE if p.exists()] + ([f"user {USER}"] if _exists(USER) else [])
    if present:
        return f"this machine has a ProtoFleet install ({', '.join(present)}) the test would change"
    return None


def closed_parents(path: Path) -> list[Path]:
    """The folders above ``path`` another user cannot pass through (a checkout under /root,
    mode 0700): the service user must reach the test's own packages there."""
    return [p for p in path.resolve().parents if not p.stat().st_mode & 0o001]


def sh(*args: str) -> str:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{args[0]} exited {result.returncode}:\n{result.stderr}"
    return result.stdout + result.stderr


def staged(*args: str, env: dict[str, str]) -> str:
    result = subprocess.run(
        list(args), capture_output=True, text=True, timeout=300, env={**os.environ, **env}
    )
    assert result.returncode == 0, f"{args[0]} exited {result.returncode}:\n{result.stderr}"
    return result.stdout + result.stderr


def install(*args: str) -> tuple[int, str]:
    """An installer's exit status and output; the test judges the status once the services
    ran, so that a failing install still shows what it left behind."""
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=600)
    return result.returncode, result.stdout + result.stderr


def owner(path: Path) -> tuple[str, str, int]:
    st = path.stat()
    return pwd.getpwuid(st.st_uid).pw_name, grp.getgrgid(st.st_gid).gr_name, st.st_mode & 0o7777


def service_section(unit: Path) -> dict[str, str]:
    """The [Service] keys of a unit file (the last value of a repeated key)."""
    keys: dict[str, str] = {}
    section = ""
    for line in unit.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            keys[key] = value
    return keys


def start_as_unit(unit: Path, notify: str, *, instance: str = "") -> LoggedProcess:
    """The unit's ExecStart as its User, Group and SupplementaryGroups, with its UMask, in
    the clean environment and working directory systemd gives a system service (a template
    unit's ``%i`` is ``instance``)."""
    service = service_section(unit)
    user, group = service["User"], service["Group"]
    extra = [g for g in service.get("SupplementaryGroups", "").split() if g]
    groups = ["--groups", ",".join(extra)] if extra else ["--clear-groups"]
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": pwd.getpwnam(user).pw_dir,
        "USER": user,
        "LOGNAME": user,
        "NOTIFY_SOCKET": notify,
    }
    command = [
        "/bin/sh", "-c", 'cd / && umask "$0" && exec "$@"', service.get("UMask", "0022"),
        "setpriv", f"--reuid={user}", f"--regid={group}", *groups, "--",
        "env", "-i", *(f"{k}={v}" for k, v in env.items()),
        *shlex.split(service["ExecStart"].replace("%i", instance)),
    ]  # fmt: skip
    # An absolute first argument: LoggedProcess's BIN / script is then that path.
    return LoggedProcess(command[0], command[1:])


@dataclass(frozen=True)
class Installed:
    certs: Path  # make-certs.sh's output
    runs: dict[str, tuple[int, str]]  # installer -> (exit status, output)


@pytest.fixture
def installed(tmp_path: Path) -> Iterator[Installed]:
    """Both services installed by their installers as a user would, then all of it removed."""
    why = _why_not()
    if why is not None:
        pytest.skip(why)
    certs = tmp_path / "fleet-certs"
    sh(str(SYSTEMD / "make-certs.sh"), "--out", str(certs), "coordinator", "dev-a")
    units_dir_made = not UNITS[0].parent.exists()
    # Opened for passing through (o+x, no listing) while the services run, and closed
    # again after: wherever CI keeps its checkout, the test's packages serve the services.
    opened = {p: p.stat().st_mode for p in closed_parents(Path(sysconfig.get_paths()["purelib"]))}
    try:
        for folder, mode in opened.items():
            os.chmod(folder, mode | 0o001)
        # A configuration an earlier install left, root:root as every install used to:
        # kept, and given to the service's group.
        CONFIG.mkdir(mode=0o750)
        shutil.copy(ROOT / "coordinator" / "coordinator.toml", CONFIG / "coordinator.toml")
        os.chmod(CONFIG / "coordinator.toml", 0o600)
        # --python: the installed venv is made by a Python of this interpreter's version,
        # so the test's own packages (numpy, torch, onnxruntime ...) serve it below instead
        # of being downloaded again; --no-deps installs ProtoFleet itself, from this checkout.
        python = ["--python", str(service_python()), "--no-deps"]
        runs = {
            "coordinator": install(
                str(SYSTEMD / "install-coordinator.sh"), *python, "--certs", str(certs)
            )
        }
        site = next(PREFIX.glob("venv/lib/python3*/site-packages"))
        # After the venv's own site-packages: the installed ProtoFleet is the one imported.
        (site / "zz-test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        runs["agent"] = install(str(SYSTEMD / "install-agent.sh"), *python)
        yield Installed(certs=certs, runs=runs)
    finally:
        for folder, mode in opened.items():
            os.chmod(folder, mode)
        for path in MADE:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        if units_dir_made:
            shutil.rmtree(UNITS[0].parent, ignore_errors=True)
        if _exists(USER):
            subprocess.run(["userdel", USER], check=True, timeout=60)
        if subprocess.run(["getent", "group", USER], capture_output=True).returncode == 0:
            subprocess.run(["groupdel", USER], check=True, timeout=60)


@pytest.mark.slow
@pytest.mark.broker
def test_the_installed_services_run_as_their_user_and_serve_a_round(
    installed: Installed, small_zoo: Path, mosquitto: MosquittoBroker, tmp_path: Path
) -> None:
    # Configured as docs/deploy.md says: edited in place (owner and mode stay), the
    # device's key installed beside them.
    clients = installed.certs / "clients"
    sh("install", "-m", "640", "-o", "root", "-g", USER, str(clients / "dev-a.key"), str(CONFIG))
    shutil.copytree(small_zoo, PREFIX / "bundles" / "zoo")
    (STATE / "data").mkdir()
    train = digits_npz(STATE / "data", "clean", start=0, count=100)
    port = mosquitto.address.port
    (CONFIG / "coordinator.toml").write_text(
        f'fleet = "lab"\nstate_dir = "{STATE / "coordinator"}"\n'
        f'[model]\nbundle = "{load_bundle(small_zoo).id}"\ndim = 32\n'
        "[rounds]\nmin_clients = 1\nwait_after_quorum_s = 0.0\n"
        f'[mqtt]\nhost = "127.0.0.1"\nport = {port}\n'
        f'[security]\nkey = "{CONFIG / "coordinator.key"}"\ndevices = "{CONFIG / "devices"}"\n'
        f'ca = "{CONFIG / "ca.crt"}"\n'
    )
    (CONFIG / "agent.toml").write_text(
        f'agent_id = "dev-a"\nfleet = "lab"\nstate_dir = "{STATE / "agent"}"\n'
        f'bundle = "{PREFIX / "bundles" / "zoo"}"\n[data]\ntrain = "{train}"\n'
        f'[train]\nout_dim = 32\n[mqtt]\nhost = "127.0.0.1"\nport = {port}\n'
        f'[security]\nkey = "{CONFIG / "dev-a.key"}"\ncoordinator = "{CONFIG / "coordinator.crt"}"\n'
    )

    units = Path("/etc/systemd/system")
    tag = f"protofleet-test-{os.getpid()}"
    coordinator_notify = NotifySocket(f"@{tag}-coordinator")
    agent_notify = NotifySocket(f"@{tag}-agent")
    coordinator = start_as_unit(units / "edge-coordinator.service", coordinator_notify.address)
    agent = None
    try:
        coordinator.wait_for("round 0 announced", timeout=60)
        agent = start_as_unit(units / "edge-agent.service", agent_notify.address)
        agent.wait_for("round 0: update stored by the coordinator", timeout=180)
        coordinator.wait_for("round 0 closed with 1 update(s) from dev-a", timeout=60)
        coordinator_notify.wait_for("READY=1")
        agent_notify.wait_for("READY=1")
        # Their state is the service user's own.
        assert owner(STATE / "coordinator" / "coordinator.sqlite3")[:2] == (USER, USER)

        agent.signal(signal.SIGTERM)
        coordinator.signal(signal.SIGTERM)
        assert agent.proc.wait(timeout=120) == 0, "".join(agent.lines[-20:])
        assert coordinator.proc.wait(timeout=60) == 0, "".join(coordinator.lines[-20:])
        agent_notify.wait_for("STOPPING=1")
        coordinator_notify.wait_for("STOPPING=1")
    finally:
        if agent is not None:
            agent.close()
        coordinator.close()
        agent_notify.sock.close()
        coordinator_notify.sock.close()
    assert not any("Permission denied" in line for line in coordinator.lines + agent.lines)

    # The sharded intake's worker unit, on the same files: it starts as its user, reads
    # the configuration and the key, and stops on SIGTERM.
    with (CONFIG / "coordinator.toml").open("a") as config:
        config.write('[workers]\nnames = ["w1"]\nlocal_sets = "omit"\n')
    worker_notify = NotifySocket(f"@{tag}-worker")
    worker = start_as_unit(
        units / "edge-coordinator-worker@.service", worker_notify.address, instance="w1"
    )
    try:
        worker.wait_for("worker w1 ready", timeout=60)
        worker_notify.wait_for("READY=1")
        worker.signal(signal.SIGTERM)
        assert worker.proc.wait(timeout=60) == 0, "".join(worker.lines[-20:])
        worker_notify.wait_for("STOPPING=1")
    finally:
        worker.close()
        worker_notify.sock.close()
    assert owner(STATE / "coordinator" / "worker-w1.sqlite3")[:2] == (USER, USER)

    # The service's group reads its configuration and keys, nobody else does; the one an
    # earlier install left root-only was repaired, and editing kept that.
    assert owner(CONFIG) == ("root", USER, 0o750)
    for name in ("coordinator.toml", "agent.toml", "coordinator.key", "dev-a.key"):
        assert owner(CONFIG / name) == ("root", USER, 0o640), name
    assert owner(STATE)[:2] == (USER, USER)
    for name, (status, out) in installed.runs.items():
        assert status == 0, f"install-{name}.sh exited {status}:\n{out}"
        if not Path("/run/systemd/system").is_dir():
            # Where systemd is not PID 1 (a container): said in one line, not an error.
            assert "systemd is not running here (not PID 1): installed" in out


@pytest.mark.slow
@pytest.mark.parametrize(("release", "jetpack"), [("R35", "5"), ("R36", "6")])
def test_agent_installer_on_jetson_uses_system_packages_and_the_named_ort(
    tmp_path: Path, release: str, jetpack: str
) -> None:
    tegra = tmp_path / "nv_tegra_release"
    tegra.write_text(
        f"# {release} (release), REVISION: 4.1, GCID: 1, BOARD: generic, EABI: aarch64\n"
    )
    env = {"DESTDIR": str(tmp_path / "stage"), "PROTOFLEET_TEGRA_RELEASE": str(tegra)}
    out = staged(
        str(SYSTEMD / "install-agent.sh"),
        "--dry-run",
        "--ort-wheel",
        "/wheels/ort-gpu.whl",
        env=env,
    )
    assert f"(JetPack {jetpack})" in out
    assert "--system-site-packages" in out
    assert "/wheels/ort-gpu.whl" in out
    assert "doctor --require-gpu" in out
    assert not (tmp_path / "stage").exists()  # a dry run touches nothing

    result = subprocess.run(
        [str(SYSTEMD / "install-agent.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
    )
    assert result.returncode == 2
    assert "--ort-wheel FILE or --ort-index URL" in result.stderr


def test_a_dry_run_makes_the_user_before_giving_it_the_configuration(tmp_path: Path) -> None:
    # Runs anywhere (nothing is changed): the order a real install follows.
    if _exists(USER) or CONFIG.exists():
        pytest.skip("this machine has a ProtoFleet install: a dry run would plan a repair")
    env = {"PROTOFLEET_TEGRA_RELEASE": str(tmp_path / "none"), "DESTDIR": ""}
    for script in ("install-coordinator.sh", "install-agent.sh"):
        out = staged(str(SYSTEMD / script), "--no-deps", "--dry-run", env=env).splitlines()
        first = {
            what: next((i for i, line in enumerate(out) if what in line), -1)
            for what in ("useradd", "/etc/protofleet", "/var/lib/protofleet")
        }
        assert 0 <= first["useradd"] < first["/etc/protofleet"], out
        assert "+ install -d -m 750 -g protofleet /etc/protofleet" in out
        assert "+ install -d -m 750 -o protofleet -g protofleet /var/lib/protofleet" in out
        assert any(line.startswith("+ install -m 640 -g protofleet ") for line in out), out
        if not Path("/run/systemd/system").is_dir():  # a container: said, and no failure
            note = "systemd is not running here (not PID 1): installed; start the services"
            assert f"{script}: {note} where it runs" in out
