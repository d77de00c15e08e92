#!/usr/bin/env bash
# Creates .venv and installs zephon-flow (editable) with its dev tools and the CPU build of
# torch. Safe to re-run; a fresh machine needs only Python 3.11+ and the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch is optional for users (the [torch] extra); dev and CI pin the CPU build.
.venv/bin/python -m pip install --quiet "torch==2.13.0" -e ".[dev]"
