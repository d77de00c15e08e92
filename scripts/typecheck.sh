#!/usr/bin/env bash
# mypy --strict over the package as it is installed: operators/ and runners/ are the
# subpackages zephon_flow.operators and zephon_flow.runners, so give mypy that layout
# through a tree of symlinks (errors are reported under build/typecheck/). Then bench/ and
# examples/, from the same tree, with the looser settings of their [[tool.mypy.overrides]].
set -euo pipefail
cd "$(dirname "$0")/.."
tree=build/typecheck
rm -rf "$tree" && mkdir -p "$tree/zephon_flow"
for f in zephon_flow/*.py zephon_flow/py.typed; do ln -s "$PWD/$f" "$tree/zephon_flow/"; done
for d in zephon_flow/*/; do
  case "$d" in */__pycache__/) continue ;; esac
  ln -s "$PWD/${d%/}" "$tree/${d%/}"
done
ln -s "$PWD/operators" "$tree/zephon_flow/operators"
ln -s "$PWD/runners" "$tree/zephon_flow/runners"
ln -s "$PWD/bench" "$tree/bench"
ln -s "$PWD/examples" "$tree/examples"
ln -s "$PWD/tests" "$tree/tests"
ln -s "$PWD/_zephon_flow_lightning.py" "$tree/_zephon_flow_lightning.py"
cd "$tree"
mypy=(../../.venv/bin/python -m mypy --config-file ../../pyproject.toml)
"${mypy[@]}" -p zephon_flow
# Lightning's entry point, a top-level module so that it imports nothing of the package.
"${mypy[@]}" -m _zephon_flow_lightning
# bench/ is a folder of modules (python -m bench.run).
"${mypy[@]}" -p bench
# The examples are scripts that import each other by file name: checked as top-level modules.
"${mypy[@]}" examples/*.py
# The tests import their helpers by file name, as pytest runs them: checked as top-level
# modules; Beam's DoFn base class and decorators are untyped, so subclassing and decorating
# them is allowed there (the package's operators get the same allowance in pyproject.toml).
"${mypy[@]}" --allow-untyped-decorators --allow-subclassing-any tests/*.py
