#!/usr/bin/env bash
# scripts/setup.sh on a system Python that refuses pip installs (PEP 668, as on Debian 12 and
# Ubuntu 24.04): in a scratch copy of the scripts, with a python3 on PATH that answers
# `pip install` with pip's externally-managed-environment error, setup.sh must install the
# requirements into .venv, a second run must find them there, and scripts/python_env.sh must then
# give every script .venv's interpreter. The requirement is one small package the system Python
# lacks (tomli_w, from PyPI), not the project's own list.
set -euo pipefail
SOURCE=$(cd "$(dirname "$0")/../.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/bin"
cp -r "$SOURCE/scripts" "$WORK/"
printf 'tomli_w\n' > "$WORK/requirements.txt"
REAL=$(command -v python3)
cat > "$WORK/bin/python3" <<PY
#!/usr/bin/env bash
if [[ "\$1" == "-m" && "\$2" == "pip" && "\$3" == "install" ]]; then
  echo "error: externally-managed-environment" >&2
  exit 1
fi
exec "$REAL" "\$@"
PY
chmod +x "$WORK/bin/python3"
if python3 -c 'import tomli_w' 2>/dev/null; then
  echo "SKIP: the system Python already has tomli_w"; exit 77
fi
cd "$WORK"
export PATH="$WORK/bin:$PATH"
unset PYTHON
first=$(bash scripts/setup.sh 2>&1) || { echo "$first"; echo "FAIL: setup.sh failed"; exit 1; }
echo "$first"
grep -q "externally managed (PEP 668)" <<<"$first" || { echo "FAIL: no virtual environment made"; exit 1; }
.venv/bin/python -c 'import tomli_w' || { echo "FAIL: tomli_w is not in .venv"; exit 1; }
second=$(bash scripts/setup.sh 2>&1) || { echo "$second"; echo "FAIL: the second run failed"; exit 1; }
grep -q "pip install" <<<"$second" && { echo "$second"; echo "FAIL: the second run installed again"; exit 1; }
chosen=$(bash -c 'source scripts/python_env.sh; echo "$PYTHON"')
[[ "$chosen" == "$WORK/.venv/bin/python" ]] || { echo "FAIL: python_env.sh chose $chosen"; exit 1; }
echo "PASS: requirements in .venv on a PEP 668 Python; the second run is a no-op; scripts use $chosen"
