"""Before and after in one run: zephon-flow now and at a baseline commit, beside the limits and torch.

Run from the repository root::

    .venv/bin/python -m bench.speed                          # baseline 7bd57f7, 3 rounds, text and VLM
    .venv/bin/python -m bench.speed --rounds 5 --workloads vlm --baseline HEAD~3
    .venv/bin/python -m bench.speed --workloads vlm --vlm-stamps-only     # first batches on like data

The baseline's package is unpacked with ``git archive`` into a temporary folder laid out as the
installed package (``zephon_flow`` with ``operators`` and ``runners`` inside it) and run with the
same interpreter, the same bench code (a link to this ``bench/``) and the same data, its folder
first on the path. Each round runs every contender once, in rotated order, one process each
(``bench.procs``): for text, ``limit_tiktoken`` (tiktoken alone in 2 processes), zephon-flow with
``engine="auto"`` now and at the baseline, with ``engine="hf"`` (torch's tokenizer) now, and
torch's ``DataLoader``; for the vision-language
workload, its limit (Pillow + tokenizer alone), zephon-flow now and at the baseline, and torch's
``DataLoader``. The data is ``bench.run``'s (``bench/data.py``). Reported per contender: medians
over rounds of the rate after warm-up, the first batch and the consumer's and its children's CPU
cores; ratios to the limit and to torch of the medians and, per round, paired (the median of the
per-round ratios, robust to a machine whose load changes between rounds); and the work done
per CPU-second (everything the loader's process and its workers spent) over the limit's, paired
per round: the share of the CPU that goes to the work itself, which a machine that lends cores to
other tenants moves less than it moves rates (on 2 idle cores a loader's rate over the limit's is
this share times how busy it keeps the cores). Results: ``<out>/speed.json`` and
``<out>/speed.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from bench import procs, vlm_run
from bench.procs import ROOT
from bench.stats import median, rotated
from bench.vlm import VlmWorkload
from bench.vlm import shards as vlm_shards

BASELINE = "7bd57f7"  # the branch point of issue 15's speed work
#: name -> (module, options, runs at the baseline)
TEXT: dict[str, tuple[str, tuple[str, ...], bool]] = {
    "limit_tiktoken": ("bench.contenders.limit", ("engine=tiktoken",), False),
    "zephon_auto": ("bench.contenders.zephon_embedded", ("engine=auto",), False),
    "zephon_auto_baseline": ("bench.contenders.zephon_embedded", ("engine=auto",), True),
    # the HF engine: torch's own tokenizer, for the first batch against torch's
    "zephon_hf": ("bench.contenders.zephon_embedded", ("engine=hf",), False),
    "torch_dataloader": ("bench.contenders.torch_loader", ("loader=plain",), False),
    # ``zephon serve`` in a subprocess read by ``zf.Client`` (issue 28: the server against a
    # baseline, the server's package included)
    "zephon_served": ("bench.contenders.zephon_service", ("engine=auto",), False),
    "zephon_served_baseline": ("bench.contenders.zephon_service", ("engine=auto",), True),
}
VLM: dict[str, tuple[str, dict[str, Any], bool]] = {
    "limit": ("bench.contenders.vlm_limit", {}, False),
    "zephon": ("bench.contenders.vlm_zephon", {"backend": "processes"}, False),
    "zephon_baseline": ("bench.contenders.vlm_zephon", {"backend": "processes"}, True),
    "torch_dataloader": ("bench.contenders.vlm_torch", {}, False),
}
RATE = {"text": "tokens_per_s", "vlm": "images_per_s"}
LIMIT = {"text": "limit_tiktoken", "vlm": "limit"}


def unpack_baseline(rev: str) -> Path:
    """The package at ``rev`` laid out as installed, with a link to this bench; its folder."""
    root = Path(tempfile.mkdtemp(prefix="zephon-speed-baseline-"))
    src = root / "src"
    src.mkdir()
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    pkg = root / "pkg"
    pkg.mkdir()
    (src / "zephon_flow").rename(pkg / "zephon_flow")
    for part in ("operators", "runners"):
        (src / part).rename(pkg / "zephon_flow" / part)
    (pkg / "bench").symlink_to(ROOT / "bench")
    return pkg


def run_one(cmd: list[str], *, name: str, baseline: Path | None, timeout: float) -> dict[str, Any]:
    return procs.run_task(name, cmd, timeout, label=name, contender=name, root=baseline or ROOT)


def text_round(w_path: str, task: dict[str, Any], names: list[str], base: Path, t: float) -> list[Any]:
    out = []
    for name in names:
        module, options, at_base = TEXT[name]
        cmd = [sys.executable, "-m", module, "--workload", w_path, "--task", json.dumps(task)]
        for option in options:
            cmd += ["--option", option]
        out.append(run_one(cmd, name=name, baseline=base if at_base else None, timeout=t))
    return out


def vlm_round(w_path: str, task: dict[str, Any], names: list[str], base: Path, t: float) -> list[Any]:
    out = []
    for name in names:
        module, extra, at_base = VLM[name]
        cmd = [sys.executable, "-m", module, "--workload", w_path, "--task", json.dumps({**task, **extra})]
        out.append(run_one(cmd, name=name, baseline=base if at_base else None, timeout=t))
    return out


def summarise(kind: str, raw: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per contender; ratios to the limit and to torch, of medians and paired per round."""
    rate, limit = RATE[kind], LIMIT[kind]
    names = sorted({r["name"] for r in raw})
    rounds: dict[int, dict[str, dict[str, Any]]] = {}
    for r in raw:
        if r["ok"]:
            rounds.setdefault(r["round"], {})[r["name"]] = r
    for by in rounds.values():
        for r in by.values():
            r["per_cpu_s"] = per_cpu_second(r, rate)
    table: dict[str, Any] = {}
    for name in names:
        runs = [by[name] for by in rounds.values() if name in by]
        failed = [r.get("error", "")[:300] for r in raw if r["name"] == name and not r["ok"]]
        row: dict[str, Any] = {"runs": len(runs), "failed": failed}
        for key in (rate, "ttfb_s", "main_cpu_cores", "children_cpu_cores", "half_rate_ratio", "per_cpu_s"):
            values = [r[key] for r in runs if r.get(key) is not None]
            row[key] = median(values) if values else None
            row[f"{key}_samples"] = values
        for other, label in ((limit, "limit"), ("torch_dataloader", "torch")):
            pairs = [by[name][rate] / by[other][rate] for by in rounds.values() if name in by and other in by]
            row[f"over_{label}_paired"] = median(pairs) if pairs else None
            row[f"over_{label}_samples"] = pairs
        cpu_pairs = [
            by[name]["per_cpu_s"] / by[limit]["per_cpu_s"]
            for by in rounds.values()
            if name in by and limit in by and by[name]["per_cpu_s"] and by[limit]["per_cpu_s"]
        ]
        row["cpu_over_limit_paired"] = median(cpu_pairs) if cpu_pairs else None
        row["cpu_over_limit_samples"] = cpu_pairs
        table[name] = row
    torch = table.get("torch_dataloader", {})
    for row in table.values():
        row["over_limit"] = _ratio(row[rate], table.get(limit, {}).get(rate))
        row["over_torch"] = _ratio(row[rate], torch.get(rate))
        row["ttfb_over_torch"] = _ratio(row["ttfb_s"], torch.get("ttfb_s"))
    return {"rate": rate, "limit": limit, "table": table}


def per_cpu_second(run: dict[str, Any], rate: str) -> float | None:
    """A run's work per CPU-second: the limit's from the CPU time its processes spent encoding
    (``cpu_seconds``), a loader's from its rate over the cores its process and its children
    were busy in the timed window. Per CPU-second, not per second, so a machine that lends
    other tenants a core moves it less; the paired ratio to the limit's is the share of all
    the CPU spent that goes to the work itself."""
    if run.get("cpu_seconds"):
        units = run.get(rate.removesuffix("_per_s"))  # tokens or images, as the rate counts
        return float(units) / float(run["cpu_seconds"]) if units else None
    main, children = run.get("main_cpu_cores"), run.get("children_cpu_cores")
    if run.get(rate) is None or main is None or children is None or not main + children:
        return None
    return float(run[rate]) / float(main + children)


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"Baseline {results['baseline']}, now {results['now']}; {results['rounds']} rounds; load average "
        f"{results['loadavg_start']} at the start, {results['loadavg_end']} at the end; {os.cpu_count()} CPUs.",
    ]
    for kind, summary in results["workloads"].items():
        rate = summary["rate"]
        lines += [
            "",
            f"### {kind}: {rate} (medians of {results['rounds']} rounds)",
            "",
            f"| contender | {rate} | / {summary['limit']} | paired | / torch | paired | first batch s | / torch "
            "| consumer cores | children cores | per CPU-s / limit's, paired |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, row in sorted(summary["table"].items(), key=lambda kv: -(kv[1][rate] or 0)):
            lines.append(
                f"| {name} | {_f(row[rate], ',.1f')} | {_f(row['over_limit'])} | {_f(row['over_limit_paired'])} "
                f"| {_f(row['over_torch'])} | {_f(row['over_torch_paired'])} | {_f(row['ttfb_s'])} "
                f"| {_f(row['ttfb_over_torch'])} | {_f(row['main_cpu_cores'])} | {_f(row['children_cpu_cores'])} "
                f"| {_f(row['cpu_over_limit_paired'])} |"
            )
        for name, row in summary["table"].items():
            if row["failed"]:
                lines.append(f"- {name}: {len(row['failed'])} failed: `{row['failed'][0][:200]}`")
    return "\n".join(lines) + "\n"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _f(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--baseline", default=BASELINE)
    p.add_argument("--workloads", default="text,vlm")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--vlm-steps", type=int, default=200)
    p.add_argument("--vlm-warmup", type=int, default=60)
    p.add_argument("--text-contenders", default=",".join(TEXT))
    p.add_argument("--vlm-contenders", default=",".join(VLM))
    p.add_argument("--text-workload", help="a text workload JSON (default: bench.run's real data)")
    p.add_argument("--vlm-workload", help="a VLM workload JSON (default: bench.run's real data)")
    p.add_argument(
        "--vlm-stamps-only",
        action="store_true",
        help="the VLM data without its photos (the tuxpaint stamps only, in a tar of their own): "
        "every loader's first batch then holds the same kind of samples",
    )
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    base = unpack_baseline(args.baseline)
    now = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    results: dict[str, Any] = {
        "baseline": args.baseline,
        "now": now.stdout.strip(),
        "rounds": args.rounds,
        "loadavg_start": [round(x, 1) for x in os.getloadavg()],
        "workloads": {},
    }
    work = Path(tempfile.mkdtemp(prefix="zephon-speed-"))
    raw: dict[str, list[dict[str, Any]]] = {}
    kinds = [k for k in args.workloads.split(",") if k]
    paths = {}
    if "text" in kinds:
        paths["text"] = args.text_workload or _text_workload(work)
    if "vlm" in kinds:
        if args.vlm_workload:
            paths["vlm"] = args.vlm_workload
        else:
            paths["vlm"] = str(work / "vlm.json")
            w = vlm_run.real_workload(None)
            if args.vlm_stamps_only:
                w = _stamps_only(w, work)
            Path(paths["vlm"]).write_text(w.to_json(), encoding="utf-8")
    for r in range(args.rounds):
        for kind in kinds:
            if kind == "text":
                names = [n for n in args.text_contenders.split(",") if n]
                task = {
                    "kind": "throughput",
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "workers": args.workers,
                }
                got = text_round(paths["text"], task, rotated(names, r), base, args.timeout)
            else:
                names = [n for n in args.vlm_contenders.split(",") if n]
                task = {"steps": args.vlm_steps, "warmup": args.vlm_warmup, "workers": args.workers}
                got = vlm_round(paths["vlm"], task, rotated(names, r), base, args.timeout)
            raw.setdefault(kind, []).extend({"round": r, **g} for g in got)
    results["loadavg_end"] = [round(x, 1) for x in os.getloadavg()]
    results["workloads"] = {kind: summarise(kind, runs) for kind, runs in raw.items()}
    results["raw"] = raw
    (args.out / "speed.json").write_text(json.dumps(results, indent=1, default=str), encoding="utf-8")
    text = markdown(results)
    (args.out / "speed.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


def _stamps_only(w: VlmWorkload, work: Path) -> VlmWorkload:
    """``w`` over one tar holding only its ``tuxpaint-*`` samples (small stamps), in order.

    The full data's lanes deal one split of large photos into the first batch (one of them, a
    3595 x 3723 RGBA PNG, takes 0.5 s to decode alone), while torch's ``DataLoader`` reads the
    tar in file order and starts with stamps; without the photos both start alike."""
    out = work / "stamps" / "stamps-00000.tar"
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w") as dest:
        for shard in vlm_shards(w):
            with tarfile.open(shard) as src:
                for member in src.getmembers():
                    if member.isfile() and member.name.rpartition("/")[2].startswith("tuxpaint-"):
                        dest.addfile(member, src.extractfile(member))
    return dataclasses.replace(w, tars=str(out.parent / "stamps-*.tar"))


def _text_workload(work: Path) -> str:
    from bench.run import parse_args, real_workload

    workload, _ = real_workload(parse_args([]))
    path = work / "text.json"
    path.write_text(workload.to_json(), encoding="utf-8")
    return str(path)


if __name__ == "__main__":
    sys.exit(main())
