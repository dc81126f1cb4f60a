#!/usr/bin/env bash
# Install the ProtoFleet edge agent as a systemd service.
#
#   install-agent.sh [--prefix DIR] [--python PY] [--source SPEC]
#                    [--ort-wheel FILE | --ort-index URL | --cpu-only] [--gpu]
#                    [--no-deps] [--dry-run]
#
# On a Jetson (JetPack 5 or 6, detected from /etc/nv_tegra_release) the venv sees the
# system site packages, so JetPack's TensorRT bindings and NVIDIA's torch wheel are used,
# and onnxruntime-gpu comes from the wheel or index you name: PyPI has no Jetson GPU build
# (NVIDIA and the Jetson AI Lab publish them per JetPack release). Elsewhere: a plain
# install from PyPI; --gpu installs onnxruntime-gpu for a CUDA machine.
# After installing, one inference per execution provider shows whether the GPU really
# works; if not, a warning says the agent will run on the CPU.
#
#   DESTDIR=/tmp/stage  stage the whole tree under this root (packaging, tests); the
#                       system user and systemctl are left for the target machine.
#   --dry-run           print every command instead of running it.
#   --no-deps           install ProtoFleet alone (its dependencies are already present).
#   --source SPEC       what to pip-install (default: this checkout, else "protofleet").
set -euo pipefail
. "$(dirname "$0")/lib.sh"

tegra_release=${PROTOFLEET_TEGRA_RELEASE:-/etc/nv_tegra_release}
source_spec=$(default_source)
ort_wheel=
ort_index=
cpu_only=0
gpu=0

usage() { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  n=0; common_option "$@" || n=$?
  if [ "$n" -gt 0 ]; then shift "$n"; continue; fi
  case "$1" in
    --source) source_spec=${2:?--source needs a path or requirement}; shift 2 ;;
    --ort-wheel) ort_wheel=${2:?--ort-wheel needs a file}; shift 2 ;;
    --ort-index) ort_index=${2:?--ort-index needs a URL}; shift 2 ;;
    --cpu-only) cpu_only=1; shift ;;
    --gpu) gpu=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
[ -z "$ort_wheel" ] || [ -f "$ort_wheel" ] || [ "$dry_run" = 1 ] || die "no such wheel: $ort_wheel"
[ -z "$ort_wheel" ] || [ -z "$ort_index" ] || die "give --ort-wheel or --ort-index, not both"

# -- platform ------------------------------------------------------------------------------
jetson=0
if [ -r "$tegra_release" ]; then
  # e.g. "# R35 (release), REVISION: 4.1, GCID: ..., BOARD: t186ref, EABI: aarch64, ..."
  l4t_major=$(sed -n 's/^# R\([0-9]*\) (release).*/\1/p' "$tegra_release" | head -1)
  l4t_rev=$(sed -n 's/.*REVISION: \([0-9.]*\).*/\1/p' "$tegra_release" | head -1)
  [ -n "$l4t_major" ] || die "cannot read the L4T release from $tegra_release"
  case "$l4t_major" in
    35) jetpack=5 ;;
    36) jetpack=6 ;;
    *) jetpack=unknown; warn "L4T R$l4t_major is neither JetPack 5 (R35) nor 6 (R36); continuing untested" ;;
  esac
  jetson=1
  note "Jetson: L4T R$l4t_major.${l4t_rev:-?} (JetPack $jetpack)"
else
  note "not a Jetson: plain install"
fi
check_python
system_user
note "Python: $("$python_bin" -c 'import platform; print(platform.python_version())')"

venv="$DESTDIR$prefix/venv"
pip=("$venv/bin/python" -m pip install --quiet)

# -- packages ------------------------------------------------------------------------------
if [ "$jetson" = 1 ]; then
  if [ "$cpu_only" = 0 ] && [ -z "$ort_wheel$ort_index" ]; then
    die "on a Jetson, name an onnxruntime-gpu build: --ort-wheel FILE or --ort-index URL (PyPI has none for JetPack), or --cpu-only"
  fi
  make_venv "$venv" --system-site-packages
  # The agent's dependencies without onnxruntime (the right build follows) and without
  # torch when JetPack's own is importable.
  run "${pip[@]}" --no-deps "$source_spec"
  if [ "$no_deps" = 0 ]; then
    deps=(numpy "msgpack>=1.0.5" "paho-mqtt>=2.0,<3" "opacus>=1.4" "tqdm>=4.60" "pillow>=9.0" "cryptography>=42")
    if ! "$python_bin" -c 'import torch' 2>/dev/null; then
      warn "no torch in the system Python: installing one from the index (NVIDIA's JetPack wheel is faster on the GPU)"
      deps+=("torch>=2.1,<3")
    fi
    run "${pip[@]}" "${deps[@]}"
    if [ "$cpu_only" = 1 ]; then
      run "${pip[@]}" "onnxruntime>=1.16"
    elif [ -n "$ort_wheel" ]; then
      run "${pip[@]}" "$ort_wheel"
    else
      run "${pip[@]}" --extra-index-url "$ort_index" "onnxruntime-gpu>=1.16"
    fi
  fi
  want_gpu=$((1 - cpu_only))
else
  make_venv "$venv"
  extra=agent
  [ "$gpu" = 1 ] && extra=gpu
  if [ "$no_deps" = 1 ]; then
    run "${pip[@]}" --no-deps "$source_spec"
  elif [ -d "$source_spec" ]; then
    run "${pip[@]}" "$source_spec[$extra]"
  else
    run "${pip[@]}" "$source_spec[$extra]"
  fi
  want_gpu=$gpu
fi

# -- files ---------------------------------------------------------------------------------
install_unit edge-agent
install_config "$(cd "$(dirname "$0")/.." && pwd)/edge_agent/agent.toml" agent.toml
install_docs
state_dir
daemon_reload

# -- does the GPU really run? --------------------------------------------------------------
if [ "$dry_run" = 1 ]; then
  run "$venv/bin/edge-agent" doctor --require-gpu
elif ! "$venv/bin/python" -c 'import onnxruntime' 2>/dev/null; then
  warn "onnxruntime is not importable in $venv: install it before starting the agent"
elif [ "$want_gpu" = 1 ]; then
  if "$venv/bin/edge-agent" doctor --require-gpu >"$venv/doctor.json" 2>/dev/null; then
    note "GPU inference works: $(tr -d '\n ' <"$venv/doctor.json" | sed 's/.*"accelerated":\[\([^]]*\)\].*/\1/')"
  else
    warn "no CUDA or TensorRT provider ran an inference: the agent will run on the CPU (details: $venv/doctor.json)"
  fi
else
  "$venv/bin/edge-agent" doctor >"$venv/doctor.json" || warn "the provider check failed (see $venv/doctor.json)"
  note "CPU inference works (details: $venv/doctor.json)"
fi

cat <<EOM
Installed the ProtoFleet agent under $DESTDIR$prefix.
Next: edit /etc/protofleet/agent.toml (agent_id, bundle, data, mqtt.tls_*), copy the
device's certificate from make-certs.sh, then: systemctl enable --now edge-agent
EOM
