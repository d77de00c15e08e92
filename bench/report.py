"""Turns raw benchmark results into medians, ratios, goals, a Markdown report and plots.

The side-by-side run's (``bench.run``: ``summarise``, ``markdown``, ``plots``; its vision-language
section is ``bench.vlm_report``) and the tokenizer-limit run's (``bench.throughput``:
``summarise_throughput``, ``markdown_throughput``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import vlm_report
from bench.stats import NOISE, fmt, machine, median, paired_over_limit, rate_flags, ratio
from bench.stats import table as stats_table

GOAL_LIMIT = 0.8
GOAL_PEER = 1.0
GOAL_FLAT = 1.2
ZEPHON = ("zephon_processes_hf", "zephon_processes_auto")
RESUME_ZEPHON = ("zephon_processes_hf", "zephon_inline_hf")
OTHER_ENGINE = {"zephon_processes_auto"}  # not the limit's HF tokenizer: may beat it legitimately
#: The limit of each other-engine contender's own engine (tiktoken alone in 2 processes).
OWN_LIMIT = {"zephon_processes_auto": "limit_tiktoken"}
GOAL_OWN_LIMIT = 0.9


def _throughput(runs: list[dict[str, Any]], peers: set[str]) -> dict[str, Any]:
    keys = ("tokens_per_s", "end_to_end_tokens_per_s", "ttfb_s", "padding_fraction", "half_rate_ratio")
    table = stats_table(runs, (*keys, "main_cpu_cores", "children_cpu_cores"))
    limit = table.get("limit", {}).get("tokens_per_s")
    peer_rates = {n: t["tokens_per_s"] for n, t in table.items() if n in peers and t["tokens_per_s"]}
    best_peer = max(peer_rates, key=lambda n: peer_rates[n]) if peer_rates else None
    paired = paired_over_limit(runs, "tokens_per_s")
    for name, row in table.items():
        row["over_limit"] = ratio(row["tokens_per_s"], limit)
        row["over_best_peer"] = ratio(row["tokens_per_s"], peer_rates.get(best_peer)) if best_peer else None
        row["over_limit_paired_median"] = paired[name]
        row["flags"] = _flags(name, row, limit)
    for name, own in OWN_LIMIT.items():
        if name in table and own in table:
            table[name]["over_own_limit"] = ratio(table[name]["tokens_per_s"], table[own]["tokens_per_s"])
            table[name]["over_own_limit_paired_median"] = _paired(runs, name, own)
            table[name]["flags"] = rate_flags(table[name], {"tokens_per_s": table[own]["tokens_per_s"]})
    return {"table": table, "best_peer": best_peer}


def _paired(runs: list[dict[str, Any]], name: str, limit: str) -> float | None:
    """The median over rounds of ``name``'s tokens/s over ``limit``'s in the same round."""
    rounds: dict[int, dict[str, float]] = {}
    for run in runs:
        if run["ok"]:
            rounds.setdefault(run["round"], {})[run["name"]] = run["tokens_per_s"]
    pairs = [r[name] / r[limit] for r in rounds.values() if r.get(name) and r.get(limit)]
    return median(pairs) if pairs else None


def _flags(name: str, row: dict[str, Any], limit: float | None) -> list[str]:
    """Why this row's rate is not a valid steady-state throughput (empty when it looks valid);
    the limit, and an engine other than the limit's, are not held to the limit's rate."""
    exempt = name in ("limit", *OWN_LIMIT.values()) or name in OTHER_ENGINE
    return rate_flags(row, {} if exempt else {"tokens_per_s": limit, "end_to_end_tokens_per_s": limit})


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
            "ttfb_last_over_first": ratio(last["ttfb_s"], first["ttfb_s"]),
            "bytes_last_over_first": ratio(last["checkpoint_bytes"], first["checkpoint_bytes"]),
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
        if table.get(name, {}).get("over_own_limit") is not None:
            goals[f"{name}_over_own_limit"] = {"value": table[name]["over_own_limit"], "goal": GOAL_OWN_LIMIT}
    # the resume goals: from the processes backend's study, or the inline one's if only that ran
    z: dict[str, Any] = next((resume[n] for n in RESUME_ZEPHON if "points" in resume.get(n, {})), {})
    if "points" in z:
        first, last = z["points"][0], z["points"][-1]
        for key, what in (("ttfb_s", "zephon_resume_ttfb"), ("checkpoint_bytes", "zephon_checkpoint_bytes")):
            goals[f"{what}_last_over_first"] = {
                "value": ratio(last[key], first[key]),
                "goal": GOAL_FLAT,
                # the medians the ratio is taken of, and the samples behind them
                "steps": [first["step"], last["step"]],
                "medians": [first[key], last[key]],
                "raw": [[x[key] for x in p["samples"] if key in x] for p in (first, last)],
            }
    for name in ZEPHON:
        for key in (f"{name}_over_limit", f"{name}_over_best_peer", f"{name}_over_own_limit"):
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
            f"| {name} | {fmt(row['tokens_per_s'])} | {fmt(row['over_limit'], '.2f')} "
            f"| {fmt(row['over_limit_paired_median'], '.2f')} | {fmt(row['over_best_peer'], '.2f')} "
            f"| {fmt(row.get('end_to_end_tokens_per_s'))} "
            f"| {fmt(row['ttfb_s'], '.2f')} | {fmt(row['peak_rss_mb'])} | {fmt(row['padding_fraction'], '.4f')} "
            f"| {fmt(row.get('half_rate_ratio'), '.2f')} "
            f"| {fmt(row.get('main_cpu_cores'), '.2f')} / {fmt(row.get('children_cpu_cores'), '.2f')} "
            f"| {'**FLAGGED**' if row.get('flags') else 'ok'} |"
        )
    lines.append(f"\nBest peer: {res['throughput']['best_peer']}.")
    for name, own in OWN_LIMIT.items():
        if table.get(name, {}).get("over_own_limit") is not None:
            lines.append(
                f"{name} over its own engine's limit ({own}): {fmt(table[name]['over_own_limit'], '.2f')} "
                f"(paired median {fmt(table[name]['over_own_limit_paired_median'], '.2f')}; "
                f"goal >= {GOAL_OWN_LIMIT})."
            )
    served, embedded = table.get("zephon_service_hf"), table.get("zephon_processes_hf")
    if served and embedded:
        lines.append(
            "zephon-flow served over gRPC (`zephon serve`, processes x2, one `zf.Client` rank) over "
            f"embedded: {fmt(ratio(served['tokens_per_s'], embedded['tokens_per_s']), '.2f')} after "
            f"warm-up, {fmt(ratio(served['end_to_end_tokens_per_s'], embedded['end_to_end_tokens_per_s']), '.2f')} "
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
        lines.append(f"| {key} | {fmt(g['value'], '.2f')} | {op} {g['goal']} | {met} | {raw} |")
    lines += vlm_report.markdown_lines(res.get("vlm"))
    lines.append("")
    return "\n".join(lines)


def _num(x: Any, spec: str) -> str:
    return ", ".join(fmt(v, spec) for v in x) if isinstance(x, list) else fmt(x, spec)


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
                f"| {name} | {p['step']:,} | {fmt(p['ttfb_s'], '.2f')} [{_num(ttfb, '.2f')}] "
                f"| {fmt(p['checkpoint_bytes'])} [{_num(size, ',.0f')}] | {p['matches_uninterrupted']} "
                f"| {fmt(p.get('reached_s'), ',.1f')} |"
            )
        took = f"{r['uninterrupted_s']:,.0f} s" if r.get("uninterrupted_s") is not None else "n/a"
        note = f"- {name}: the uninterrupted run to step {fmt(r.get('last_step'), ',')} took {took}"
        if r.get("timed_out"):
            note += (
                f"; **the task hit its timeout ({fmt(r.get('timeout_s'), ',.0f')} s) after the points "
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
                    steps, values = zip(*raw, strict=True)
                    ax.scatter(steps, values, s=10, alpha=0.5, color=line.get_color())
                drawn = True
        ax.set_xscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        if drawn:
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=100)
        plt.close(fig)


# -- bench.throughput: zephon-flow against the tokenizer's limit, and the cost of a resume -------


def summarise_throughput(
    *,
    config: dict[str, Any],
    machine: dict[str, Any],
    raw: dict[str, list[Any]],
    states: dict[str, dict[str, Any]],
    checks: dict[str, bool],
) -> dict[str, Any]:
    """``bench.throughput``'s results: medians over repeats, ratios, goals, beside the raw runs."""

    def med(name: str, key: str) -> float:
        return median([r[key] for r in raw[name]])

    def med_resume(backend: str, which: str) -> float:
        return median([r[backend][which]["ttfb_s"] for r in raw["resume"]])

    bytes_per_token = config["bytes_per_token"]
    limit_tps = med("limit", "tokens_per_s")
    proc_tps = med("zephon_processes", "tokens_per_s")
    inline_tps = med("zephon_inline", "tokens_per_s")
    paired = [
        p["tokens_per_s"] / lim["tokens_per_s"]
        for p, lim in zip(raw["zephon_processes"], raw["limit"], strict=True)
    ]
    medians = {
        "limit_tokens_per_s": limit_tps,
        "limit_mb_per_s": med("limit", "mb_per_s"),
        "zephon_processes_tokens_per_s": proc_tps,
        "zephon_processes_mb_per_s_est": proc_tps * bytes_per_token / 1e6,
        "zephon_processes_ttfb_fresh_s": med("zephon_processes", "ttfb_s"),
        "zephon_processes_init_s": med("zephon_processes", "init_s"),
        "zephon_processes_main_cpu_cores": median(
            [r["main_cpu_s"] / r["seconds"] for r in raw["zephon_processes"]]
        ),
        "zephon_processes_main_cpu_us_per_token": med("zephon_processes", "main_cpu_us_per_token"),
        "zephon_inline_tokens_per_s": inline_tps,
        "zephon_inline_mb_per_s_est": inline_tps * bytes_per_token / 1e6,
        "zephon_inline_ttfb_fresh_s": med("zephon_inline", "ttfb_s"),
        "zephon_inline_init_s": med("zephon_inline", "init_s"),
        "resume_processes_ttfb_early_s": med_resume("processes", "early"),
        "resume_processes_ttfb_late_s": med_resume("processes", "late"),
        "resume_inline_ttfb_early_s": med_resume("inline", "early"),
        "resume_inline_ttfb_late_s": med_resume("inline", "late"),
        "state_bytes_early": states["early"]["bytes"],
        "state_bytes_late": states["late"]["bytes"],
    }
    ratios = {
        "processes_over_limit": proc_tps / limit_tps,
        "processes_over_limit_paired_median": median(paired),
        "inline_over_limit": inline_tps / limit_tps,
        "processes_over_inline": proc_tps / inline_tps,
        "resume_processes_ttfb_late_over_early": medians["resume_processes_ttfb_late_s"]
        / medians["resume_processes_ttfb_early_s"],
        "resume_inline_ttfb_late_over_early": medians["resume_inline_ttfb_late_s"]
        / medians["resume_inline_ttfb_early_s"],
        "state_bytes_late_over_early": states["late"]["bytes"] / states["early"]["bytes"],
    }
    goals = {
        "processes_over_limit_min": GOAL_LIMIT,
        "resume_late_over_early_max": GOAL_FLAT,
        "met": {
            "throughput": ratios["processes_over_limit"] >= GOAL_LIMIT,
            "resume_time_processes": ratios["resume_processes_ttfb_late_over_early"] <= GOAL_FLAT,
            "resume_time_inline": ratios["resume_inline_ttfb_late_over_early"] <= GOAL_FLAT,
            "state_size": ratios["state_bytes_late_over_early"] <= GOAL_FLAT,
        },
    }
    return {
        "benchmark": "zephon-flow throughput and resume cost",
        "config": config,
        "machine": machine,
        "medians": medians,
        "ratios": ratios,
        "goals": goals,
        "checks": checks,
        "state": states,
        "raw": raw,
    }


def markdown_throughput(results: dict[str, Any]) -> str:
    """``bench.throughput``'s table, printed to stdout."""
    m, r, c = results["medians"], results["ratios"], results["config"]
    engine = c.get("tokenize_engine", {}).get("selected", "hf")
    rows: list[tuple[str, str, str]] = [
        (
            "limit: tokenizer alone, 2 processes",
            f"{m['limit_tokens_per_s']:,.0f} tok/s",
            f"{m['limit_mb_per_s']:.2f} MB/s",
        ),
        (
            f"zephon-flow, processes x2 (Tokenize: {engine})",
            f"{m['zephon_processes_tokens_per_s']:,.0f} tok/s",
            f"~{m['zephon_processes_mb_per_s_est']:.2f} MB/s; first batch {m['zephon_processes_ttfb_fresh_s']:.2f} s; "
            f"main process uses {m['zephon_processes_main_cpu_cores']:.2f} cores",
        ),
        (
            f"zephon-flow, inline (Tokenize: {engine})",
            f"{m['zephon_inline_tokens_per_s']:,.0f} tok/s",
            f"~{m['zephon_inline_mb_per_s_est']:.2f} MB/s; first batch {m['zephon_inline_ttfb_fresh_s']:.2f} s",
        ),
        (
            "ratio processes / limit",
            f"{r['processes_over_limit']:.2f}",
            f"paired median {r['processes_over_limit_paired_median']:.2f}; goal >= {GOAL_LIMIT}",
        ),
        (
            f"resume processes: step {c['early_step']} / {c['late_step']}",
            f"{m['resume_processes_ttfb_early_s']:.2f} s / {m['resume_processes_ttfb_late_s']:.2f} s",
            f"late/early {r['resume_processes_ttfb_late_over_early']:.2f}",
        ),
        (
            f"resume inline: step {c['early_step']} / {c['late_step']}",
            f"{m['resume_inline_ttfb_early_s']:.2f} s / {m['resume_inline_ttfb_late_s']:.2f} s",
            f"late/early {r['resume_inline_ttfb_late_over_early']:.2f}",
        ),
        (
            f"checkpoint bytes: step {c['early_step']} / {c['late_step']}",
            f"{m['state_bytes_early']:,} / {m['state_bytes_late']:,}",
            f"late/early {r['state_bytes_late_over_early']:.2f}",
        ),
    ]
    lines = [
        f"### zephon-flow throughput ({c['steps']} timed steps after {c['warmup_steps']} warm-up, "
        f"{c['global_batch_size']} x {c['seq_len']} tokens each; "
        f"median of {c['repeats']}, {results['machine']['cpu_count']} CPUs)",
        "",
        "| measurement | value | notes |",
        "| --- | --- | --- |",
        *(f"| {a} | {b} | {n} |" for a, b, n in rows),
        "",
        "checks: " + ", ".join(f"{k}={v}" for k, v in results["checks"].items()),
    ]
    return "\n".join(lines)
