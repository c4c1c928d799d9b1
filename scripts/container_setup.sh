#!/usr/bin/env bash
# Sets up a container engine for the compose stack (make compose-test) and kubectl for the
# Kubernetes render test. Idempotent: a second run only checks.
#
# - Docker with a running engine and its compose plugin: used as it is.
# - Otherwise Podman from Debian (with runc: crun fails here on hybrid cgroups; with the dnsname
#   CNI plugin so services find each other by name), configured for this kind of machine
#   (runtime runc, no default ulimits), and podman-compose from PyPI in the project's venv.
# - Base image: when debian:bookworm-slim cannot be pulled (no registry reachable), it is built
#   from Debian packages with debootstrap and imported under the same name, so the Dockerfile
#   builds unchanged. The stand-ins for Redis, Prometheus and HAProxy are built by the compose
#   test itself (tests/deploy/stack.py), from the same base.
# - kubectl (with its built-in kustomize) from the Debian package when it is missing.
#
# --tools-only: the engine's and kubectl's packages and podman-compose, no base image (what the
# fast tests in `make test` need: `podman-compose config`, `kubectl kustomize`).
#
# Prints one line per decision; exits non-zero when something cannot be set up.
set -euo pipefail
cd "$(dirname "$0")/.."
tools_only=0
[ "${1:-}" = "--tools-only" ] && tools_only=1

say() { printf 'container-setup: %s\n' "$*"; }
if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
apt_updated=0
apt_install() {
  if [ "$apt_updated" = 0 ]; then $SUDO apt-get update -qq; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# ---- kubectl (kustomize is built in) ----
if ! command -v kubectl >/dev/null 2>&1; then
  say "installing kubectl (Debian package)"
  apt_install kubectl || { say "kubectl: no package could be installed; install kubectl >= 1.27"; exit 1; }
fi

# ---- the engine ----
if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1 && docker compose version >/dev/null 2>&1; then
  say "engine: docker ($(docker compose version --short 2>/dev/null || echo compose)); nothing to set up"
  exit 0
fi

need=()
for pkg in podman runc debootstrap; do
  command -v "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
[ -e /usr/lib/cni/dnsname ] || need+=(golang-github-containernetworking-plugin-dnsname)
if [ ${#need[@]} -gt 0 ]; then
  say "installing ${need[*]} (Debian packages)"
  apt_install podman runc golang-github-containernetworking-plugin-dnsname debootstrap
fi

conf=/etc/containers/containers.conf
if ! grep -q '^runtime = "runc"' "$conf" 2>/dev/null || ! grep -q '^default_ulimits = \[\]' "$conf" 2>/dev/null; then
  say "configuring $conf (runtime runc, no default ulimits)"
  $SUDO mkdir -p /etc/containers
  # Keep anything else an operator put there; our two keys go in their sections.
  [ -f "$conf" ] && $SUDO cp "$conf" "$conf.before-tokengate"
  $SUDO tee "$conf" >/dev/null <<'CONF'
# Written by tokengate's scripts/container_setup.sh for machines where crun cannot run
# ("cgroups in hybrid mode not supported") and raising RLIMIT_NOFILE is not permitted.
[containers]
default_ulimits = []

[engine]
runtime = "runc"
CONF
fi

# ---- podman-compose in the project's venv ----
if [ ! -x .venv/bin/python ]; then bash scripts/bootstrap.sh; fi
if ! .venv/bin/podman-compose version >/dev/null 2>&1; then
  say "installing podman-compose (PyPI) into .venv"
  .venv/bin/python -m pip install -q 'podman-compose==1.6.0'
fi

[ "$tools_only" = 1 ] && { say "tools ready (podman $(podman version --format '{{.Client.Version}}'))"; exit 0; }

# ---- the base image ----
base=docker.io/library/debian:bookworm-slim
standin=host-ca-1  # bump when the stand-in's recipe changes: an older stand-in is rebuilt
have=$(podman image inspect --format '{{index .Config.Labels "org.tokengate.standin"}}' "$base" 2>/dev/null || echo absent)
if [ "$have" != absent ] && [ "$have" != "<no value>" ] && [ -n "$have" ] && [ "$have" != "$standin" ]; then
  say "base image $base is an older local stand-in ($have): rebuilding"
  podman rmi -f "$base" >/dev/null
  have=absent
fi
if [ "$have" != absent ]; then
  say "base image $base present"
elif timeout 60 podman pull -q "$base" >/dev/null 2>&1; then
  say "base image $base pulled"
else
  mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
  say "no registry reachable: building $base from Debian packages (debootstrap, $mirror)"
  dir=$(mktemp -d /var/tmp/tokengate-rootfs.XXXXXX)
  trap '$SUDO rm -rf "$dir"' EXIT
  $SUDO debootstrap --variant=minbase bookworm "$dir" "$mirror" >/dev/null
  $SUDO rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
  # The stand-in trusts what this host trusts (a TLS-intercepting proxy's CA included): the host's
  # bundle is split into one certificate per file under /usr/local/share/ca-certificates, which
  # update-ca-certificates adds to the image's own bundle when a build installs ca-certificates,
  # so pip inside `docker build`/`podman build` (and `compose up --build`) verifies PyPI.
  host_ca=${HOST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
  if [ -s "$host_ca" ]; then
    $SUDO mkdir -p "$dir/usr/local/share/ca-certificates/host"
    $SUDO awk -v d="$dir/usr/local/share/ca-certificates/host" \
      '/BEGIN CERTIFICATE/ {n++; f=sprintf("%s/host-%04d.crt", d, n)} f {print > f} /END CERTIFICATE/ {close(f); f=""}' \
      "$host_ca"
  fi
  $SUDO tar -C "$dir" -c . | podman import -q --change "LABEL org.tokengate.standin=$standin" \
    --change 'CMD ["bash"]' - "$base" >/dev/null
  say "base image $base built locally (a stand-in for the registry's image)"
fi
say "engine: podman $(podman version --format '{{.Client.Version}}'), $(.venv/bin/podman-compose version 2>/dev/null | grep -m1 podman-compose)"
