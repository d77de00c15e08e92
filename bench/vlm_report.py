"""The vision-language workload's raw results as medians, ratios and flags, a Markdown section and a plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.stats import fmt, paired_over_limit, rate_flags, ratio
from bench.stats import table as stats_table

PEER = "torch_dataloader"
ZEPHON = "zephon_processes"
RATES = ("images_per_s", "caption_tokens_per_s", "end_to_end_images_per_s", "end_to_end_caption_tokens_per_s")
LABELS = {
    "limit": "limit (Pillow + HF tokenizer alone, 2 processes)",
    ZEPHON: "zephon-flow, processes x2",
    "zephon_inline": "zephon-flow, inline (1 core)",
    PEER: "torch DataLoader, num_workers=2",
}


def _flags(name: str, row: dict[str, Any], limit: dict[str, Any]) -> list[str]:
    """Why this row's rates are not valid steady-state throughput (empty when they look valid):
    the text report's rules (``bench.stats.rate_flags``), applied to images/s and caption tokens/s,
    each end-to-end rate held to the limit's rate of the same kind."""
    if name == "limit":
        return rate_flags(row, {})
    return rate_flags(row, {key: limit.get(key.removeprefix("end_to_end_")) for key in RATES})


def summarise(
    raw: list[dict[str, Any]], *, workload: dict[str, Any], config: dict[str, Any], checks: dict[str, Any]
) -> dict[str, Any]:
    keys = ("ttfb_s", "padding_fraction", "half_rate_ratio", "main_cpu_cores", "children_cpu_cores")
    table = stats_table(raw, (*RATES, *keys))
    for name, row in table.items():
        shapes = [
            r["first_batch_shapes"]
            for r in raw
            if r["name"] == name and r["ok"] and "first_batch_shapes" in r
        ]
        row["first_batch_shapes"] = shapes[0] if shapes else None
    limit = table.get("limit", {})
    peer = table.get(PEER, {})
    paired = paired_over_limit(raw, "images_per_s")
    for name, row in table.items():
        row["over_limit"] = ratio(row["images_per_s"], limit.get("images_per_s"))
        row["tokens_over_limit"] = ratio(row["caption_tokens_per_s"], limit.get("caption_tokens_per_s"))
        row["over_peer"] = ratio(row["images_per_s"], peer.get("images_per_s"))
        row["end_to_end_over_peer"] = ratio(
            row["end_to_end_images_per_s"], peer.get("end_to_end_images_per_s")
        )
        row["over_limit_paired_median"] = paired[name]
        row["flags"] = _flags(name, row, limit)
    # zephon-flow's batches have the peer's fields and shapes (plus its ``documents`` provenance)
    same_shapes = None
    theirs = peer.get("first_batch_shapes")
    ours = [row["first_batch_shapes"] for n, row in table.items() if n.startswith("zephon_")]
    if theirs and ours and all(ours):
        same_shapes = all(shapes.get(k) == v for shapes in ours for k, v in theirs.items())
    return {
        "workload": workload,
        "config": config,
        "checks": {**checks, "zephon_and_peer_batch_shapes_equal": same_shapes},
        "table": table,
        "raw": raw,
    }


def markdown_lines(res: dict[str, Any] | None) -> list[str]:
    """The report's vision-language section (nothing when the workload was not run)."""
    if not res:
        return []
    w, cfg, checks = res["workload"], res["config"], res["checks"]
    lines = [
        "",
        "## Vision-language workload: decode, resize to 336, tokenize captions, multimodal pack",
        "",
        f"Work: WebDataset tars `{w['tars']}`; decode (JPEG draft at {w['size']}), center-crop resize "
        f"(bicubic) to {w['size']} x {w['size']}, GPT-2 HF tokenizer on the captions (EOS appended), "
        f"pack into {w['seq_len']} tokens with {w['tokens_per_image']} placeholder tokens per image and "
        f"at most {w['max_images']} images per sequence; global batch {w['global_batch']} sequences; "
        f"{cfg['workers']} workers; zephon-flow with {w['lanes']} lanes. The limit does the decode, "
        "resize and tokenize alone (no loader, no packing). "
        f"{cfg['steps']} timed steps after the first batch and {cfg['warmup']} untimed ones, "
        f"{cfg['rounds']} round(s), order rotated; medians. Load average (1, 5, 15 min) at the start "
        f"{[round(x, 1) for x in cfg['loadavg_start']]}, at the end {[round(x, 1) for x in cfg['loadavg_end']]} "
        f"on {cfg['cpu_count']} CPUs. Same work checked on "
        f"{checks['samples_checked']} samples: pixels equal {checks['pixels_equal']}, caption ids equal "
        f"{checks['caption_ids_equal']}; zephon-flow and torch batch shapes equal "
        f"{checks['zephon_and_peer_batch_shapes_equal']}.",
        "",
        "| contender | images/s after warm-up | caption tokens/s | / limit | / limit (paired median) "
        "| / torch DataLoader | end-to-end images/s | end-to-end caption tokens/s | first batch s "
        "| peak RSS MB | padding | window 1st/2nd half | CPU cores: consumer / children | valid |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    table = res["table"]
    for name, row in sorted(table.items(), key=lambda kv: -(kv[1]["images_per_s"] or 0)):
        lines.append(
            f"| {LABELS.get(name, name)} | {fmt(row['images_per_s'], ',.1f')} "
            f"| {fmt(row['caption_tokens_per_s'])} | {fmt(row['over_limit'], '.2f')} "
            f"| {fmt(row['over_limit_paired_median'], '.2f')} | {fmt(row['over_peer'], '.2f')} "
            f"| {fmt(row['end_to_end_images_per_s'], ',.1f')} | {fmt(row['end_to_end_caption_tokens_per_s'])} "
            f"| {fmt(row['ttfb_s'], '.2f')} | {fmt(row['peak_rss_mb'])} | {fmt(row['padding_fraction'], '.3f')} "
            f"| {fmt(row['half_rate_ratio'], '.2f')} "
            f"| {fmt(row['main_cpu_cores'], '.2f')} / {fmt(row['children_cpu_cores'], '.2f')} "
            f"| {'**FLAGGED**' if row['flags'] else 'ok'} |"
        )
    flagged = [(n, f) for n, row in table.items() for f in row["flags"]]
    if flagged:
        lines.append("\n**WARNING: these VLM rates are not valid steady-state throughput:**\n")
        lines += [f"- **{n}: {f}**" for n, f in flagged]
    for name, row in table.items():
        if row["failed"]:
            lines.append(f"- {name}: {len(row['failed'])} failed run(s): `{row['failed'][0][:200]}`")
    lines.append("")
    return lines


def plot(res: dict[str, Any] | None, out: Path) -> None:
    """``vlm_throughput.png``: images/s after warm-up and end to end, per contender."""
    if not res:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = res["table"]
    names = [n for n in table if table[n]["images_per_s"]]
    if not names:
        return
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ys = list(range(len(names)))
    ax.barh(
        [y + 0.2 for y in ys], [table[n]["images_per_s"] for n in names], height=0.4, label="after warm-up"
    )
    ax.barh(
        [y - 0.2 for y in ys],
        [table[n]["end_to_end_images_per_s"] or 0 for n in names],
        height=0.4,
        label="end to end",
    )
    ax.set_yticks(ys, names)
    ax.set_xlabel("images/s (median)")
    ax.set_title("Vision-language workload throughput, same 2 cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "vlm_throughput.png", dpi=100)
    plt.close(fig)


def write_alone(res: dict[str, Any] | None, out: Path) -> int:
    """``bench.json`` (key ``vlm``), ``report.md`` and the plot when only the VLM workload ran."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps({"vlm": res}, indent=1), encoding="utf-8")
    lines = ["# zephon-flow side by side", *markdown_lines(res)]
    (out / "report.md").write_text("\n".join(lines), encoding="utf-8")
    plot(res, out)
    return 0
