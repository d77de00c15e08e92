#!/usr/bin/env bash
# mypy --strict over the package as it is installed: operators/ and runners/ are the
# subpackages zephon_flow.operators and zephon_flow.runners, so give mypy that layout
# through a tree of symlinks (errors are reported under build/typecheck/).
set -euo pipefail
cd "$(dirname "$0")/.."
tree=build/typecheck
rm -rf "$tree" && mkdir -p "$tree/zephon_flow"
for f in zephon_flow/*.py zephon_flow/py.typed; do ln -s "$PWD/$f" "$tree/zephon_flow/"; done
ln -s "$PWD/zephon_flow/service" "$tree/zephon_flow/service"
ln -s "$PWD/operators" "$tree/zephon_flow/operators"
ln -s "$PWD/runners" "$tree/zephon_flow/runners"
cd "$tree" && ../../.venv/bin/python -m mypy --config-file ../../pyproject.toml -p zephon_flow
