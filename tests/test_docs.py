"""The README and docs/ run as written, and the API reference builds without a warning.

Every fenced ``python`` and ``bash`` block of README.md and of the pages of docs/ (in the
order of mkdocs.yml's nav) is run, in order, in one folder that holds ``examples/`` (as the
repository root does): ``bash`` blocks with ``bash -euo pipefail``, ``python`` blocks as
scripts. A ``python`` block whose first line is ``# file: examples/NAME.py`` shows part of
that file: it must appear there verbatim (the file itself is run by a ``bash`` block). A
block preceded by ``<!-- docs-test: skip (reason) -->`` is not run; only the README's
fresh-machine commands are (they are the demo and this test suite themselves).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"(<!-- docs-test: skip \(([^)]*)\) -->\n)?```(\w+)\n(.*?)```", re.S)
FILE_LINE = re.compile(r"# file: (examples/[\w/]+\.py)\n")
#: The README's "Using it" states this peak (script and worker processes together).
USING_IT_STATED_MB = 650


@dataclass(frozen=True)
class Block:
    where: str  # file:line
    lang: str
    code: str
    skip: str | None


def pages() -> list[Path]:
    nav = re.findall(r"^\s+- [^:]+: (\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    return [ROOT / "README.md", *(ROOT / "docs" / name for name in nav)]


def blocks(path: Path) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    found = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start(3)) + 1
        found.append(Block(f"{path.relative_to(ROOT)}:{line}", m.group(3), m.group(4), m.group(2)))
    return found


def excerpt_of(block: Block) -> tuple[Path, str] | None:
    m = FILE_LINE.match(block.code)
    return (ROOT / m.group(1), block.code[m.end() :]) if m else None


def test_every_block_is_run_or_shows_a_file_and_the_docs_are_listed() -> None:
    on_disk = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert on_disk <= {p.name for p in pages()} | {"design.md"}, (
        "a page of docs/ is missing from mkdocs.yml's nav"
    )
    kinds = {}
    for page in pages():
        for block in blocks(page):
            if block.lang not in ("python", "bash"):
                assert block.lang == "text", (
                    f"{block.where}: a ```{block.lang} block; use python, bash or text"
                )
                continue
            shown = excerpt_of(block)
            if shown is not None:
                path, part = shown
                assert part in path.read_text(encoding="utf-8"), f"{block.where}: not verbatim in {path.name}"
            kinds[block.where] = "skip" if block.skip else "excerpt" if shown else "run"
            if block.skip:  # only the two fresh-machine commands, which are the demo and this suite
                assert page.name == "README.md"
                commands = [line.split("#")[0].strip() for line in block.code.splitlines()]
                assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"], block.where
    assert sum(k == "skip" for k in kinds.values()) == 1
    assert sum(k == "run" for k in kinds.values()) >= 10


def test_the_api_reference_builds_without_warnings(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "WARNING" not in out.stderr, out.stderr
    api = (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("LoaderSpec", "allow_code_change", "ZephonDataset", "add_special_tokens", "PackMultimodal"):
        assert name in api, name


def peak_tree_mb(proc: subprocess.Popen[str]) -> float:
    """Samples the RSS of ``proc`` and its descendants until it exits; the peak, in MB."""
    peak = 0
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        with contextlib.suppress(psutil.Error):  # a process that ended while being read
            peak = max(peak, sum(p.memory_info().rss for p in (root, *root.children(recursive=True))))
        time.sleep(0.05)
    return peak / 1e6


def run_block(block: Block, folder: Path, n: int, env: dict[str, str]) -> tuple[str, float]:
    if block.lang == "python":
        script = folder / f"_docs_block_{n}.py"
        script.write_text(block.code, encoding="utf-8")
        cmd = [sys.executable, script.name]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", block.code]
    # Its own process group, so that whatever a block left running (a server it put in the
    # background, if it failed before its `kill`) is ended with it, by that group's id.
    with subprocess.Popen(
        cmd,
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as proc:
        output: list[str] = []
        reader = threading.Thread(target=lambda: output.append(proc.stdout.read() if proc.stdout else ""))
        reader.start()
        try:
            peak = peak_tree_mb(proc)
            proc.wait(timeout=600)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            reader.join()
    assert proc.returncode == 0, f"{block.where} failed ({proc.returncode}):\n{block.code}\n---\n{output[0]}"
    return output[0], peak


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A folder standing for the repository root: examples/ and nothing else yet."""
    work = tmp_path_factory.mktemp("docs")
    (work / "examples").symlink_to(ROOT / "examples")
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["ZEPHON_EXAMPLE_DIR"] = str(tmp_path_factory.mktemp("example-corpus"))
    env.pop("PYTHONPATH", None)
    return work, env


@pytest.mark.slow
def test_readme_and_docs_run_as_written(folder: tuple[Path, dict[str, str]]) -> None:
    """About 100 s: the README's code in order (data, Using it, CLI, serve, PyTorch), then docs/."""
    work, env = folder
    ran = 0
    for page in pages():
        for block in blocks(page):
            if block.lang not in ("python", "bash") or block.skip or excerpt_of(block):
                continue
            output, peak = run_block(block, work, ran, env)
            ran += 1
            if "all_rank_states" in block.code:
                assert "resumed at step 10 as rank 3 of 4: 8 rows" in output
                # The stated figure, with room for allocator noise; not a measure of speed.
                assert peak < USING_IT_STATED_MB * 1.3, f"Using it peaked at {peak:.0f} MB"
            if "zephon diff b.txt c.txt" in block.code:
                assert "identical over 20 common steps (0..19)" in output
                assert "identical over 10 common steps (20..29)" in output
            if "read_served.py" in block.code:
                assert "rank 1 of 2: steps 0..3" in output
    assert ran >= 10
