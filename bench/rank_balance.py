"""Per-rank cost spread, contiguous slices against balanced ones (``balance=``), by simulation.

```bash
.venv/bin/python examples/make_data.py /tmp/zf-data
.venv/bin/python -m bench.rank_balance --data /tmp/zf-data            # the table
.venv/bin/python -m bench.rank_balance --data /tmp/zf-data --json     # the same, as JSON
```

The global batches are real: one ``Loader`` (world size 1) runs each pipeline for ``--steps``
steps of ``--batch`` rows (512 by default, so that every world size 2..64 divides it). Each
world size W is then simulated on those batches: rank r's cost is the sum of the costs of its
rows, under the contiguous slices (``[r*B/W, (r+1)*B/W)``) and under ``zf.balance_rows`` (what
``Loader(balance=...)`` gives each rank: ``tests/test_rank_balance.py`` checks that a balanced
rank's rows are these). Reported per step, averaged over the steps:

- ``max/mean``: the costliest rank's cost over the mean rank's (the step waits for the
  costliest rank: 1.00 is perfect balance);
- ``spread``: (max - min) / mean of the ranks' costs;
- ``floor``: a lower bound of max/mean for any assignment of B/W rows per rank (``floor``);
- ``row cv``: the rows' coefficient of variation (std / mean of the row costs).

Pipelines:

- ``text``: the README's text mix (``ReadJsonl`` + ``ReadParquet``, ``Mix(0.7, 0.3)``,
  ``Tokenize``, ``Pack(seq_len=512)`` (concat), ``Shuffle(256)``, 8 lanes) over
  ``examples/make_data.py``'s files, with costs ``tokens`` (every row is full: concat packing
  pads only at the end of a finite input) and ``attention`` (sum of squared document lengths);
- ``text-best-fit``: the same with ``Pack(strategy="best_fit")``, which pads: ``tokens`` varies;
- ``vl``: ``examples/train_tiny_vlm.py``'s vision-language pipeline (WebDataset tars ->
  ``DecodeImage`` -> ``ResizeImage`` -> ``TokenizeField`` -> ``PackMultimodal(48,
  tokens_per_image=4, max_images=4)`` -> ``Shuffle(8)``), captions all alike;
- ``vl-varied``: the same pipeline with captions of 1 to 120 words and ``PackMultimodal(256,
  tokens_per_image=16, max_images=8)``, so a row holds 1 to 8 images (the issue's "0-8
  images"), costs ``images``, ``tokens`` and ``attention``.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import random
import statistics
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

# isort: off
import zephon_flow as zf  # first: it quiets notices Beam logs when imported

import apache_beam as beam
import numpy as np

# isort: on
from bench.state_dict_cost import make_spec as readme_spec
from zephon_flow import operators as ops
from zephon_flow.engine.balance import contiguous_rows, row_costs

WORLD_SIZES = (2, 4, 8, 16, 32, 64)
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def tiny_vlm() -> Any:
    """``examples/train_tiny_vlm.py`` as a module (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("train_tiny_vlm", EXAMPLES / "train_tiny_vlm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_tiny_vlm"] = module
    spec.loader.exec_module(module)
    return module


def text_spec(data: str, batch: int, strategy: str) -> zf.LoaderSpec:
    if strategy == "concat":
        return readme_spec(data, seq_len=512, buffer=256, batch=batch)

    def text_mix(p: beam.Pipeline) -> beam.PCollection:
        web = p | "web" >> ops.ReadJsonl(f"{data}/web/*.jsonl.gz", field="text")
        code = p | "code" >> ops.ReadParquet(f"{data}/code/*.parquet", column="content")
        docs = (web, code) | "mix" >> ops.Mix(weights=[0.7, 0.3])
        toks = docs | "tok" >> beam.ParDo(ops.Tokenize(f"{data}/tokenizer.json", append_eos=True))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=512, strategy="best_fit"))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=256))

    return zf.LoaderSpec(text_mix, lanes=8, seed=1234, global_batch_size=batch)


def vl_spec(root: Path, batch: int, *, varied: bool) -> zf.LoaderSpec:
    """The tiny VLM example's pipeline over its own drawn data (``varied``: long, uneven captions)."""
    ex = tiny_vlm()
    folder = root / ("vl-varied" if varied else "vl")
    images = 4096
    if not varied:
        spec, _vocab, _image_id = ex.make_spec(folder, images)
        return zf.LoaderSpec(spec.build, lanes=8, seed=spec.seed, global_batch_size=batch)
    shards, captions = _varied_shards(ex, folder / "shards", images)
    tokenizer = ex.write_tokenizer(folder / "tokenizer.json", captions)
    from tokenizers import Tokenizer

    image_id = Tokenizer.from_file(tokenizer).token_to_id(ex.IMAGE)
    assert image_id is not None, f"the tokenizer has no {ex.IMAGE!r} token"

    def build(p: beam.Pipeline) -> beam.PCollection:
        samples = p | "shards" >> ops.ReadWebDataset(shards, samples_per_split=32)
        decoded = samples | "decode" >> beam.ParDo(ops.DecodeImage(draft_size=ex.SIZE))
        resized = decoded | "resize" >> beam.ParDo(ops.ResizeImage(ex.SIZE))
        captioned = resized | "caption" >> beam.ParDo(ops.TokenizeField(tokenizer, field="txt"))
        packed = captioned | "pack" >> beam.ParDo(
            ops.PackMultimodal(256, image_token_id=image_id, tokens_per_image=16, max_images=8)
        )
        return packed | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=8))

    return zf.LoaderSpec(build, lanes=8, seed=5, global_batch_size=batch)


def _varied_shards(ex: Any, folder: Path, images: int, per_shard: int = 256) -> tuple[str, list[str]]:
    """WebDataset shards of the example's drawn pictures with captions of 1 to 120 words
    (mostly short: a heavy-tailed length), so packed rows hold 1 to 8 images."""
    folder.mkdir(parents=True, exist_ok=True)
    rng, captions = random.Random(7), []
    colours, words = sorted(ex.COLOURS), ("and", "with", "near", "under", "over", "the", "bright", "small")
    for shard in range(0, images, per_shard):
        with tarfile.open(folder / f"shapes-{shard // per_shard:04d}.tar", "w") as tar:
            for i in range(shard, min(images, shard + per_shard)):
                colour, background = rng.sample(colours, 2)
                shape = rng.choice(ex.SHAPES)
                extra = min(120, int(rng.paretovariate(1.2)) - 1)
                caption = " ".join(
                    [f"a {colour} {shape} on a {background} background", *rng.choices(words, k=extra)]
                )
                captions.append(caption)
                for ext, data in (
                    ("jpg", ex.draw(shape, colour, background, rng)),
                    ("txt", caption.encode()),
                ):
                    member = tarfile.TarInfo(f"{i:06d}.{ext}")
                    member.size = len(data)
                    tar.addfile(member, io.BytesIO(data))
    return str(folder / "shapes-*.tar"), captions


def global_batches(spec: zf.LoaderSpec, steps: int) -> list[dict[str, np.ndarray]]:
    out = []
    with zf.Loader(spec, backend="threads", workers=2) as loader:
        for step, batch in loader:
            out.append(batch)
            if step + 1 == steps:
                break
    return out


def floor(costs: np.ndarray, world: int) -> float:
    """A lower bound of max/mean for any assignment of ``B/W`` rows per rank: 1 (the mean), or
    for some ``m``: a rank holds ``m`` of the ``(m-1)*W + 1`` costliest rows (pigeonhole), each
    costing at least the last of them, and ``B/W - m`` other rows, at least the cheapest."""
    per, ascending = len(costs) // world, np.sort(costs)
    descending, mean = ascending[::-1], float(costs.sum()) / world or 1.0
    bounds = [
        m * float(descending[(m - 1) * world]) + float(ascending[: per - m].sum()) for m in range(1, per + 1)
    ]
    return max(1.0, max(bounds) / mean)


def spreads(costs: list[np.ndarray], world: int) -> dict[str, float]:
    """Mean over steps of max/mean and (max-min)/mean, contiguous and balanced."""
    result: dict[str, list[float]] = {k: [] for k in ("floor", "c_max", "b_max", "c_spread", "b_spread")}
    for c in costs:
        result["floor"].append(floor(c, world))
        for tag, rows in (("c", contiguous_rows(len(c), world)), ("b", zf.balance_rows(c, world))):
            loads = c[rows].sum(axis=1)
            mean = float(loads.mean()) or 1.0
            result[f"{tag}_max"].append(float(loads.max()) / mean)
            result[f"{tag}_spread"].append(float(loads.max() - loads.min()) / mean)
    return {k: statistics.fmean(v) for k, v in result.items()}


PIPELINES: dict[str, tuple[str, ...]] = {
    "text": ("tokens", "attention"),
    "text-best-fit": ("tokens", "attention"),
    "vl": ("images", "tokens", "attention"),
    "vl-varied": ("images", "tokens", "attention"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="the folder examples/make_data.py wrote")
    parser.add_argument("--batch", type=int, default=512, help="global batch size (default 512)")
    parser.add_argument("--steps", type=int, default=8, help="global batches per pipeline (default 8)")
    parser.add_argument("--only", choices=sorted(PIPELINES), action="append", help="only these pipelines")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of the table")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, costs_of in PIPELINES.items():
            if args.only and name not in args.only:
                continue
            if name.startswith("text"):
                spec = text_spec(args.data, args.batch, "concat" if name == "text" else "best_fit")
            else:
                spec = vl_spec(Path(tmp), args.batch, varied=name == "vl-varied")
            batches = global_batches(spec, args.steps)
            for cost in costs_of:
                per_step = [row_costs(b, cost) for b in batches]
                cv = statistics.fmean(float(c.std() / (c.mean() or 1.0)) for c in per_step)
                for world in WORLD_SIZES:
                    rows.append(
                        {
                            "pipeline": name,
                            "cost": cost,
                            "world": world,
                            "row_cv": cv,
                            **spreads(per_step, world),
                        }
                    )
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(
        f"global batch {args.batch}, {args.steps} steps; per step, averaged: max/mean and (max-min)/mean of the ranks' costs"
    )
    print(
        f"{'pipeline':<14} {'cost':<10} {'row cv':>6} {'W':>3}  {'max/mean contig':>15} {'balanced':>9} "
        f"{'floor':>6}  {'spread contig':>13} {'balanced':>9}"
    )
    for r in rows:
        print(
            f"{r['pipeline']:<14} {r['cost']:<10} {r['row_cv']:>6.2f} {r['world']:>3}  "
            f"{r['c_max']:>15.3f} {r['b_max']:>9.3f} {r['floor']:>6.3f}  {r['c_spread']:>13.3f} {r['b_spread']:>9.3f}"
        )


if __name__ == "__main__":
    main()
