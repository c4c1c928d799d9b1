#!/usr/bin/env bash
# Sets up everything `make test` needs on a fresh machine: a venv with the project and its
# dev + reference extras, redis-server, and promtool. Idempotent: re-running is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.tokengate-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch is pinned: an unpinned torch pulls a multi-GB CUDA build.
  .venv/bin/python -m pip install -q -e '.[dev,reference,otel,extproc]'
  touch "$stamp"
fi

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
# Headless Chromium renders the live dashboard in its end-to-end test.
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  # Debian starts a system redis/prometheus on install; tests start their own on free ports.
  ($SUDO service redis-server stop || true) >/dev/null 2>&1
  ($SUDO service prometheus stop || true) >/dev/null 2>&1
fi
