#!/usr/bin/env bash
# The property and fuzz tests with fresh random draws (the suite's own runs repeat theirs):
# run it to look for new failing cases, then pin each with @example beside its test.
# Usage: scripts/fuzz.sh [ROUNDS] [pytest args...]   (default: 5 rounds over every property test)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-5}"
shift || true
for ((i = 1; i <= rounds; i++)); do
    echo "== round $i of $rounds"
    ZEPHON_HYPOTHESIS=explore .venv/bin/python -m pytest -q -p no:cacheprovider -x \
        tests/test_state_fuzz.py tests/test_fuzz_readers.py tests/test_state_format.py \
        tests/test_exactly_once.py tests/test_lanes.py tests/test_jsonl.py \
        tests/test_pack_best_fit.py tests/test_seek_index.py "$@"
done
