"""A Client's iterator left suspended at module level ends quietly when the script exits."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    import zephon_flow as zf
    from test_exactly_once import doc_spec, write_file
    from zephon_flow.service.server import BatchServer

    write_file(Path({tmp!r}), 0, "jsonl", 50)
    spec = doc_spec({pattern!r}, "jsonl", lanes=2, batch=4, epochs=None)
    server = BatchServer(spec, host="127.0.0.1", port=0).start()
    client = zf.Client(f"127.0.0.1:{{server.port}}", rank=0, world_size=1)
    it = iter(client)
    step, batch = next(it)
    {close}
    server.stop(grace=None)
    print("took step", step, flush=True)
    """
)


def _run(tmp_path: Path, close: str) -> subprocess.CompletedProcess[str]:
    script = SCRIPT.format(
        tests=str(TESTS), tmp=str(tmp_path), pattern=str(tmp_path / "*.jsonl"), close=close
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def test_an_iterator_of_a_closed_client_left_at_module_level_exits_quietly(tmp_path: Path) -> None:
    done = _run(tmp_path, "client.close()")
    assert (done.returncode, done.stdout) == (0, "took step 0\n"), done.stderr
    # Before: "Exception ignored in: <generator object Client.__iter__ ...> ... TypeError:
    # catching classes that do not inherit from BaseException is not allowed".
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_client_never_closed_is_closed_at_exit_quietly(tmp_path: Path) -> None:
    done = _run(tmp_path, "")
    assert (done.returncode, done.stdout) == (0, "took step 0\n"), done.stderr
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr
