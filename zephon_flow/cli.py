"""The ``zephon`` command line: digests of global batches, digest diffs, inspection, the demo, serving.

Exit codes: 0 success, 1 a failure (a file that cannot be read, a pipeline that does not load
or is refused, bad data), 2 a usage error (arguments argparse refuses, among them every number
out of its range, a malformed ``MODULE:SPEC``, options that do not go together). An error is
one line on stderr, ``zephon: error: ...``; ``-v`` prints the traceback before it (with a DoFn's
error, its own traceback, from the worker where it ran). Logging is configured here, not by
``import zephon_flow``:
``--log-level`` (default INFO) for zephon-flow's loggers, WARNING for other libraries.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from zephon_flow import __version__
from zephon_flow.core.errors import SpecError, UsageError, ZephonError
from zephon_flow.engine.balance import COSTS as BALANCE_COSTS
from zephon_flow.engine.spec import LoaderSpec
from zephon_flow.progress import Progress
from zephon_flow.runners.backends.base import BACKENDS

if TYPE_CHECKING:
    from zephon_flow.service.server import BatchServer

logger = logging.getLogger("zephon_flow.cli")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _import_file(module_name: str) -> Any:
    path = os.path.abspath(module_name)
    if not os.path.isfile(path):
        raise UsageError(f"no such pipeline file: {module_name}")
    sys.path.insert(0, os.path.dirname(path))
    spec_ = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    if spec_ is None or spec_.loader is None:
        raise UsageError(f"{module_name} is not a Python file")
    module = importlib.util.module_from_spec(spec_)
    sys.modules[spec_.name] = module
    try:
        spec_.loader.exec_module(module)
    except ZephonError:
        raise
    except Exception as exc:
        raise SpecError(
            f"pipeline file {module_name} raised {_where(exc)}{type(exc).__name__}: {exc}"
        ) from exc
    return module


def _import_module(module_name: str) -> Any:
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise UsageError(
                f"no module named {module_name!r} (from the current directory or the installed "
                f"packages); for a file, give its path: path/to/pipeline.py:spec"
            ) from exc
        raise SpecError(f"module {module_name} raised {_where(exc)}ModuleNotFoundError: {exc}") from exc
    except ZephonError:
        raise
    except Exception as exc:
        raise SpecError(f"module {module_name} raised {_where(exc)}{type(exc).__name__}: {exc}") from exc


def _where(exc: BaseException) -> str:
    """``file:line: `` of the innermost frame of ``exc`` (where a pipeline file broke)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"at {exc.filename}:{exc.lineno}: "
    return f"at {frames[-1].filename}:{frames[-1].lineno}: " if frames else ""


def load_spec(target: str) -> LoaderSpec:
    """Resolves ``MODULE:SPEC``: a file path or dotted module, then an attribute that is a
    ``LoaderSpec`` or a function returning one."""
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"expected MODULE:SPEC (e.g. examples/pipeline.py:spec), got {target!r}")
    if module_name.endswith(".py") or os.sep in module_name:
        module = _import_file(module_name)
    else:
        module = _import_module(module_name)
    if not hasattr(module, attr):
        raise UsageError(f"{module_name} has no attribute {attr!r}")
    value: Any = getattr(module, attr)
    if callable(value) and not isinstance(value, LoaderSpec):
        try:
            value = value()
        except ZephonError:
            raise
        except Exception as exc:
            raise SpecError(f"{target}() raised {_where(exc)}{type(exc).__name__}: {exc}") from exc
    if not isinstance(value, LoaderSpec):
        raise UsageError(f"{target} is a {type(value).__name__}, not a zf.LoaderSpec")
    size = value.batch_schedule.constant or value.batch_schedule  # an int, or the schedule
    logger.debug("loaded %s: lanes=%d, global batch %s", target, value.lanes, size)
    return value


def _digest(args: argparse.Namespace) -> int:
    from zephon_flow.core.batches import batch_digest
    from zephon_flow.core.checkpoint.state import LoaderState
    from zephon_flow.core.checkpoint.store import load_state, save_state
    from zephon_flow.engine.simulate import global_batches

    spec = load_spec(args.target)
    state = load_state(args.state, codecs=spec.compile().derived_codecs) if args.state else None
    final: list[dict[str, Any]] = []
    progress = Progress(total=args.steps, desc="digest", enabled=_bar(args))
    digests = []
    batches = global_batches(
        spec,
        steps=args.steps,
        world_size=args.world_size,
        backend=args.backend,
        workers=args.workers,
        state=state,
        final_state=final,
    )
    for step, batch in progress(batches):
        digests.append((step, batch_digest(batch)))
        print(f"{step} {digests[-1][1]}", flush=True)
    if args.save_state:
        save_state(LoaderState.from_plain(final[0]), args.save_state)
    if len(digests) < args.steps:
        logger.warning("input ended after %d of %d steps", len(digests), args.steps)
    return 0


def _materialize(args: argparse.Namespace) -> int:
    from zephon_flow.core.batches import batch_digest
    from zephon_flow.engine.materialize import materialize, read_materialized

    spec = load_spec(args.target)
    done = materialize(
        spec, steps=args.steps, out=args.out, runner=args.runner, beam_args=args.beam_args, passes=args.passes
    )
    for step, batch in read_materialized(done.out):  # read back: what `zephon digest` prints
        print(f"{step} {batch_digest(batch)}", flush=True)
    ended = " (the finite input ended)" if done.ended else ""
    logger.info("wrote steps 0..%d to %s%s", done.steps - 1, done.out, ended)
    return 0


def _bar(args: argparse.Namespace) -> bool | None:
    """Progress bars: on a terminal unless ``--no-progress``."""
    return False if getattr(args, "no_progress", False) else None


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

    from zephon_flow.core.checkpoint.store import load_state
    from zephon_flow.engine.inspection import inspect_step, render

    if args.rank >= args.world_size:
        raise UsageError(
            f"zephon inspect: --rank must be below --world-size ({args.world_size}), got {args.rank}"
        )
    spec = load_spec(args.target)
    state = load_state(args.state, codecs=spec.compile().derived_codecs) if args.state else None
    if args.splits:
        return _inspect_splits(spec, state, as_json=args.json)
    if args.step is None:
        raise UsageError("zephon inspect: give --step N (or --splits)")
    views = inspect_step(
        spec,
        args.step,
        rank=args.rank,
        world_size=args.world_size,
        state=state,
        backend=args.backend,
        workers=args.workers,
        progress=Progress(
            total=max(1, args.step - (0 if state is None else state.step) + 1),
            desc=f"to step {args.step}",
            enabled=_bar(args),
        ),
    )
    if args.json:
        print(json.dumps([dataclasses.asdict(v) for v in views], indent=1))
    else:
        print(render(views, step=args.step, rank=args.rank, world_size=args.world_size))
    return 0


def _inspect_splits(spec: Any, state: Any, *, as_json: bool) -> int:
    import dataclasses
    import json

    from zephon_flow.engine.splitreport import render_splits, split_report

    report = split_report(spec, state)
    if as_json:
        print(json.dumps([dataclasses.asdict(r) for r in report], indent=1))
    else:
        print(render_splits(report, lanes=spec.lanes))
    return 0


def _verify(args: argparse.Namespace) -> int:
    """``zephon verify CHECKPOINT MODULE:SPEC``: each lane's first window against its check."""
    import dataclasses
    import json

    from zephon_flow.core.checkpoint.store import load_state
    from zephon_flow.engine.verify import OK, render, verify_state

    lanes = None
    if args.lanes is not None:
        try:
            lanes = [int(x) for x in args.lanes.split(",") if x.strip()]
        except ValueError as exc:
            raise UsageError(
                f"zephon verify: --lanes takes lane numbers like 0,3,5, got {args.lanes!r}"
            ) from exc
    spec = load_spec(args.target)
    verdicts = verify_state(
        spec,
        load_state(args.checkpoint, codecs=spec.compile().derived_codecs),
        lanes=lanes,
        backend=args.backend,
        workers=args.workers,
    )
    if args.json:
        print(json.dumps([dataclasses.asdict(v) for v in verdicts], indent=1))
    else:
        print(render(verdicts))
    return 0 if all(v.verdict == OK for v in verdicts) else 1


def add_verify_command(sub: Any) -> None:
    """``zephon verify``: exit 0 when every lane resumes onto its recorded stream, 1 if not."""
    v = add_command(
        sub,
        "verify",
        _verify,
        "run a checkpoint's lanes to their first window and compare it with the digest the "
        "checkpoint recorded (exit 0: every lane OK, 1: a mismatch or a lane without a digest)",
    )
    v.add_argument("checkpoint", metavar="CHECKPOINT")
    v.add_argument("target", metavar="MODULE:SPEC")
    v.add_argument("--lanes", help="only these lanes, e.g. 0,3 (default: every lane of the checkpoint)")
    v.add_argument("--backend", choices=BACKENDS, default="inline")
    v.add_argument("--workers", type=POSITIVE, default=1)
    v.add_argument("--json", action="store_true", help="print JSON instead of text")


def _mix(args: argparse.Namespace) -> int:
    from zephon_flow.service.auth import clean_token, env_token
    from zephon_flow.service.mixing import MixChange, change_mixture, parse_schedule, parse_weights

    if (args.weights is None) == (args.schedule is None):
        raise UsageError("zephon mix: give either --weights W,W,... or --schedule STEP:W,W;STEP:W,W")
    token: str | None = None
    try:
        if args.token_file is not None:
            with open(args.token_file, encoding="utf-8") as f:
                token = clean_token(f.read(), f"zephon mix: --token-file {args.token_file}")
        else:
            token = env_token("zephon mix")
        change = MixChange.of(
            args.at_step,
            weights=None if args.weights is None else parse_weights(args.weights),
            schedule=None if args.schedule is None else parse_schedule(args.schedule),
            interpolation=args.interpolation,
        )
    except SpecError as exc:
        raise UsageError(f"zephon mix: {exc}") from exc
    roots = None
    if args.tls_ca is not None:
        with open(args.tls_ca, "rb") as f:
            roots = f.read()
    history = change_mixture(args.server, change, token=token, root_certificates=roots)
    print(f"zephon mix: the server's mixture from step {args.at_step} on is changed; its history now:")
    for step, params in history:
        print(f"  from step {step}: {json.dumps(params)}")
    return 0


def add_mix_command(sub: Any) -> None:
    """``zephon mix``: new mixture weights for a running ``zephon serve``, from a step on."""
    x = add_command(
        sub,
        "mix",
        _mix,
        "put new mixture weights in force on a running zephon serve from a step on (recorded in "
        "its checkpoints)",
    )
    x.add_argument("--server", required=True, metavar="HOST:PORT", help="the zephon serve to change")
    x.add_argument(
        "--at-step",
        type=NON_NEGATIVE,
        required=True,
        metavar="N",
        help="the first step of the new weights; refused if the server has begun it",
    )
    x.add_argument("--weights", metavar="W,W,...", help="one weight per input of the pipeline's Mix")
    x.add_argument(
        "--schedule",
        metavar="STEP:W,W;STEP:W,W",
        help="instead of --weights: weights at absolute steps, the first at --at-step",
    )
    x.add_argument("--interpolation", choices=("constant", "linear"), default="constant")
    x.add_argument("--token-file", help="the server's token (default: $ZEPHON_TOKEN)")
    x.add_argument("--tls-ca", metavar="PEM", help="CA certificate of a server started with --tls-cert")


def _demo(args: argparse.Namespace) -> int:
    from zephon_flow.demo import run_demo

    return run_demo(steps=args.steps, workers=args.workers, backend=args.backend)


def _int_from(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type=``: an integer in ``[low, high]``; anything else is a usage error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            within = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
            raise argparse.ArgumentTypeError(f"must be {within}, got {text!r}")
        return value

    return parse


def _seconds(text: str) -> float:
    """An argparse ``type=``: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


POSITIVE = _int_from(1)
NON_NEGATIVE = _int_from(0)


_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
}


def _byte_size(text: str) -> int:
    """``"512MiB"``, ``"2GB"`` or a plain number of bytes, as bytes."""
    number = text.strip().rstrip("bBiIkKmMgG")
    unit = text.strip()[len(number) :].upper()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _SIZE_UNITS or not value > 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give bytes as a number with an optional unit "
            f"(B, KB, MB, GB, KiB, MiB, GiB), e.g. 512MiB"
        )
    return max(1, int(value * _SIZE_UNITS[unit]))


def _serve(args: argparse.Namespace) -> int:
    from zephon_flow.service.auth import read_token
    from zephon_flow.service.server import serve_forever

    _check_serve_flags(args)
    if args.ray:  # lanes on Ray lane owners (zephon_flow/cluster/serve.py)
        from zephon_flow.cluster import serve as owners

        return owners.serve(args, load_spec(args.target))
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("zephon serve: --tls-cert and --tls-key go together")
    if args.ray_address is not None and args.backend != "ray":
        raise UsageError("zephon serve: --ray-address goes with --backend ray or --ray")
    try:
        token = read_token(args.token_file)
    except SpecError as exc:
        raise UsageError(str(exc)) from exc
    if args.resume:
        from zephon_flow.core.checkpoint.store import load_state

        logger.info("zephon serve: resuming from %s at step %d", args.resume, load_state(args.resume).step)
    else:
        logger.info("zephon serve: starting at step 0")
    return serve_forever(_batch_server(args, load_spec(args.target), token))


def _check_serve_flags(args: argparse.Namespace) -> None:
    """Refuses the flags ``zephon serve --ray`` (lane owners) cannot honour, and those only
    lane owners take."""
    if not args.ray and args.snapshot_dir is not None:
        raise UsageError(
            "zephon serve: --snapshot-dir goes with --ray (it is where lane owners write their "
            "snapshots); zephon serve without --ray checkpoints with --checkpoint-dir"
        )
    if args.ray and args.balance is not None:
        raise UsageError(
            "zephon serve: --balance is not supported with --ray (lane owners send each rank the rows "
            "of its own lanes); serve without --ray, or balance in the trainer with Loader(balance=...)"
        )
    if args.ray and args.allow_batch_change:
        raise UsageError(
            "zephon serve: --allow-batch-change is not supported with --ray (lane owners take one "
            "fixed global batch size); resume the changed spec without --ray"
        )


def _batch_server(args: argparse.Namespace, spec: LoaderSpec, token: str | None) -> BatchServer:
    """``zephon serve``'s server from its flags."""
    from zephon_flow.service.server import BatchServer

    resumed = {
        "verify_resume": not args.no_verify_resume,
        "allow_mix_change": args.allow_mix_change,
        "allow_batch_change": args.allow_batch_change,
    }
    work = {"backend": args.backend, "workers": args.workers, "chunk_timeout": args.chunk_timeout}
    loader = None
    if args.ray_address is not None:  # BatchServer's own Loader knows no Ray address: build it here
        from zephon_flow.core.checkpoint.store import load_state
        from zephon_flow.engine.loader import Loader

        state = load_state(args.resume, codecs=spec.compile().derived_codecs) if args.resume else None
        loader = Loader(spec, state=state, ray_address=args.ray_address, **work, **resumed)
    return BatchServer(
        spec,
        host=args.host,
        port=args.port,
        checkpoint_dir=args.checkpoint_dir,
        resume=args.resume,
        ahead=args.ahead,
        keep=args.keep,
        held_bytes=args.held_bytes,
        token=token,
        tls=(args.tls_cert, args.tls_key) if args.tls_cert else None,
        checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints,
        stream_timeout=args.stream_timeout,
        loader=loader,
        balance=args.balance,
        **work,
        **resumed,
    )


def _common(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """Options every command takes, before or after its name (``zephon -v digest`` or
    ``zephon digest ... -v``); a subcommand's copy only overrides what it is given."""
    default: Any = argparse.SUPPRESS if not top else None
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS if not top else False,
        help="full tracebacks on errors, and DEBUG logging",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=default,
        help="level of zephon-flow's log messages (default INFO; other libraries: WARNING)",
    )


def add_command(
    sub: Any, name: str, func: Callable[[argparse.Namespace], int], help: str
) -> argparse.ArgumentParser:
    """A subcommand with the common options; add its own and it is ready."""
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help, description=help)
    _common(parser, top=False)
    parser.set_defaults(func=func)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zephon", description="zephon-flow: elastically deterministic data loading"
    )
    parser.add_argument("--version", action="version", version=f"zephon-flow {__version__}")
    _common(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_digest, _add_diff, _add_inspect, add_verify_command, _add_demo, _add_materialize):
        add(sub)
    _add_serve(sub)
    add_mix_command(sub)
    return parser


def _add_digest(sub: Any) -> None:
    """``zephon digest``."""
    d = add_command(sub, "digest", _digest, "print STEP SHA256 for each global batch")
    d.add_argument("target", metavar="MODULE:SPEC")
    d.add_argument("--steps", type=NON_NEGATIVE, required=True)
    d.add_argument(
        "--world-size", type=POSITIVE, default=1, help="simulated ranks whose slices are concatenated"
    )
    d.add_argument("--backend", choices=BACKENDS, default="inline")
    d.add_argument("--workers", type=POSITIVE, default=1)
    d.add_argument("--state", help="resume from this checkpoint file")
    d.add_argument("--save-state", help="write the merged checkpoint after the last step here")
    d.add_argument("--no-progress", action="store_true", help="no progress bar (shown on a terminal)")


def _add_diff(sub: Any) -> None:
    """``zephon diff``."""
    f = add_command(sub, "diff", _diff, "name the first step where two digest files differ")
    f.add_argument("a")
    f.add_argument("b")


def _add_inspect(sub: Any) -> None:
    """``zephon inspect``."""
    i = add_command(
        sub,
        "inspect",
        _inspect,
        "show the documents of every sequence of one step, or (--splits) the split plan",
    )
    i.add_argument("target", metavar="MODULE:SPEC")
    i.add_argument("--step", type=NON_NEGATIVE, help="the step to show (required unless --splits)")
    i.add_argument(
        "--splits",
        action="store_true",
        help="per source: split count, lanes' shares of a pass (min/mean/max), with --state each lane's place",
    )
    i.add_argument("--rank", type=NON_NEGATIVE, default=0)
    i.add_argument("--world-size", type=POSITIVE, default=1)
    i.add_argument("--state", help="start from this checkpoint (of a step at or before --step)")
    i.add_argument("--backend", choices=BACKENDS, default="inline")
    i.add_argument("--workers", type=POSITIVE, default=1)
    i.add_argument("--json", action="store_true", help="print JSON instead of text")
    i.add_argument("--no-progress", action="store_true", help="no progress bar (shown on a terminal)")


def _add_demo(sub: Any) -> None:
    """``zephon demo``."""
    m = add_command(sub, "demo", _demo, "build a small real corpus and show elastic determinism")
    m.add_argument(
        "--steps", type=_int_from(2), default=300, help="at least 2: it resumes halfway (default 300)"
    )
    m.add_argument("--backend", choices=BACKENDS, default="processes")
    m.add_argument("--workers", type=POSITIVE, default=2)


def _add_materialize(sub: Any) -> None:
    """``zephon materialize``."""
    z = add_command(
        sub,
        "materialize",
        _materialize,
        "run the pipeline through Beam, write global batches 0..N-1 as Parquet and print "
        "STEP SHA256 of each as read back (other options are Beam pipeline options)",
    )
    z.add_argument("target", metavar="MODULE:SPEC")
    z.add_argument("--steps", type=POSITIVE, required=True)
    z.add_argument("--out", required=True, metavar="DIR", help="an empty folder: DIR/step-<step>.parquet")
    z.add_argument("--runner", default="FnApiRunner", help="a Beam runner's name (default FnApiRunner)")
    z.add_argument(
        "--passes", type=POSITIVE, default=1, help="passes of each endless source to read (default 1)"
    )


def _add_serve(sub: Any) -> None:
    """``zephon serve``: what it serves and from where, then its held steps, its guard, its checkpoints and Ray."""
    s = add_command(sub, "serve", _serve, "serve every rank its slice of each global batch over gRPC")
    s.add_argument("target", metavar="MODULE:SPEC")
    s.add_argument(
        "--port", type=_int_from(0, 65535), required=True, help="0 picks a free port (printed on start)"
    )
    s.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback only)")
    s.add_argument(
        "--balance",
        choices=BALANCE_COSTS,
        default=None,
        help="send each rank the rows of each global batch that even out this per-row cost across "
        "the ranks (with a 'rows' field, their global indices), instead of contiguous rows",
    )
    s.add_argument("--backend", choices=BACKENDS, default="inline")
    s.add_argument("--workers", type=POSITIVE, default=1)
    s.add_argument("--checkpoint-dir", help="where Checkpoint(step) writes DIR/step-<step>.zfstate")
    s.add_argument("--resume", metavar="DIR/step-STEP.zfstate", help="start from this checkpoint file")
    s.add_argument(
        "--no-verify-resume",
        action="store_true",
        help="with --resume: accept lanes whose first window differs from the one the checkpoint "
        "recorded (changed data or tokenizer), instead of failing",
    )
    s.add_argument(
        "--allow-mix-change",
        action="store_true",
        help="with --resume: accept a checkpoint whose pipeline differs only in its Mix's weights, "
        "schedule or interpolation; the new mixture applies from the checkpoint's step on",
    )
    s.add_argument(
        "--allow-batch-change",
        action="store_true",
        help="with --resume: accept a checkpoint whose pipeline differs only in its global_batch_size "
        "(an int or a schedule); the new sizes apply from the checkpoint's step on",
    )
    _serve_holding(s)
    _serve_guard(s)
    _serve_checkpoints(s)
    _serve_ray(s)
    s.set_defaults(func=_serve)


def _serve_holding(s: argparse.ArgumentParser) -> None:
    """``zephon serve``: the steps it holds for the ranks."""
    s.add_argument(
        "--ahead",
        type=POSITIVE,
        default=32,
        metavar="N",
        help="steps produced ahead of the slowest rank (default 32)",
    )
    s.add_argument(
        "--held-bytes",
        type=_byte_size,
        default=None,
        metavar="SIZE",
        help="bound the bytes of held global batches (e.g. 512MiB; default: no bound): steps behind "
        "the slowest rank are released first, then production waits",
    )
    s.add_argument(
        "--keep", type=NON_NEGATIVE, default=8, help="steps held behind the slowest rank, for reconnects"
    )


def _serve_guard(s: argparse.ArgumentParser) -> None:
    """``zephon serve``: its token and TLS."""
    s.add_argument("--token-file", help="shared token required on every call (default: $ZEPHON_TOKEN)")
    s.add_argument("--tls-cert", help="PEM certificate chain: serve over TLS")
    s.add_argument("--tls-key", help="PEM private key of --tls-cert")


def _serve_checkpoints(s: argparse.ArgumentParser) -> None:
    """``zephon serve``: its checkpoints and timeouts."""
    s.add_argument(
        "--checkpoint-every",
        type=POSITIVE,
        metavar="N",
        help="write a checkpoint to --checkpoint-dir each time the slowest rank has moved N steps on",
    )
    s.add_argument(
        "--keep-checkpoints",
        type=POSITIVE,
        default=3,
        metavar="K",
        help="keep the K newest checkpoints (default 3)",
    )
    s.add_argument(
        "--stream-timeout",
        type=_seconds,
        default=300.0,
        metavar="SECONDS",
        help="drop a stream whose client takes nothing for this long while data waits (default 300)",
    )
    s.add_argument(
        "--chunk-timeout",
        type=_seconds,
        default=300.0,
        metavar="SECONDS",
        help="a stateless call running longer than this fails the pipeline (default 300)",
    )


def _serve_ray(s: argparse.ArgumentParser) -> None:
    """``zephon serve --ray``: lanes on Ray lane owners."""
    s.add_argument(
        "--ray-address",
        "--address",
        dest="ray_address",
        metavar="ADDRESS",
        help="with --backend ray or --ray: join this Ray cluster (ray://HOST:10001 or HOST:6379); "
        "default: start a local Ray",
    )
    s.add_argument("--ray", action="store_true", help="run the lanes on Ray lane owners (--lane-owners N)")
    s.add_argument("--lane-owners", type=POSITIVE, default=1, metavar="N", help="with --ray: owner actors")
    s.add_argument("--world-size", type=POSITIVE, metavar="W", help="with --ray: the trainer ranks")
    s.add_argument(
        "--max-replacements",
        type=NON_NEGATIVE,
        default=3,
        metavar="K",
        help="with --ray: dead owners replaced over the run before it stops with status 3 (default 3)",
    )
    s.add_argument(
        "--snapshot-dir",
        metavar="DIR",
        help="with --ray: each owner writes its lanes' periodic snapshots to files here (a folder "
        "every node sees), not to the coordinator; an owner that dies while the coordinator is "
        "restarted then restarts from its newest file instead of the run's first step",
    )


def configure_logging(level: str, *, verbose: bool) -> None:
    """zephon-flow's loggers at ``level`` (DEBUG with ``verbose``), other libraries at WARNING,
    one line per record on stderr."""
    logging.basicConfig(
        level=logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    logging.getLogger("zephon_flow").setLevel(logging.DEBUG if verbose else level)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; returns its exit code (argparse exits 2 itself on bad arguments)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "materialize":  # only materialize passes options on (to Beam)
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.beam_args = extra
    verbose = bool(getattr(args, "verbose", False))
    configure_logging(getattr(args, "log_level", None) or "INFO", verbose=verbose)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("zephon: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if verbose:
            traceback.print_exc(file=sys.stderr)
        line = _one_line(exc)
        if not verbose and _has_traceback(exc):
            line += " (-v prints the traceback)"
        print(f"zephon: error: {line}", file=sys.stderr)
        return 2 if isinstance(exc, UsageError) else 1


#: Where a DoFn's error message ends and its traceback (carried from where it ran) begins.
_TRACEBACK_MARK = "\n\n-- traceback"


def _one_line(exc: BaseException) -> str:
    """The error's message on one line: without the traceback a DoFn's error carries, its
    lines joined."""
    if isinstance(exc, ZephonError):
        text = str(exc).split(_TRACEBACK_MARK)[0]
    elif isinstance(exc, OSError) and exc.filename is not None:
        text = f"{exc.filename}: {exc.strerror}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return " ".join(part.strip() for part in text.splitlines() if part.strip()) or type(exc).__name__


def _has_traceback(exc: BaseException) -> bool:
    """Whether ``-v`` would show more than the message: a DoFn's traceback, or the place in
    the code of an error that is not the project's own."""
    if isinstance(exc, ZephonError):
        cause = exc.__cause__
        return _TRACEBACK_MARK in str(exc) or (cause is not None and not isinstance(cause, ZephonError))
    return not isinstance(exc, OSError)


if __name__ == "__main__":
    sys.exit(main())
