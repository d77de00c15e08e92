#!/usr/bin/env bash
# Every check in one place: lint, format, types, and the whole test suite (slow tests included:
# CI runs exactly this, so what it proves is what CI proves).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m ruff check .
.venv/bin/python -m ruff format --check .
bash scripts/typecheck.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=100 "$@"
