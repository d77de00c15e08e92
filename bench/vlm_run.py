"""Runs the vision-language workload's contenders side by side, for ``python -m bench.run``.

``add_arguments`` adds the ``--workloads`` and ``--vlm-*`` options to ``bench.run``'s parser;
``run`` builds (or takes) the workload, checks on a few samples that zephon-flow's operators give
the plain functions' pixels and ids, then runs ``--rounds`` rounds of every contender, one
process each (``bench/contenders/vlm_*.py``, this venv), their order rotated per round, while
this process polls the resident memory of each contender's process tree. ``vlm_report`` turns
the raw results into medians, ratios, flags, Markdown and a plot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench import vlm_report
from bench.procs import run_task
from bench.stats import rotated
from bench.vlm import VlmWorkload, decode_resize, iter_samples, load_workload
from bench.workload import encode, load_tokenizer

#: name -> (module, what it adds to the task)
CONTENDERS: dict[str, tuple[str, dict[str, Any]]] = {
    "limit": ("bench.contenders.vlm_limit", {}),
    "zephon_processes": ("bench.contenders.vlm_zephon", {"backend": "processes"}),
    "torch_dataloader": ("bench.contenders.vlm_torch", {}),
    # One core, no worker processes: not run by default; the quick smoke test's zephon-flow.
    "zephon_inline": ("bench.contenders.vlm_zephon", {"backend": "inline"}),
}
DEFAULT = ("limit", "zephon_processes", "torch_dataloader")
CHECK_SAMPLES = 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workloads",
        default=None,
        help="comma list of workloads to run (default text,vlm; only text when --workload is given alone)",
    )
    p.add_argument("--vlm-workload", help="a VLM workload JSON (skips the data build; for tests and reruns)")
    p.add_argument("--vlm-contenders", default=",".join(DEFAULT), help=f"of {', '.join(CONTENDERS)}")
    p.add_argument("--vlm-steps", type=int, default=200, help="timed steps per VLM throughput run")
    p.add_argument("--vlm-warmup", type=int, default=60, help="untimed VLM steps after the first batch")
    p.add_argument("--vlm-batch", type=int, default=0, help="VLM global batch in sequences (0: 8)")


def wanted(args: argparse.Namespace) -> tuple[bool, bool]:
    """(run the text workload, run the VLM workload) from ``--workloads`` and ``--skip``."""
    default = "text" if args.workload and not args.vlm_workload else "text,vlm"
    names = set(filter(None, (args.workloads or default).split(","))) - set(
        filter(None, args.skip.split(","))
    )
    unknown = names - {"text", "vlm"}
    if unknown:
        raise SystemExit(f"bench.run: unknown workload(s) {sorted(unknown)}; known: text, vlm")
    return "text" in names, "vlm" in names


def real_workload(data_root: Path | None) -> VlmWorkload:
    from bench import data

    root = data_root or data.default_root()
    manifest = data.build(root)
    return VlmWorkload(tars=str(root / "images" / "images-*.tar"), tokenizer=manifest["tokenizer"]["path"])


def check_same_work(w: VlmWorkload, n: int = CHECK_SAMPLES) -> dict[str, Any]:
    """zephon-flow's operators and the plain functions on the first ``n`` samples: same pixels,
    same caption ids; a difference stops the run (the comparison would mean nothing)."""
    from zephon_flow import operators as ops

    decode, resize = ops.DecodeImage(draft_size=w.size), ops.ResizeImage(w.size)
    tokenize = ops.TokenizeField(w.tokenizer, field="txt", eos_token=w.eos_token, engine="hf")
    tokenize.setup()
    tok, eos = load_tokenizer(w)
    checked = 0
    for key, data, caption in iter_samples(w):
        if checked == n:
            break
        (decoded,) = decode.process({"__key__": key, "png": data, "txt": caption})
        (resized,) = resize.process(decoded)
        (ours,) = tokenize.process(resized)
        if not np.array_equal(ours["image"], decode_resize(data, w.size)):
            raise SystemExit(
                f"bench.vlm: zephon-flow and the plain functions disagree on the pixels of {key}"
            )
        if not np.array_equal(ours["text_ids"], encode(tok, eos, caption)):
            raise SystemExit(f"bench.vlm: zephon-flow and the plain functions disagree on the ids of {key}")
        checked += 1
    return {"samples_checked": checked, "pixels_equal": True, "caption_ids_equal": True}


def run_one(name: str, workload_path: str, task: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One contender process; its JSON result plus wall time and the peak RSS of its tree."""
    module, extra = CONTENDERS[name]
    cmd = [sys.executable, "-m", module, "--workload", workload_path, "--task", json.dumps({**task, **extra})]
    return run_task(name, cmd, timeout, label=f"vlm {name}", contender=name)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every VLM contender for ``args.rounds`` rounds; the summary for ``bench.json``'s ``vlm`` key."""
    w = load_workload(args.vlm_workload) if args.vlm_workload else real_workload(args.data_root)
    if args.vlm_batch:
        w = VlmWorkload(**{**json.loads(w.to_json()), "global_batch": args.vlm_batch})
    load_start = list(os.getloadavg())
    checks = check_same_work(w)
    names = [n for n in args.vlm_contenders.split(",") if n]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        raise SystemExit(f"bench.run: unknown VLM contender(s) {unknown}; known: {', '.join(CONTENDERS)}")
    path = Path(tempfile.mkdtemp(prefix="zephon-bench-vlm-")) / "workload.json"
    path.write_text(w.to_json(), encoding="utf-8")
    task = {"steps": args.vlm_steps, "warmup": args.vlm_warmup, "workers": args.workers}
    raw: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for name in rotated(names, r):
            raw.append({"round": r, **run_one(name, str(path), task, args.timeout)})
    config = {
        "steps": args.vlm_steps,
        "warmup": args.vlm_warmup,
        "rounds": args.rounds,
        "workers": args.workers,
        "cpu_count": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": list(os.getloadavg()),
    }
    return vlm_report.summarise(raw, workload=json.loads(w.to_json()), config=config, checks=checks)
