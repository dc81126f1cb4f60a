#!/usr/bin/env bash
# Install the ProtoFleet coordinator (and, with --with-mosquitto, the fleet's broker
# configuration) as systemd services on a server.
#
#   install-coordinator.sh [--prefix DIR] [--python PY] [--source SPEC]
#                          [--with-mosquitto] [--certs DIR] [--no-deps] [--dry-run]
#
#   --with-mosquitto   install systemd/mosquitto/protofleet.conf as
#                      /etc/mosquitto/conf.d/protofleet.conf and the ACL file beside the
#                      certificates in /etc/mosquitto/protofleet/ (install the Debian
#                      package `mosquitto` first).
#   --certs DIR        the output of make-certs.sh: the CA, the broker's certificate and
#                      revocation list go to /etc/mosquitto/protofleet/, the coordinator's
#                      client certificate to /etc/protofleet/, every device certificate
#                      to /etc/protofleet/devices/ (enrolled for signed updates).
#   DESTDIR=/tmp/stage stage the whole tree under this root (packaging, tests).
#   --dry-run          print every command instead of running it.
#   --no-deps          install ProtoFleet alone (its dependencies are already present).
set -euo pipefail
. "$(dirname "$0")/lib.sh"

source_spec=$(default_source)
with_mosquitto=0
certs=

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  n=0; common_option "$@" || n=$?
  if [ "$n" -gt 0 ]; then shift "$n"; continue; fi
  case "$1" in
    --source) source_spec=${2:?--source needs a path or requirement}; shift 2 ;;
    --with-mosquitto) with_mosquitto=1; shift ;;
    --certs) certs=${2:?--certs needs the make-certs.sh output directory}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
if [ -n "$certs" ]; then
  for f in ca.crt broker.crt broker.key crl.pem clients/coordinator.crt clients/coordinator.key; do
    [ -f "$certs/$f" ] || die "$certs/$f is missing (run make-certs.sh --out $certs coordinator DEVICE...)"
  done
fi
check_python
system_user

venv="$DESTDIR$prefix/venv"
make_venv "$venv"
if [ "$no_deps" = 1 ]; then
  run "$venv/bin/python" -m pip install --quiet --no-deps "$source_spec"
else
  run "$venv/bin/python" -m pip install --quiet "$source_spec[coordinator]"
fi

here=$(cd "$(dirname "$0")" && pwd)
install_unit edge-coordinator
# The sharded intake's workers, one instance per [workers] name (docs/deploy.md).
install_unit edge-coordinator-worker@
install_config "$here/../coordinator/coordinator.toml" coordinator.toml
install_docs
state_dir

if [ "$with_mosquitto" = 1 ]; then
  run install -d "$DESTDIR/etc/mosquitto/conf.d" "$DESTDIR/etc/mosquitto/protofleet"
  run install -m 644 "$here/mosquitto/protofleet.conf" "$DESTDIR/etc/mosquitto/conf.d/protofleet.conf"
  run install -m 644 "$here/mosquitto/acl" "$DESTDIR/etc/mosquitto/protofleet/acl"
fi
if [ -n "$certs" ]; then
  run install -d "$DESTDIR/etc/mosquitto/protofleet"
  run install -m 644 "$certs/ca.crt" "$certs/broker.crt" "$certs/crl.pem" "$DESTDIR/etc/mosquitto/protofleet/"
  # The broker key must be readable by the broker's user only.
  run install -m 600 "$certs/broker.key" "$DESTDIR/etc/mosquitto/protofleet/"
  if [ -z "$DESTDIR" ] && id mosquitto >/dev/null 2>&1; then
    run chown mosquitto "$DESTDIR/etc/mosquitto/protofleet/broker.key"
  fi
  run install -m 644 "$certs/ca.crt" "$certs/clients/coordinator.crt" "$DESTDIR/etc/protofleet/"
  # The key the coordinator signs and connects with: its group reads it, no one else.
  run install -m 640 "${group_opts[@]}" "$certs/clients/coordinator.key" "$DESTDIR/etc/protofleet/"
  # Enrolment for signed updates: every device certificate make-certs.sh issued (the key
  # in each signs that device's updates; remove a file and reload to take a device out).
  run install -d -m 750 "${group_opts[@]}" "$DESTDIR/etc/protofleet/devices"
  for crt in "$certs"/clients/*.crt; do
    # The coordinator tier's own certificates are no devices.
    case "$(basename "$crt")" in coordinator.crt|coordinator-worker.crt) continue ;; esac
    # A revoked certificate (make-certs.sh --revoke) enrols nobody.
    if ! openssl verify -crl_check -CAfile "$certs/ca.crt" -CRLfile "$certs/crl.pem" "$crt" >/dev/null 2>&1; then
      note "not enrolling $(basename "$crt" .crt): its certificate is revoked or not the fleet CA's"
      continue
    fi
    run install -m 644 "$crt" "$DESTDIR/etc/protofleet/devices/"
  done
fi
daemon_reload

cat <<EOM
Installed the ProtoFleet coordinator under $DESTDIR$prefix.
Next: edit /etc/protofleet/coordinator.toml (fleet, model.bundle, mqtt.tls_*), then:
systemctl enable --now edge-coordinator$( [ "$with_mosquitto" = 1 ] && echo "; systemctl restart mosquitto")
With [workers] in coordinator.toml, also one worker per name: systemctl enable --now edge-coordinator-worker@w1
EOM
