"""The ``zephon`` command line: digests of global batches, digest diffs, inspection, the demo."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from typing import Any

from zephon_flow.errors import SpecError, ZephonError
from zephon_flow.runners.backends.base import BACKENDS
from zephon_flow.spec import LoaderSpec


def load_spec(target: str) -> LoaderSpec:
    """Resolves ``MODULE:SPEC``: a file path or dotted module, then an attribute that is a
    ``LoaderSpec`` or a function returning one."""
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise SpecError(f"expected MODULE:SPEC (e.g. pipeline.py:spec), got {target!r}")
    if module_name.endswith(".py") or os.sep in module_name:
        path = os.path.abspath(module_name)
        if not os.path.isfile(path):
            raise SpecError(f"no such pipeline file: {module_name}")
        sys.path.insert(0, os.path.dirname(path))
        spec_ = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
        assert spec_ is not None and spec_.loader is not None
        module = importlib.util.module_from_spec(spec_)
        sys.modules[spec_.name] = module
        spec_.loader.exec_module(module)
    else:
        sys.path.insert(0, os.getcwd())
        module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise SpecError(f"{module_name} has no attribute {attr!r}")
    value: Any = getattr(module, attr)
    if callable(value) and not isinstance(value, LoaderSpec):
        value = value()
    if not isinstance(value, LoaderSpec):
        raise SpecError(f"{target} is a {type(value).__name__}, not a zf.LoaderSpec")
    return value


def _digest(args: argparse.Namespace) -> int:
    from zephon_flow.simulate import global_digests
    from zephon_flow.state import load_state, save_state

    spec = load_spec(args.target)
    state = load_state(args.state) if args.state else None
    final: list[dict[str, Any]] = []
    digests = global_digests(
        spec,
        steps=args.steps,
        world_size=args.world_size,
        backend=args.backend,
        workers=args.workers,
        state=state,
        final_state=final,
    )
    for step, digest in digests:
        print(f"{step} {digest}", flush=True)
    if args.save_state:
        save_state(final[0], args.save_state)
    if len(digests) < args.steps:
        print(f"input ended after {len(digests)} of {args.steps} steps", file=sys.stderr)
    return 0


def _read_digests(path: str) -> dict[int, str]:
    out: dict[int, str] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != 2 or not parts[0].isdigit():
                raise SpecError(f"{path}:{n}: expected 'STEP SHA256', got {line.strip()!r}")
            out[int(parts[0])] = parts[1]
    return out


def _diff(args: argparse.Namespace) -> int:
    a, b = _read_digests(args.a), _read_digests(args.b)
    common = sorted(set(a) & set(b))
    for step in common:
        if a[step] != b[step]:
            print(f"first difference at step {step}: {a[step]} != {b[step]}")
            return 1
    if not common:
        print("no step in common")
        return 1
    only = sorted(set(a) ^ set(b))
    extra = f"; steps only in one file: {only[0]}..{only[-1]} ({len(only)})" if only else ""
    print(f"identical over {len(common)} common steps ({common[0]}..{common[-1]}){extra}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from zephon_flow.inspection import inspect_step, render
    from zephon_flow.state import load_state

    spec = load_spec(args.target)
    state = load_state(args.state) if args.state else None
    views = inspect_step(
        spec,
        args.step,
        rank=args.rank,
        world_size=args.world_size,
        state=state,
        backend=args.backend,
        workers=args.workers,
    )
    if args.json:
        print(json.dumps([dataclasses.asdict(v) for v in views], indent=1))
    else:
        print(render(views, step=args.step, rank=args.rank, world_size=args.world_size))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from zephon_flow.demo import run_demo

    return run_demo(steps=args.steps, workers=args.workers, backend=args.backend)


def _serve(args: argparse.Namespace) -> int:
    from zephon_flow.service.auth import read_token
    from zephon_flow.service.server import BatchServer, serve_forever

    if (args.tls_cert is None) != (args.tls_key is None):
        raise SpecError("zephon serve: --tls-cert and --tls-key go together")
    token = read_token(args.token_file)
    server = BatchServer(
        load_spec(args.target),
        host=args.host,
        port=args.port,
        backend=args.backend,
        workers=args.workers,
        checkpoint_dir=args.checkpoint_dir,
        resume=args.resume,
        window=args.window,
        keep=args.keep,
        token=token,
        tls=(args.tls_cert, args.tls_key) if args.tls_cert else None,
        checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints,
        stream_timeout=args.stream_timeout,
        chunk_timeout=args.chunk_timeout,
    )
    return serve_forever(server)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zephon", description="zephon-flow: elastically deterministic data loading"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("digest", help="print STEP SHA256 for each global batch")
    d.add_argument("target", metavar="MODULE:SPEC")
    d.add_argument("--steps", type=int, required=True)
    d.add_argument("--world-size", type=int, default=1, help="simulated ranks whose slices are concatenated")
    d.add_argument("--backend", choices=BACKENDS, default="inline")
    d.add_argument("--workers", type=int, default=1)
    d.add_argument("--state", help="resume from this checkpoint file")
    d.add_argument("--save-state", help="write the merged checkpoint after the last step here")
    d.set_defaults(func=_digest)

    f = sub.add_parser("diff", help="name the first step where two digest files differ")
    f.add_argument("a")
    f.add_argument("b")
    f.set_defaults(func=_diff)

    i = sub.add_parser("inspect", help="show the documents of every sequence of one step")
    i.add_argument("target", metavar="MODULE:SPEC")
    i.add_argument("--step", type=int, required=True)
    i.add_argument("--rank", type=int, default=0)
    i.add_argument("--world-size", type=int, default=1)
    i.add_argument("--state", help="start from this checkpoint (of a step at or before --step)")
    i.add_argument("--backend", choices=BACKENDS, default="inline")
    i.add_argument("--workers", type=int, default=1)
    i.add_argument("--json", action="store_true", help="print JSON instead of text")
    i.set_defaults(func=_inspect)

    m = sub.add_parser("demo", help="build a small real corpus and show elastic determinism")
    m.add_argument("--steps", type=int, default=300)
    m.add_argument("--backend", choices=BACKENDS, default="processes")
    m.add_argument("--workers", type=int, default=2)
    m.set_defaults(func=_demo)

    s = sub.add_parser("serve", help="serve every rank its slice of each global batch over gRPC")
    s.add_argument("target", metavar="MODULE:SPEC")
    s.add_argument("--port", type=int, required=True, help="0 picks a free port (printed on start)")
    s.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback only)")
    s.add_argument("--backend", choices=BACKENDS, default="inline")
    s.add_argument("--workers", type=int, default=1)
    s.add_argument("--checkpoint-dir", help="where Checkpoint(step) writes DIR/step-<step>.zfstate")
    s.add_argument("--resume", metavar="DIR/step-STEP.zfstate", help="start from this checkpoint file")
    s.add_argument("--window", type=int, default=32, help="steps produced ahead of the slowest rank")
    s.add_argument("--keep", type=int, default=8, help="steps held behind the slowest rank, for reconnects")
    s.add_argument("--token-file", help="shared token required on every call (default: $ZEPHON_TOKEN)")
    s.add_argument("--tls-cert", help="PEM certificate chain: serve over TLS")
    s.add_argument("--tls-key", help="PEM private key of --tls-cert")
    s.add_argument(
        "--checkpoint-every",
        type=int,
        metavar="N",
        help="write a checkpoint to --checkpoint-dir each time the slowest rank has moved N steps on",
    )
    s.add_argument(
        "--keep-checkpoints",
        type=int,
        default=3,
        metavar="K",
        help="keep the K newest checkpoints (default 3)",
    )
    s.add_argument(
        "--stream-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="drop a stream whose client takes nothing for this long while data waits (default 300)",
    )
    s.add_argument(
        "--chunk-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="a stateless call running longer than this fails the pipeline (default 300)",
    )
    s.set_defaults(func=_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ZephonError as exc:
        print(f"zephon: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
