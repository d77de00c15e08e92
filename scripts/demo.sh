#!/usr/bin/env bash
# Sets everything up, then runs the demo: a real text pipeline over Python's own docs and
# code, 4 simulated ranks, then another topology with a resume in the middle, digests compared.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/zephon demo "$@"
