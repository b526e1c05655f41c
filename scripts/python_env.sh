# Sourced by the project's scripts (from the repository root): the Python they use, in PYTHON.
# PYTHON when set; else the project's virtual environment, .venv, when scripts/setup.sh made one
# (a system Python that refuses pip installs, PEP 668: Debian 12, Ubuntu 24.04); else python3.
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$PWD/.venv/bin/python" ]]; then
    PYTHON="$PWD/.venv/bin/python"
  else
    PYTHON=python3
  fi
fi
export PYTHON
