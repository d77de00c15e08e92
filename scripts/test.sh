#!/usr/bin/env bash
# Sets everything up, then runs every check (ruff, mypy --strict, pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec bash scripts/check.sh "$@"
