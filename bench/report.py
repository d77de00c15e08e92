"""Turns the contenders' raw results into medians, ratios, goals, a Markdown report and plots."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench import vlm_report

GOAL_LIMIT = 0.8
GOAL_PEER = 1.0
GOAL_FLAT = 1.2
NOISE = 0.10  # a rate above the limit by more than this is not a measurement of steady throughput
UNSTEADY = 1.25  # first half of the timed window faster than the second by more: a buffer was draining
ZEPHON = ("zephon_processes_hf", "zephon_processes_auto")
RESUME_ZEPHON = ("zephon_processes_hf", "zephon_inline_hf")
OTHER_ENGINE = {"zephon_processes_auto"}  # not the limit's HF tokenizer: may beat it legitimately


def _median(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def machine() -> dict[str, Any]:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        head = ""
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg": list(os.getloadavg()),
        "git": head.strip(),
    }


def _throughput(runs: list[dict[str, Any]], peers: set[str]) -> dict[str, Any]:
    by_name: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        by_name[run["name"]].append(run)
    table: dict[str, dict[str, Any]] = {}
    for name, items in by_name.items():
        good = [r for r in items if r["ok"]]
        table[name] = {
            "runs": len(items),
            "failed": [r.get("error", "")[:300] for r in items if not r["ok"]],
            "tokens_per_s": _median([r["tokens_per_s"] for r in good]),
            "end_to_end_tokens_per_s": _median(
                [r["end_to_end_tokens_per_s"] for r in good if "end_to_end_tokens_per_s" in r]
            ),
            "ttfb_s": _median([r["ttfb_s"] for r in good if "ttfb_s" in r]),
            "peak_rss_mb": _median([r["peak_rss_bytes"] / 1e6 for r in good]),
            "padding_fraction": _median([r["padding_fraction"] for r in good]),
            "half_rate_ratio": _median([r["half_rate_ratio"] for r in good if r.get("half_rate_ratio")]),
            "main_cpu_cores": _median(
                [r["main_cpu_cores"] for r in good if r.get("main_cpu_cores") is not None]
            ),
            "children_cpu_cores": _median(
                [r["children_cpu_cores"] for r in good if r.get("children_cpu_cores") is not None]
            ),
        }
    limit = table.get("limit", {}).get("tokens_per_s")
    peer_rates = {n: t["tokens_per_s"] for n, t in table.items() if n in peers and t["tokens_per_s"]}
    best_peer = max(peer_rates, key=lambda n: peer_rates[n]) if peer_rates else None
    rounds: dict[int, dict[str, float]] = defaultdict(dict)
    for run in runs:
        if run["ok"]:
            rounds[run["round"]][run["name"]] = run["tokens_per_s"]
    for name, row in table.items():
        row["over_limit"] = _ratio(row["tokens_per_s"], limit)
        row["over_best_peer"] = _ratio(row["tokens_per_s"], peer_rates.get(best_peer)) if best_peer else None
        paired = [r[name] / r["limit"] for r in rounds.values() if name in r and r.get("limit")]
        row["over_limit_paired_median"] = _median(paired)
        row["flags"] = _flags(name, row, limit)
    return {"table": table, "best_peer": best_peer}


def _flags(name: str, row: dict[str, Any], limit: float | None) -> list[str]:
    """Why this row's rate is not a valid steady-state throughput (empty when it looks valid)."""
    flags = []
    for key in ("tokens_per_s", "end_to_end_tokens_per_s"):
        rate = row.get(key)
        if name != "limit" and name not in OTHER_ENGINE and limit and rate and rate > limit * (1 + NOISE):
            flags.append(f"{key} {rate / limit:.2f}x the limit (> {1 + NOISE:.2f}x): read-ahead or a bug")
    ratio = row.get("half_rate_ratio")
    if ratio and ratio > UNSTEADY:
        flags.append(
            f"timed window not steady: its first half {ratio:.2f}x faster than its second (buffer draining)"
        )
    return flags


def _resume(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per contender: its points (medians of the consecutive checkpoints and of the resumes, raw
    samples beside them), how long its uninterrupted run took, and last-over-first ratios."""
    out: dict[str, Any] = {}
    for run in runs:
        if not run["ok"] or not run.get("points"):
            why = run.get("error") or run.get("unsupported") or "no point finished"
            out[run["name"]] = {"error": why, "timed_out": run.get("timed_out", False)}
            continue
        points = run["points"]
        first, last = points[0], points[-1]
        out[run["name"]] = {
            "points": points,
            "uninterrupted_s": run.get("uninterrupted_s"),
            "last_step": run.get("last_step"),
            "consecutive": run.get("consecutive"),
            "resumes": run.get("resumes"),
            "timed_out": run.get("timed_out", False),
            "timeout_s": run.get("timeout_s"),
            "ttfb_last_over_first": _ratio(last["ttfb_s"], first["ttfb_s"]),
            "bytes_last_over_first": _ratio(last["checkpoint_bytes"], first["checkpoint_bytes"]),
            "first_step": first["step"],
            "last_point": last["step"],
            "all_match": all(p["matches_uninterrupted"] for p in points),
        }
    return out


def summarise(
    *,
    raw: dict[str, list[dict[str, Any]]],
    config: dict[str, Any],
    workload: dict[str, Any],
    study: dict[str, Any],
    data: dict[str, Any],
    unavailable: dict[str, str],
    peers: set[str],
) -> dict[str, Any]:
    throughput = _throughput(raw["throughput"], peers)
    resume = _resume(raw["resume"])
    elastic = {r["name"]: r for r in raw["elastic"]}
    table = throughput["table"]
    goals: dict[str, Any] = {}
    for name in ZEPHON:
        if name in table:
            goals[f"{name}_over_limit"] = {"value": table[name]["over_limit"], "goal": GOAL_LIMIT}
            goals[f"{name}_over_best_peer"] = {"value": table[name]["over_best_peer"], "goal": GOAL_PEER}
    # the resume goals: from the processes backend's study, or the inline one's if only that ran
    z = next((resume[n] for n in RESUME_ZEPHON if "points" in resume.get(n, {})), {})
    if "points" in z:
        first, last = z["points"][0], z["points"][-1]
        for key, what in (("ttfb_s", "zephon_resume_ttfb"), ("checkpoint_bytes", "zephon_checkpoint_bytes")):
            goals[f"{what}_last_over_first"] = {
                "value": _ratio(last[key], first[key]),
                "goal": GOAL_FLAT,
                # the medians the ratio is taken of, and the samples behind them
                "steps": [first["step"], last["step"]],
                "medians": [first[key], last[key]],
                "raw": [[x[key] for x in p["samples"] if key in x] for p in (first, last)],
            }
    for name in ZEPHON:
        for key in (f"{name}_over_limit", f"{name}_over_best_peer"):
            if key in goals:
                goals[key]["flags"] = table[name]["flags"]
        if throughput["best_peer"] and f"{name}_over_best_peer" in goals:
            goals[f"{name}_over_best_peer"]["flags"] = (
                goals[f"{name}_over_best_peer"]["flags"] + table[throughput["best_peer"]]["flags"]
            )
    for key, goal in goals.items():
        value = goal["value"]
        below = key.endswith("last_over_first")
        goal["met"] = None if value is None else (value <= goal["goal"] if below else value >= goal["goal"])
    return {
        "config": config,
        "machine": machine(),
        "workload": workload,
        "resume_workload": study,
        "data": data,
        "unavailable": unavailable,
        "throughput": throughput,
        "resume": resume,
        "elastic": elastic,
        "goals": goals,
        "raw": raw,
    }


def _fmt(x: Any, spec: str = ",.0f") -> str:
    return "n/a" if x is None else format(x, spec)


def markdown(res: dict[str, Any]) -> str:
    w, cfg = res["workload"], res["config"]
    lines = [
        "# zephon-flow side by side: text workload",
        "",
        f"Workload: {len(w['sources'])} sources mixed {w['weights']}, GPT-2 HF tokenizer (EOS appended), "
        f"concat pack to {w['seq_len']}, shuffle {w['shuffle_per_lane']} x {w['lanes']} lanes "
        f"(= {w['shuffle_per_lane'] * w['lanes']} sequences in all; peers split that total over their "
        f"workers), global batch {w['global_batch']}, 1 rank, {cfg['workers']} workers.",
        f"Throughput: {cfg['steps']} timed steps after the first batch and {cfg['warmup']} untimed ones, "
        f"{cfg['rounds']} rounds, contenders alternated (order rotated per round); medians reported. "
        "tokens/s counts non-pad tokens delivered to the consumer.",
        f"Machine: {res['machine']['cpu_count']} CPUs, shared with other jobs (load average at the end "
        f"{[round(x, 1) for x in res['machine']['loadavg']]}): numbers are noisy, read the ratios.",
        f"Data: {res['data'].get('used', res['data'].get('workload_file'))}",
        "",
        "## Throughput",
        "",
        "| contender | tokens/s after warm-up | / limit | / limit (paired median) | / best peer "
        "| end-to-end tokens/s | first batch s | peak RSS MB | padding | window 1st/2nd half "
        "| CPU cores: consumer / children | valid |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    table = res["throughput"]["table"]
    for name, row in sorted(table.items(), key=lambda kv: -(kv[1]["tokens_per_s"] or 0)):
        lines.append(
            f"| {name} | {_fmt(row['tokens_per_s'])} | {_fmt(row['over_limit'], '.2f')} "
            f"| {_fmt(row['over_limit_paired_median'], '.2f')} | {_fmt(row['over_best_peer'], '.2f')} "
            f"| {_fmt(row.get('end_to_end_tokens_per_s'))} "
            f"| {_fmt(row['ttfb_s'], '.2f')} | {_fmt(row['peak_rss_mb'])} | {_fmt(row['padding_fraction'], '.4f')} "
            f"| {_fmt(row.get('half_rate_ratio'), '.2f')} "
            f"| {_fmt(row.get('main_cpu_cores'), '.2f')} / {_fmt(row.get('children_cpu_cores'), '.2f')} "
            f"| {'**FLAGGED**' if row.get('flags') else 'ok'} |"
        )
    lines.append(f"\nBest peer: {res['throughput']['best_peer']}.")
    served, embedded = table.get("zephon_service_hf"), table.get("zephon_processes_hf")
    if served and embedded:
        lines.append(
            "zephon-flow served over gRPC (`zephon serve`, processes x2, one `zf.Client` rank) over "
            f"embedded: {_fmt(_ratio(served['tokens_per_s'], embedded['tokens_per_s']), '.2f')} after "
            f"warm-up, {_fmt(_ratio(served['end_to_end_tokens_per_s'], embedded['end_to_end_tokens_per_s']), '.2f')} "
            "end to end (the server's start-up, work and the loopback transfer, on the same 2 cores)."
        )
    flagged = [(n, f) for n, row in table.items() for f in row.get("flags", [])]
    if flagged:
        lines.append("\n**WARNING: these rates are not valid steady-state throughput:**\n")
        lines += [f"- **{n}: {f}**" for n, f in flagged]
    lines.append(
        "\n*tokens/s after warm-up* is the rate between two deliveries well after the first batch; it "
        "is a steady-state rate only once the loader's read-ahead (shuffle buffers, map batches, "
        "prefetched batches) has drained, which *window 1st/2nd half* checks (near 1 when steady). "
        "*end-to-end tokens/s* counts every token delivered from the loader's construction to its last "
        "batch, start-up included: read-ahead cannot inflate it, start-up deflates it. A rate above the "
        f"limit by more than {NOISE:.0%} is flagged as invalid."
    )
    for name, row in table.items():
        if row["failed"]:
            lines.append(f"- {name}: {len(row['failed'])} failed run(s): `{row['failed'][0][:200]}`")
    for name, why in res["unavailable"].items():
        lines.append(f"- {name}: not run ({why[:200]})")
    lines += _resume_markdown(res)
    lines += ["", "## Elasticity: resume under another topology, batches compared by digest", ""]
    lines += ["| contender | checkpoint topology | resumed with | outcome |", "| --- | --- | --- | --- |"]
    for name, r in res["elastic"].items():
        if not r["ok"] or "cases" not in r:
            lines.append(f"| {name} | | | {str(r.get('error') or r.get('unsupported'))[:150]} |")
            continue
        for c in r["cases"]:
            outcome = c["outcome"]
            if outcome == "mismatch":
                outcome += f" ({c['batches_matching']}/{r['count']} batches equal)"
            elif outcome == "refused":
                outcome += f": `{c['error'][:150]}`"
            lines.append(
                f"| {name} | 1 rank x {r['checkpoint_workers']} workers, step {r['step']} "
                f"| {c['world_size']} rank(s) x {c['workers']} workers | {outcome} |"
            )
    lines += [
        "",
        "## Goals",
        "",
        "| goal | value | target | met | from (raw values) |",
        "| --- | ---: | ---: | --- | --- |",
    ]
    for key, g in res["goals"].items():
        op = "<=" if key.endswith("last_over_first") else ">="
        met = f"{g['met']} (**INVALID: a rate in it is flagged**)" if g.get("flags") else g["met"]
        raw = ""
        if "medians" in g:
            (a, b), (ra, rb) = g["steps"], g["raw"]
            spec = ",.0f" if "bytes" in key else ",.2f"
            raw = (
                f"median at step {a:,}: {_num(g['medians'][0], spec)} [{_num(ra, spec)}]; "
                f"at step {b:,}: {_num(g['medians'][1], spec)} [{_num(rb, spec)}]"
            )
        lines.append(f"| {key} | {_fmt(g['value'], '.2f')} | {op} {g['goal']} | {met} | {raw} |")
    lines += vlm_report.markdown_lines(res.get("vlm"))
    lines.append("")
    return "\n".join(lines)


def _num(x: Any, spec: str) -> str:
    return ", ".join(_fmt(v, spec) for v in x) if isinstance(x, list) else _fmt(x, spec)


def _resume_markdown(res: dict[str, Any]) -> list[str]:
    s = res["resume_workload"]
    lines = [
        "",
        "## Resume: time to first batch and checkpoint size against the step",
        "",
        f"Resume study at global batch {s['global_batch']} (same sequences, smaller batch, so that "
        "the later steps are reachable in the budget). One uninterrupted run per contender takes "
        "checkpoints at consecutive steps s, s+1, ... of each point s (their size depends on what is "
        "in flight); a new loader from each of the first few of them (zephon-flow: several; peers, "
        "whose resume may replay the data: one) is timed to its first batch, which is compared with "
        "the uninterrupted run's by digest. Medians first, raw samples in brackets.",
        "",
        "| contender | step | first batch after resume s: median [samples] "
        "| checkpoint bytes: median [samples] | matches | uninterrupted run reached it after s |",
        "| --- | ---: | ---: | ---: | --- | ---: |",
    ]
    notes = []
    for name, r in res["resume"].items():
        if "points" not in r:
            cut = " (timed out)" if r.get("timed_out") else ""
            lines.append(f"| {name} | - | failed{cut}: {str(r.get('error'))[:120]} | | | |")
            continue
        for p in r["points"]:
            samples = p.get("samples", [])
            ttfb = [x["ttfb_s"] for x in samples if "ttfb_s" in x]
            size = [x["checkpoint_bytes"] for x in samples]
            lines.append(
                f"| {name} | {p['step']:,} | {_fmt(p['ttfb_s'], '.2f')} [{_num(ttfb, '.2f')}] "
                f"| {_fmt(p['checkpoint_bytes'])} [{_num(size, ',.0f')}] | {p['matches_uninterrupted']} "
                f"| {_fmt(p.get('reached_s'), ',.1f')} |"
            )
        took = f"{r['uninterrupted_s']:,.0f} s" if r.get("uninterrupted_s") is not None else "n/a"
        note = f"- {name}: the uninterrupted run to step {_fmt(r.get('last_step'), ',')} took {took}"
        if r.get("timed_out"):
            note += (
                f"; **the task hit its timeout ({_fmt(r.get('timeout_s'), ',.0f')} s) after the points "
                "shown: the later points were not measured**"
            )
        notes.append(note + ".")
    return [*lines, "", *notes]


def plots(res: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vlm_report.plot(res.get("vlm"), out)
    table = res["throughput"]["table"]
    names = [n for n in table if table[n]["tokens_per_s"]]
    if names:
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.barh(names, [table[n]["tokens_per_s"] for n in names])
        ax.set_xlabel("tokens/s (median)")
        ax.set_title("Text workload throughput, same 2 cores")
        fig.tight_layout()
        fig.savefig(out / "throughput.png", dpi=100)
        plt.close(fig)
    for key, label, fname in (
        ("ttfb_s", "time to first batch after resume (s)", "resume_ttfb.png"),
        ("checkpoint_bytes", "checkpoint bytes", "checkpoint_bytes.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        drawn = False
        for name, r in res["resume"].items():
            if "points" in r:
                line = ax.plot(
                    [p["step"] for p in r["points"]],
                    [p[key] for p in r["points"]],
                    marker="o",
                    label=f"{name} (median)",
                )[0]
                raw = [(p["step"], x[key]) for p in r["points"] for x in p.get("samples", []) if key in x]
                if raw:
                    ax.scatter(*zip(*raw, strict=True), s=10, alpha=0.5, color=line.get_color())
                drawn = True
        ax.set_xscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        if drawn:
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=100)
        plt.close(fig)
