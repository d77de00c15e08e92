#!/usr/bin/env bash
# Every check in one place: lint, format, types, tests (slow benchmarks excluded).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m ruff check .
.venv/bin/python -m ruff format --check .
bash scripts/typecheck.sh
exec .venv/bin/python -m pytest -m "not slow" -q -p no:cacheprovider "$@"
