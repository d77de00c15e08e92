"""How the processes backend starts its workers: forked from a single-threaded trainer, else
from the forkserver; either way the same batches, and a dead forked worker is replaced."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from helpers import run_batches
from test_backend_faults import _spec

from zephon_flow.core.batches import batch_digest
from zephon_flow.runners.backends.processes import START_ATTEMPTS, can_fork

TESTS = Path(__file__).parent


def test_no_fork_while_another_python_thread_runs() -> None:
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        assert not can_fork()
    finally:
        release.set()
        thread.join()


TRAINER = textwrap.dedent(
    """
    import json, os, signal, sys, threading
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    import psutil
    import zephon_flow as zf
    from zephon_flow.core.batches import batch_digest
    from zephon_flow.runners.backends.processes import can_fork
    from test_backend_faults import _spec
    if {thread}:  # a Python thread: the workers come from the forkserver
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    marker = Path({tmp!r}) / "handled"
    # The trainer's own SIGTERM handler: a forked worker must not run it (it dies as by default).
    signal.signal(signal.SIGTERM, lambda *_: marker.write_text(str(os.getpid())))
    forkable = can_fork()
    loader = zf.Loader(_spec(Path({tmp!r}), "none"), backend="processes", workers=2, chunk_records=1)
    digests, parents = [], set()
    for step, batch in loader:
        digests.append(batch_digest(batch))
        if step == 2:  # SIGTERM kills a worker; its replacement comes from the forkserver
            me = psutil.Process()
            workers = [psutil.Process(w.process.pid) for w in loader._backend._workers]
            parents = {{p.ppid() == me.pid for p in workers}}
            os.kill(workers[0].pid, signal.SIGTERM)
    loader.close()
    handled = marker.read_text() if marker.exists() else None
    print(json.dumps({{"forkable": forkable, "forked": sorted(parents), "digests": digests, "handled": handled}}))
    """
)


def _run(tmp_path: Path, *, thread: bool) -> dict[str, object]:
    script = TRAINER.format(tests=str(TESTS), tmp=str(tmp_path), thread=thread)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_forked_and_forkserver_workers_give_the_inline_batches(tmp_path: Path) -> None:
    want = [batch_digest(b) for b in run_batches(_spec(tmp_path, "none"))]
    forked = _run(tmp_path, thread=False)
    assert forked["forkable"] is True and forked["forked"] == [True]
    assert forked["digests"] == want
    assert forked["handled"] is None  # the worker died of SIGTERM; the trainer's handler stayed its own
    served = _run(tmp_path, thread=True)
    assert served["forkable"] is False and served["forked"] == [False]
    assert served["digests"] == want


# A script without the ``__main__`` guard: a worker from the forkserver imports it again,
# reaches the Loader, and dies (Python refuses to start processes while one is starting).
UNGUARDED = textwrap.dedent(
    """
    import sys, threading
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    import zephon_flow as zf
    from test_backend_faults import _spec
    from zephon_flow.core.errors import WorkerLostError
    threading.Thread(target=threading.Event().wait, daemon=True).start()  # no fork: the forkserver
    try:
        loader = zf.Loader(_spec(Path({tmp!r}), "none"), backend="processes", workers=2)
        for step, batch in loader:
            pass
    except WorkerLostError as error:
        # On stdout: the dying workers share stderr, and their tracebacks can cut into this line.
        print(f"raised {{type(error).__name__}}: {{error}}")
        sys.exit(1)
    print("ran to the end")
    """
)


def test_workers_that_die_as_they_start_fail_the_loader_instead_of_respawning_forever(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(UNGUARDED.format(tests=str(TESTS), tmp=str(tmp_path)), encoding="utf-8")
    # Before, the backend replaced each dead worker forever: the run hung, printing tracebacks.
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert done.returncode != 0 and "ran to the end" not in done.stdout
    # The loader's error, printed by the script on stdout: the workers' tracebacks on the shared
    # stderr could cut into it (CI once saw "zephon_flow.core.errors" and ".WorkerLostError" apart).
    raised = [line for line in done.stdout.splitlines() if line.startswith("raised ")]
    assert len(raised) == 1, done.stdout[-1000:] + done.stderr[-3000:]
    last = raised[0]
    assert last.startswith(
        f"raised WorkerLostError: worker processes die as they start: {START_ATTEMPTS} in a row"
    )
    assert 'if __name__ == "__main__":' in last
    # Each dead worker printed its own error: the 2 first ones and the replacements started
    # before the third death, not a flood.
    assert 3 <= done.stderr.count("An attempt has been made to start a new process") <= START_ATTEMPTS + 2
