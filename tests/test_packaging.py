"""The sdist carries what the README refers to, and the metadata says what it is, without warnings."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP = shutil.ignore_patterns(
    ".venv", ".git", "site", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "results", ".cache"
)


def test_the_sdist_holds_proto_examples_docs_and_bench(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    shutil.copytree(ROOT, tree, ignore=SKIP, symlinks=True)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--sdist",
            "--no-isolation",
            "--outdir",
            str(tmp_path / "dist"),
            str(tree),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    log = out.stdout + out.stderr
    assert "Deprecat" not in log and "BuildBackendWarning" not in log, log
    (sdist,) = (tmp_path / "dist").glob("zephon_flow-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
        top = next(name for name in tar.getnames() if name.endswith("/PKG-INFO") and name.count("/") == 1)
        pkg_info = tar.extractfile(top).read().decode()  # type: ignore[union-attr]
    for path in (
        "proto/zephon/v1/batch_service.proto",
        "examples/pipeline.py",
        "examples/train_tiny_gpt.py",
        "examples/train_tiny_vlm.py",
        "examples/make_data.py",
        "examples/README.md",
        "docs/api.md",
        "mkdocs.yml",
        "scripts/setup.sh",
        "zephon_flow/cli.py",
        "zephon_flow/py.typed",
        "operators/pack.py",
        "runners/deterministic.py",
        # The docs cite the benchmarks and their report (docs/scale.md, docs/checkpoints.md).
        "bench/README.md",
        "bench/scale_sim.py",
        "bench/checkpoints.py",
        "bench/contenders/harness.py",
    ):
        assert path in names, path
    assert not [
        n for n in names if "__pycache__" in n or n.endswith(".pyc") or n.startswith("bench/results/")
    ]
    assert "License-Expression: Apache-2.0" in pkg_info
    assert "Classifier: Programming Language :: Python :: 3.11" in pkg_info
    assert "Classifier: Typing :: Typed" in pkg_info
