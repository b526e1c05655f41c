#!/usr/bin/env bash
# Installs everything torchloom needs on a Debian machine: system packages with apt-get and
# Python packages (LibTorch comes from the pinned `torch` wheel) with pip, into a virtual
# environment (.venv) where the system Python refuses them (PEP 668). Idempotent: what is already
# installed is skipped, so running it again costs a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(cmake ninja-build g++ openmpi-bin libopenmpi-dev libspdlog-dev nlohmann-json3-dev
              libcli11-dev libhwloc-dev libxxhash-dev libgtest-dev
              python3-dev    # Python.h for the torchloom module (python/)
              python3-venv   # a virtual environment where the system Python refuses pip (PEP 668)
              clang libclang-rt-dev)  # libFuzzer for scripts/fuzz.sh

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "[setup] apt-get install ${missing[*]}"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

source scripts/python_env.sh
if ! "$PYTHON" - <<'PY' 2>/dev/null
import re, sys, importlib.metadata as md
for line in open("requirements.txt"):
    line = line.split("#")[0].strip()
    if not line:
        continue
    name, _, pin = line.partition("==")
    have = md.version(name)            # raises when missing
    if pin and have.split("+")[0] != pin:
        sys.exit(1)
PY
then
  echo "[setup] pip install -r requirements.txt"
  log=$(mktemp)
  if ! "$PYTHON" -m pip install -q --disable-pip-version-check -r requirements.txt 2>"$log"; then
    cat "$log" >&2
    # A system Python that refuses installs (PEP 668's externally-managed-environment): the
    # packages go into .venv instead, which scripts/python_env.sh then picks for every script.
    if [[ "$PYTHON" != "$PWD/.venv/bin/python" ]] && grep -q "externally-managed-environment" "$log"; then
      echo "[setup] $PYTHON is externally managed (PEP 668): installing into a virtual environment, .venv"
      "$PYTHON" -m venv .venv
      PYTHON="$PWD/.venv/bin/python"
      "$PYTHON" -m pip install -q --disable-pip-version-check -r requirements.txt
    else
      rm -f "$log"
      exit 1
    fi
  fi
  rm -f "$log"
fi
echo "[setup] dependencies present (Python: $PYTHON)"
