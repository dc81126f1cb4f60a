#!/usr/bin/env bash
# A fleet certificate authority for ProtoFleet's Mosquitto TLS listener (openssl only).
#
#   make-certs.sh [--out DIR] [--days N] [--broker-name HOST] [--broker-ip IP]... NAME...
#       creates the CA and the broker certificate if missing, then one client certificate
#       per NAME (agent ids, and "coordinator" for the coordinator); existing ones are kept.
#   make-certs.sh [--out DIR] --revoke NAME...
#       revokes those client certificates and rewrites the revocation list; install it,
#       then restart mosquitto (a reload keeps a revoked client connected) and reload the
#       coordinator (its security.crl): docs/deploy.md, "Taking a device out".
#
# Every run rewrites DIR/crl.pem (a CRL expires; reissue it at least every --crl-days).
# The certificate CN is the MQTT username (use_identity_as_username), so NAME must be the
# agent id the device uses. Keys are EC P-256 and readable by their owner only.
set -euo pipefail

out=./fleet-certs
days=825
crl_days=30
broker_name=$(hostname -f 2>/dev/null || hostname)
broker_ips=(127.0.0.1)
revoke=0
names=()

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "make-certs.sh: error: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    --days) days=${2:?--days needs a number}; shift 2 ;;
    --crl-days) crl_days=${2:?--crl-days needs a number}; shift 2 ;;
    --broker-name) broker_name=${2:?--broker-name needs a host name}; shift 2 ;;
    --broker-ip) broker_ips+=("${2:?--broker-ip needs an address}"); shift 2 ;;
    --revoke) revoke=1; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) names+=("$1"); shift ;;
  esac
done

command -v openssl >/dev/null || die "openssl is not installed"
[[ "$days" =~ ^[0-9]+$ && "$crl_days" =~ ^[0-9]+$ ]] || die "--days and --crl-days take whole numbers"
for name in "${names[@]}"; do
  # The same rule as protocol/ids.py: the name becomes a topic level.
  [[ "$name" =~ ^[A-Za-z0-9_.-]{1,64}$ ]] || die "'$name' is not a valid agent id (letters, digits, _ . - ; at most 64)"
done
if [ "$revoke" = 1 ] && [ ${#names[@]} -eq 0 ]; then die "--revoke needs at least one NAME"; fi

umask 077
ca="$out/ca"
mkdir -p "$ca/issued" "$out/clients"
cnf="$ca/openssl.cnf"

if [ ! -f "$ca/ca.key" ]; then
  cat >"$cnf" <<EOF
[ ca ]
default_ca = fleet_ca
[ fleet_ca ]
dir = $ca
database = \$dir/index.txt
new_certs_dir = \$dir/issued
serial = \$dir/serial
crlnumber = \$dir/crlnumber
certificate = $out/ca.crt
private_key = \$dir/ca.key
default_md = sha256
default_days = $days
default_crl_days = $crl_days
policy = policy_any
unique_subject = no
copy_extensions = none
[ policy_any ]
commonName = supplied
[ req ]
distinguished_name = dn
prompt = no
[ dn ]
CN = unused
[ v3_ca ]
basicConstraints = critical, CA:true, pathlen:0
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[ v3_client ]
basicConstraints = critical, CA:false
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
[ v3_server ]
basicConstraints = critical, CA:false
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
subjectAltName = @broker_names
[ broker_names ]
DNS.1 = $broker_name
DNS.2 = localhost
EOF
  i=1
  for ip in "${broker_ips[@]}"; do echo "IP.$i = $ip" >>"$cnf"; i=$((i + 1)); done
  : >"$ca/index.txt"
  echo 1000 >"$ca/crlnumber"
  openssl rand -hex 16 >"$ca/serial"
  openssl ecparam -name prime256v1 -genkey -noout -out "$ca/ca.key" 2>/dev/null
  openssl req -new -x509 -key "$ca/ca.key" -out "$out/ca.crt" -days "$((days * 2))" \
    -subj "/CN=ProtoFleet fleet CA" -config "$cnf" -extensions v3_ca -sha256
  echo "created the fleet CA: $out/ca.crt"
fi

# issue NAME EXTENSIONS CERT KEY
issue() {
  local name=$1 ext=$2 crt=$3 key=$4 csr
  csr=$(mktemp)
  openssl ecparam -name prime256v1 -genkey -noout -out "$key" 2>/dev/null
  openssl req -new -key "$key" -subj "/CN=$name" -out "$csr" -config "$cnf"
  openssl ca -batch -config "$cnf" -extensions "$ext" -in "$csr" -out "$crt" -notext 2>/dev/null
  rm -f "$csr"
}

if [ ! -f "$out/broker.crt" ]; then
  issue "$broker_name" v3_server "$out/broker.crt" "$out/broker.key"
  echo "created the broker certificate for $broker_name: $out/broker.crt"
fi

for name in "${names[@]}"; do
  crt="$out/clients/$name.crt"
  if [ "$revoke" = 1 ]; then
    [ -f "$crt" ] || die "no certificate for '$name' in $out/clients"
    if openssl ca -config "$cnf" -revoke "$crt" 2>/dev/null; then
      echo "revoked $name"
    else
      echo "$name was already revoked"
    fi
  elif [ -f "$crt" ]; then
    echo "kept the existing certificate for $name"
  else
    issue "$name" v3_client "$crt" "$out/clients/$name.key"
    echo "created the client certificate for $name: $crt"
  fi
done

openssl ca -config "$cnf" -gencrl -out "$out/crl.pem" 2>/dev/null
# Mosquitto reads the certificates after dropping privileges: public parts world-readable.
chmod 644 "$out/ca.crt" "$out/broker.crt" "$out/crl.pem"
chmod 644 "$out"/clients/*.crt 2>/dev/null || true
echo "revocation list: $out/crl.pem"
