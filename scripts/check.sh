#!/usr/bin/env bash
# Every check in one place: lint, format, types, and the whole test suite (slow tests included:
# CI runs exactly this, so what it proves is what CI proves).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m ruff check .
.venv/bin/python -m ruff format --check .
bash scripts/typecheck.sh
# Two pytest-xdist workers: the slow tests wait on the processes they start (Ray, servers,
# worker pools, torchrun) as much as they compute, so two at a time keep CI's 2 cores busy.
# Each module runs whole in one worker, its fixtures built once; tests/conftest.py orders the
# modules. `-n 0` after this script's name runs everything in one process.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=100 \
    -n 2 --dist loadfile --no-loadscope-reorder "$@"
