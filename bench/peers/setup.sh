#!/usr/bin/env bash
# Creates the peers' virtual environment (PyTorch DataLoader, StatefulDataLoader, torchdata.nodes,
# Hugging Face datasets, Grain) apart from zephon-flow's own, so that neither resolves the other's
# pins. torch is the CPU build, pinned in the same pip call as everything else so that nothing
# pulls a CUDA build. Safe to re-run. The venv path: $ZEPHON_PEERS_VENV or the cache default.
set -euo pipefail
venv=${ZEPHON_PEERS_VENV:-$HOME/.cache/zephon-flow/bench/venv-peers}
python=${PYTHON:-python3}
stamp="$venv/.zephon-peers-v1"
if [ -f "$stamp" ]; then
  exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet \
  "torch==2.13.0" \
  "torchdata==0.11.*" \
  "datasets>=4,<5" \
  "grain==0.2.18" \
  "tokenizers>=0.20,<0.24" \
  "numpy<2.5" \
  "pyarrow<26" \
  "psutil"
"$venv/bin/python" - <<'PY'
import torch, torchdata, datasets, grain, tokenizers
assert torch.__version__.startswith("2.13.0"), torch.__version__
print("peers venv:", "torch", torch.__version__, "torchdata", torchdata.__version__,
      "datasets", datasets.__version__, "tokenizers", tokenizers.__version__)
PY
touch "$stamp"
