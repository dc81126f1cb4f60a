# Shared by install-agent.sh and install-coordinator.sh (sourced, not run).
# Every change to the machine goes through `run` so --dry-run can print it instead.

# What is installed is meant for the service user to run and read: a root shell's private
# umask (077) would leave the venv out of its reach. Private files get explicit modes.
umask 022

DESTDIR=${DESTDIR:-}
prefix=/opt/protofleet
dry_run=0
python_bin=python3
no_deps=0

die() { echo "$(basename "$0"): error: $*" >&2; exit 2; }
note() { echo "$(basename "$0"): $*"; }
warn() { echo "$(basename "$0"): warning: $*" >&2; }

run() {
  if [ "$dry_run" = 1 ]; then
    printf '+'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}

# The source to install: this checkout when the script runs from one.
default_source() {
  local here
  here=$(cd "$(dirname "$0")/.." && pwd)
  if [ -f "$here/pyproject.toml" ]; then echo "$here"; else echo "protofleet"; fi
}

check_python() {
  command -v "$python_bin" >/dev/null || die "no $python_bin on PATH (use --python)"
  "$python_bin" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
    die "ProtoFleet needs Python >= 3.10; $python_bin is $("$python_bin" -V 2>&1) (install python3.10 and pass --python python3.10)"
  "$python_bin" -c 'import venv' 2>/dev/null || die "$python_bin lacks the venv module (Debian/Ubuntu: apt-get install python3-venv)"
}

# make_venv DIR [--system-site-packages]: a venv of $python_bin; one already there from
# the same Python with the same site packages is kept (a rerun, or the second installer on
# one machine), else made afresh over it.
make_venv() {
  local dir=$1; shift
  local system=false version
  [ "${1:-}" = --system-site-packages ] && system=true
  version=$("$python_bin" -c 'import platform; print(platform.python_version())')
  if [ -x "$dir/bin/python" ] && [ -f "$dir/pyvenv.cfg" ] &&
    grep -qx "version = $version" "$dir/pyvenv.cfg" &&
    grep -qx "include-system-site-packages = $system" "$dir/pyvenv.cfg"; then
    note "keeping the existing $dir (Python $version)"
    return 0
  fi
  run "$python_bin" -m venv "$@" "$dir"
  run "$dir/bin/python" -m pip install --quiet --upgrade pip
}

# install_unit NAME: the unit file with @PREFIX@ replaced, into DESTDIR/etc/systemd/system.
install_unit() {
  local name=$1 src dest
  src="$(dirname "$0")/$name.service"
  dest="$DESTDIR/etc/systemd/system/$name.service"
  run install -d "$DESTDIR/etc/systemd/system"
  if [ "$dry_run" = 1 ]; then
    printf '+ sed s#@PREFIX@#%s# %q > %q\n' "$prefix" "$src" "$dest"
  else
    sed "s#@PREFIX@#$prefix#g" "$src" >"$dest"
    chmod 644 "$dest"
  fi
}

# What the service reads (configs, keys, /etc/protofleet itself): root owns it, the
# service's group may read it, nobody else anything. systemd does not change the owner of
# a ConfigurationDirectory= (systemd.exec(5)), so the installer gives it out. A staged tree
# (DESTDIR) keeps the packager's owners: the group exists on the target machine only.
service_group=protofleet
group_opts=()
[ -n "$DESTDIR" ] || group_opts=(-g "$service_group")

# config_dir: /etc/protofleet, created or repaired (root:protofleet 0750).
config_dir() {
  run install -d -m 750 "${group_opts[@]}" "$DESTDIR/etc/protofleet"
}

# service_reads FILE...: an existing file repaired to root:protofleet 0640, as a fresh
# install makes it (an install from before this rule left root:root, unreadable).
service_reads() {
  [ -n "$DESTDIR" ] && return 0
  run chown "root:$service_group" "$@"
  run chmod 640 "$@"
}

# install_config EXAMPLE NAME: an example configuration, never over an existing one (whose
# owner and mode are repaired instead).
install_config() {
  local example=$1 name=$2 dest="$DESTDIR/etc/protofleet/$2"
  config_dir
  if [ -e "$dest" ]; then
    note "kept the existing $dest"
    service_reads "$dest"
  else
    run install -m 640 "${group_opts[@]}" "$example" "$dest"
  fi
}

# state_dir: /var/lib/protofleet, the service user's own, as StateDirectory= would make it
# (so the commands also run where systemd does not start them).
state_dir() {
  if [ -n "$DESTDIR" ]; then
    run install -d -m 750 "$DESTDIR/var/lib/protofleet"
  else
    run install -d -m 750 -o "$service_group" -g "$service_group" /var/lib/protofleet
  fi
}

install_docs() {
  local root
  root=$(cd "$(dirname "$0")/.." && pwd)
  run install -d "$DESTDIR$prefix/share/doc/protofleet"
  for doc in "$root/docs/deploy.md" "$root/README.md"; do
    [ -f "$doc" ] && run install -m 644 "$doc" "$DESTDIR$prefix/share/doc/protofleet/"
  done
  return 0
}

# The service user and systemd itself are only touched on a real install. The user comes
# first: everything the service reads is then given to its group.
system_user() {
  if [ -n "$DESTDIR" ]; then
    note "DESTDIR is set: create the 'protofleet' system user on the target machine"
    return 0
  fi
  if ! id protofleet >/dev/null 2>&1; then
    run useradd --system --user-group --home-dir /var/lib/protofleet --no-create-home \
      --shell /usr/sbin/nologin protofleet
  fi
}

daemon_reload() {
  [ -z "$DESTDIR" ] || return 0
  # sd_booted(3)'s test: without it (a container, a chroot) systemctl can only fail.
  if [ ! -d /run/systemd/system ]; then
    note "systemd is not running here (not PID 1): installed; start the services where it runs"
    return 0
  fi
  if command -v systemctl >/dev/null; then
    run systemctl daemon-reload
  fi
  return 0
}

common_option() {
  # Returns the number of arguments consumed, 0 for an unknown option.
  case "$1" in
    --prefix) [ $# -ge 2 ] || die "--prefix needs a directory"; prefix=$2; return 2 ;;
    --python) [ $# -ge 2 ] || die "--python needs an interpreter"; python_bin=$2; return 2 ;;
    --dry-run) dry_run=1; return 1 ;;
    --no-deps) no_deps=1; return 1 ;;
  esac
  return 0
}
