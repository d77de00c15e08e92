"""The README and docs/ run as written, and the API reference builds without a warning.

Every fenced ``python`` and ``bash`` block of README.md and of the pages of docs/ (those of
mkdocs.yml's nav) is run in a folder that holds ``examples/`` (as the repository root does):
``bash`` blocks with ``bash -euo pipefail``, ``python`` blocks as scripts. The README's first
block writes ``data/``, which the other pages read. Then the README's other blocks, in order in
that folder, and each section (``## `` heading) of each page of docs/, its blocks in order in a
folder of its own that sees the README's ``data/``, run side by side: a section must run on its
own, as it does for a reader who opens it. A page that reads what a later README block writes
(``AFTER_README``) runs after the README, in its folder. Blocks that start a local Ray take
turns. A ``python`` block whose first line is ``# file: examples/NAME.py`` shows part of that
file: it must appear there verbatim (the file itself is run by a ``bash`` block). A block
preceded by ``<!-- docs-test: skip (reason) -->`` is not run; only the README's fresh-machine
commands are (they are the demo and this test suite themselves).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from zephon_flow.demo_data import DemoData

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"(<!-- docs-test: skip \(([^)]*)\) -->\n)?```(\w+)\n(.*?)```", re.S)
SECTION = re.compile(r"^## (.+)$", re.M)
FILE_LINE = re.compile(r"# file: (examples/[\w/]+\.py)\n")
#: The README's "Using it" states this peak (script and worker processes together).
USING_IT_STATED_MB = 650


@dataclass(frozen=True)
class Block:
    where: str  # file:line
    lang: str
    code: str
    skip: str | None
    section: str  # the "## " heading it is under ("" before the first)


def pages() -> list[Path]:
    nav = re.findall(r"^\s+- [^:]+: (\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    return [ROOT / "README.md", *(ROOT / "docs" / name for name in nav)]


def blocks(path: Path) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    fences = list(FENCE.finditer(text))
    headings = [
        h
        for h in SECTION.finditer(text)
        if not any(f.start(3) <= h.start() < f.end() for f in fences)  # a comment in a block
    ]
    found = []
    for m in fences:
        line = text.count("\n", 0, m.start(3)) + 1
        section = next((h.group(1) for h in reversed(headings) if h.start() < m.start(3)), "")
        found.append(Block(f"{path.relative_to(ROOT)}:{line}", m.group(3), m.group(4), m.group(2), section))
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
def folder(tmp_path_factory: pytest.TempPathFactory, demo: DemoData) -> tuple[Path, dict[str, str]]:
    """A folder standing for the repository root: examples/ and nothing else yet. The examples'
    corpus (``$ZEPHON_EXAMPLE_DIR``) is the session's demo corpus, built with the same
    parameters, so no block builds it and no two blocks build it at once."""
    pipeline = (ROOT / "examples" / "pipeline.py").read_text(encoding="utf-8")
    assert re.search(r"^MAX_CODE_FILES = 40$", pipeline, re.M) and re.search(
        r"^VOCAB_SIZE = 512$", pipeline, re.M
    ), "examples/pipeline.py's corpus is no longer conftest.py's demo fixture: give the docs test its own"
    work = tmp_path_factory.mktemp("docs")
    (work / "examples").symlink_to(ROOT / "examples")
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["ZEPHON_EXAMPLE_DIR"] = demo.root
    env.pop("PYTHONPATH", None)
    return work, env


#: Pages of docs/ that read what a README block after its first writes: run after the README,
#: in its folder.
AFTER_README = {"checkpoints.md": "zephon verify ck.zfstate, the README's checkpoint"}
#: Blocks that start a local Ray: one at a time (two local Rays share 2 CPUs and race for ports).
STARTS_RAY = re.compile(r"--ray\b|--backend ray\b|zf\.cluster\.")
#: Sections run side by side: most blocks wait on process start-up, imports and servers as much
#: as they compute, so three keep 2 cores busy without leaving any block starved.
SIDE_BY_SIDE = 3


def processes(section: list[Block]) -> int:
    """How many processes a section's blocks start, roughly: what their time goes to (imports)."""
    return sum(
        1 if block.lang == "python" else len(re.findall(r"\b(?:python|torchrun|zephon)\b", block.code))
        for block in section
    )


def check_output(block: Block, output: str, peak: float) -> None:
    if "all_rank_states" in block.code:
        assert "resumed at step 10 as rank 3 of 4: 8 rows" in output
        # The stated figure, with room for allocator noise; not a measure of speed.
        assert peak < USING_IT_STATED_MB * 1.3, f"Using it peaked at {peak:.0f} MB"
    if "zephon diff b.txt c.txt" in block.code:
        assert "identical over 20 common steps (0..19)" in output
        assert "identical over 10 common steps (20..29)" in output
    if "read_served.py" in block.code:
        assert "rank 1 of 2: steps 0..3" in output


@pytest.mark.slow
def test_readme_and_docs_run_as_written(folder: tuple[Path, dict[str, str]]) -> None:
    """The README's data first, then the README's other blocks (Using it, CLI, serve, Ray,
    PyTorch) and each section of docs/ side by side, each in order. Three at a time: at a load
    average of 9-14 on 2 cores it took 434-474 s, where one block after another passed 600 s."""
    work, env = folder
    runnable = {
        page: [b for b in blocks(page) if b.lang in ("python", "bash") and not b.skip and not excerpt_of(b)]
        for page in pages()
    }
    assert set(AFTER_README) <= {page.name for page in runnable}, "AFTER_README names a page not in the nav"
    numbered = {b.where: n for n, b in enumerate(b for page in runnable.values() for b in page)}
    assert len(numbered) >= 10
    readme, *others = runnable
    data, *rest = runnable[readme]
    assert "make_data.py data/" in data.code, f"{data.where}: the README no longer begins with its data"

    ray = threading.Lock()
    failed = threading.Event()  # once a block has failed, no other begins
    took: dict[str, float] = {}

    def run(in_order: list[Block], where: Path) -> None:
        for block in in_order:
            if failed.is_set():
                return
            try:
                with ray if STARTS_RAY.search(block.code) else contextlib.nullcontext():
                    start = time.monotonic()
                    output, peak = run_block(block, where, numbered[block.where], env)
                    took[block.where] = time.monotonic() - start
                check_output(block, output, peak)
            except BaseException:
                failed.set()
                raise

    def own_folder(in_order: list[Block]) -> Path:
        """A section's folder: examples/ and the README's data/."""
        own = work / "sections" / in_order[0].where.replace("/", "_").replace(":", "_")
        own.mkdir(parents=True)
        (own / "examples").symlink_to(ROOT / "examples")
        (own / "data").symlink_to(work / "data")
        return own

    run([data], work)
    later = [page for page in others if page.name in AFTER_README]

    def readme_then_later() -> None:
        run(rest, work)
        for page in later:
            run(runnable[page], work)

    sections = [
        list(in_order)
        for page in others
        if page not in later
        for _, in_order in itertools.groupby(runnable[page], key=lambda block: block.section)
    ]
    # The longest first, so that the last to finish is a short one (this order changes nothing else).
    sections.sort(key=processes, reverse=True)
    with ThreadPoolExecutor(SIDE_BY_SIDE) as pool:
        futures = [pool.submit(readme_then_later)]
        futures += [pool.submit(run, section, own_folder(section)) for section in sections]
        for future in futures:
            future.result()
    print("\n".join(f"{seconds:6.1f} s  {where}" for where, seconds in took.items()))  # without Ray's turns
    assert len(took) == len(numbered)
