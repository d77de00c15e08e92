"""The side-by-side benchmark in one command: data, peers' venv, every contender, report.

    .venv/bin/python -m bench.run                      # build data + peers venv, run all, report
    .venv/bin/python -m bench.run --steps 20 --rounds 3 --resume-steps 10,100,1000

Each contender runs as its own process (``bench/contenders/*``; peers in the peers' venv, the
rest in this one) and prints one JSON line; this process watches its tree's resident memory.
Throughput rounds alternate the contenders, rotating their order each round. Results go to
``<out>/bench.json``, ``<out>/report.md`` and ``<out>/*.png`` (see ``bench/README.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import procs, vlm_report, vlm_run
from bench.procs import ROOT
from bench.stats import rotated
from bench.workload import TextWorkload, load_workload


@dataclass(frozen=True)
class Entry:
    """How to run one contender: which venv, which module, which options."""

    venv: str  # "main" or "peers"
    module: str
    options: tuple[str, ...] = ()
    peer: bool = True  # counts for "best peer"


CONTENDERS: dict[str, Entry] = {
    "limit": Entry("main", "bench.contenders.limit", peer=False),
    "zephon_processes_hf": Entry("main", "bench.contenders.zephon_embedded", ("engine=hf",), peer=False),
    "zephon_processes_auto": Entry("main", "bench.contenders.zephon_embedded", ("engine=auto",), peer=False),
    # tiktoken alone in 2 processes: the limit of zephon_processes_auto's engine.
    "limit_tiktoken": Entry("main", "bench.contenders.limit", ("engine=tiktoken",), peer=False),
    # One core, no worker processes: a knob a user may pick, and the quick smoke test's zephon-flow.
    "zephon_inline_hf": Entry(
        "main", "bench.contenders.zephon_embedded", ("engine=hf", "backend=inline"), peer=False
    ),
    # zephon-flow served: `zephon serve` (processes x2) in a subprocess, read with zf.Client.
    "zephon_service_hf": Entry("main", "bench.contenders.zephon_service", ("engine=hf",), peer=False),
    "zephon_service_inline_hf": Entry(
        "main", "bench.contenders.zephon_service", ("engine=hf", "backend=inline"), peer=False
    ),
    "torch_dataloader": Entry("main", "bench.contenders.torch_loader", ("loader=plain",)),
    "torch_stateful": Entry("peers", "bench.contenders.torch_loader", ("loader=stateful",)),
    "torchdata_nodes": Entry("peers", "bench.contenders.torchdata_nodes"),
    "hf_datasets": Entry("peers", "bench.contenders.hf_datasets"),
    "grain": Entry("peers", "bench.contenders.grain_loader"),
}
DEFAULT = tuple(n for n in CONTENDERS if n not in ("zephon_inline_hf", "zephon_service_inline_hf"))
RESUMABLE = (
    "zephon_processes_hf",
    "zephon_inline_hf",
    "torch_stateful",
    "torchdata_nodes",
    "hf_datasets",
    "grain",
)
RESUME_STUDY = ("zephon_processes_hf", "zephon_inline_hf", "torch_stateful", "hf_datasets")
# zephon-flow resumes from several of the consecutive checkpoints of a point; a peer whose resume
# replays the data up to the step resumes once per point (its resume at 10,000 costs a full run).
RESUMES_MANY = ("zephon_processes_hf", "zephon_inline_hf")


def peers_python() -> Path:
    venv = os.environ.get("ZEPHON_PEERS_VENV", str(Path.home() / ".cache/zephon-flow/bench/venv-peers"))
    return Path(venv) / "bin" / "python"


def setup_peers() -> str | None:
    """Creates the peers' venv; returns why it is unavailable, or None."""
    proc = subprocess.run(["bash", str(ROOT / "bench/peers/setup.sh")], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"bench/peers/setup.sh failed: {proc.stderr.strip()[-500:]}"
    return None


def run_task(name: str, workload_path: str, task: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One contender process for one task; its JSON result plus wall time and peak tree RSS."""
    entry = CONTENDERS[name]
    python = sys.executable if entry.venv == "main" else str(peers_python())
    cmd = [python, "-m", entry.module, "--workload", workload_path, "--task", json.dumps(task)]
    for option in entry.options:
        cmd += ["--option", option]
    return procs.run_task(
        name, cmd, timeout, label=f"{name} {task['kind']}", contender=name, kind=task["kind"]
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="zephon-flow side by side with peer loaders")
    p.add_argument("--workload", help="a workload JSON (skips the data build; for tests and reruns)")
    p.add_argument("--data-root", type=Path, default=None, help="default: $ZEPHON_BENCH_DIR or ~/.cache/...")
    p.add_argument("--shards-per-source", type=int, default=0, help="use only the first N shards (0: all)")
    p.add_argument("--contenders", default=",".join(DEFAULT))
    p.add_argument("--no-peers", action="store_true", help="only the contenders of this venv")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=60, help="timed steps per throughput run")
    p.add_argument(
        "--warmup", type=int, default=30, help="untimed steps after the first batch (drains read-ahead)"
    )
    p.add_argument(
        "--throughput-batch", type=int, default=0, help="global batch of the throughput runs (0: workload's)"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--resume-steps", default="10,100,1000,10000")
    p.add_argument(
        "--resume-consecutive", type=int, default=5, help="checkpoints at steps s..s+N-1 of each point s"
    )
    p.add_argument("--resume-repeats", type=int, default=3, help="zephon-flow resumes per point (peers: 1)")
    p.add_argument("--resume-batch", type=int, default=8, help="global batch of the resume study")
    p.add_argument("--elastic-step", type=int, default=20)
    p.add_argument("--elastic-count", type=int, default=3)
    p.add_argument(
        "--skip", default="", help="comma list to skip: phases throughput,resume,elastic; workloads text,vlm"
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="per contender process, seconds")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    vlm_run.add_arguments(p)  # --workloads, --vlm-*
    return p.parse_args(argv)


def real_workload(args: argparse.Namespace) -> tuple[TextWorkload, dict[str, Any]]:
    from bench import data

    root = args.data_root or data.default_root()
    manifest = data.build(root)
    sources = {}
    for name, shards in manifest["text"].items():
        use = shards[: args.shards_per_source] if args.shards_per_source else shards
        # The glob names exactly the shards used: shard-0000[0-k].jsonl is awkward, so use a
        # directory of links when only a prefix is taken.
        if len(use) == len(shards):
            sources[name] = str(root / "text" / name / "shard-*.jsonl")
        else:
            sub = root / "text-subsets" / f"{name}-{len(use)}"
            sub.mkdir(parents=True, exist_ok=True)
            for s in use:
                link = sub / Path(s["path"]).name
                if not link.exists():
                    link.symlink_to(s["path"])
            sources[name] = str(sub / "shard-*.jsonl")
    workload = TextWorkload(
        tokenizer=manifest["tokenizer"]["path"],
        sources=sources,
        weights={"code": 0.4, "docs": 0.3, "prose": 0.3},
    )
    used = {
        n: {
            "shards": len(s[: args.shards_per_source] if args.shards_per_source else s),
            "bytes": sum(x["bytes"] for x in (s[: args.shards_per_source] if args.shards_per_source else s)),
        }
        for n, s in manifest["text"].items()
    }
    return workload, {"manifest": manifest, "used": used}


def main(argv: list[str] | None = None) -> int:
    from bench import report

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    text, vision = vlm_run.wanted(args)  # the vision-language workload runs first: bench/vlm_run.py
    vlm_results = vlm_run.run(args) if vision else None
    if not text:
        return vlm_report.write_alone(vlm_results, args.out)
    if args.workload:
        workload, data_info = load_workload(args.workload), {"workload_file": args.workload}
    else:
        workload, data_info = real_workload(args)
    names = [n for n in args.contenders.split(",") if n]
    unavailable: dict[str, str] = {}
    if any(CONTENDERS[n].venv == "peers" for n in names):
        why = "--no-peers" if args.no_peers else setup_peers()
        if why:
            unavailable = {n: why for n in names if CONTENDERS[n].venv == "peers"}
    names = [n for n in names if n not in unavailable]
    study = workload.replace(global_batch=args.resume_batch)
    work_dir = Path(tempfile.mkdtemp(prefix="zephon-bench-"))
    main_path, study_path = str(work_dir / "workload.json"), str(work_dir / "study.json")
    timed = workload.replace(global_batch=args.throughput_batch) if args.throughput_batch else workload
    Path(main_path).write_text(timed.to_json(), encoding="utf-8")
    Path(study_path).write_text(study.to_json(), encoding="utf-8")

    raw: dict[str, list[dict[str, Any]]] = {"throughput": [], "resume": [], "elastic": []}
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}

    def write() -> None:
        """Results so far: written after every phase, so a long run that is cut short keeps them."""
        results = report.summarise(
            raw=raw,
            config=config,
            workload=json.loads(timed.to_json()),
            study=json.loads(study.to_json()),
            data=data_info,
            unavailable=unavailable,
            peers={n for n in names if CONTENDERS[n].peer},
        )
        results["vlm"] = vlm_results
        (args.out / "bench.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
        (args.out / "report.md").write_text(report.markdown(results), encoding="utf-8")
        report.plots(results, args.out)

    if "throughput" not in skip:
        task = {"kind": "throughput", "steps": args.steps, "warmup": args.warmup, "workers": args.workers}
        for r in range(args.rounds):
            for name in rotated(names, r):
                raw["throughput"].append({"round": r, **run_task(name, main_path, task, args.timeout)})
            write()
    # Elasticity before the resume study: a peer that replays its data to resume at 10,000 steps
    # takes the longest, and a run cut short then keeps everything else.
    if "elastic" not in skip:
        topologies = [
            {"world_size": 1, "workers": args.workers},
            {"world_size": 1, "workers": 1},
            {"world_size": 2, "workers": args.workers},
        ]
        for name in (n for n in RESUMABLE if n in names):
            task = {
                "kind": "elastic",
                "step": args.elastic_step,
                "count": args.elastic_count,
                "workers": args.workers,
                "topologies": topologies,
            }
            raw["elastic"].append(run_task(name, study_path, task, args.timeout))
            write()
    if "resume" not in skip:
        steps = [int(s) for s in args.resume_steps.split(",") if s]
        for name in (n for n in RESUME_STUDY if n in names):
            task = {
                "kind": "resume",
                "steps": steps,
                "workers": args.workers,
                "consecutive": args.resume_consecutive,
                "resumes": args.resume_repeats if name in RESUMES_MANY else 1,
            }
            raw["resume"].append(run_task(name, study_path, task, args.timeout))
            write()
    write()
    print(f"bench.run: wrote {args.out}/bench.json, report.md and plots", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
