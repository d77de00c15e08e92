"""The deterministic runner: reads a Beam graph once, refuses what it cannot run, compiles a Plan.

Phases, in order: ``collect`` (visit the graph; zephon-flow's own composites and Reshuffle are
taken whole, everything else must be an accepted primitive), ``trace`` (walk back from the
returned PCollection: one linear chain per source up to the mix, then one chain to the output),
``classify`` (stateless DoFns before the first stateful one form the parallel front; the rest
runs in order per lane), ``describe`` (graph and parameters for the fingerprint).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import apache_beam as beam
from apache_beam.pipeline import AppliedPTransform, Pipeline, PipelineVisitor
from apache_beam.runners.runner import PipelineResult, PipelineRunner, PipelineState
from apache_beam.transforms import core, window
from apache_beam.transforms.util import Reshuffle
from apache_beam.typehints import typehints

from zephon_flow.core.code import class_code_digest, makes_constant_keyed_pairs, reached_code
from zephon_flow.core.errors import SpecError, UnsupportedTransformError
from zephon_flow.core.identity import beam_function_identity
from zephon_flow.core.roles import role_of
from zephon_flow.runners.dofns import StatefulInvoker, StatelessInvoker, dofn_seed, is_stateful
from zephon_flow.runners.plan import Plan, SourcePlan

#: What a refused source is told to use instead: every zephon-flow source.
SOURCES = (
    "ops.ReadTextFiles (a document per file), ops.ReadJsonl (a JSON object per line), "
    "ops.ReadParquet, ops.ReadArrow or ops.ReadWebDataset"
)


def _taken_whole(transform: Any) -> bool:
    """zephon-flow's sources and mix (by the role they declare) and Reshuffle are not expanded."""
    return role_of(transform) is not None or isinstance(transform, Reshuffle)


@dataclass
class _Collector(PipelineVisitor):  # type: ignore[misc]
    nodes: list[AppliedPTransform] = field(default_factory=list)
    _inside: AppliedPTransform | None = None

    def enter_composite_transform(self, node: AppliedPTransform) -> None:
        if self._inside is not None or node.transform is None:
            return
        if _taken_whole(node.transform):
            self.nodes.append(node)
            self._inside = node
        elif isinstance(node.transform, beam.Create):
            raise UnsupportedTransformError(
                f"transform {node.full_label!r} (Create) is not a zephon-flow source; read data "
                f"with {SOURCES}, so it can be dealt to lanes and resumed"
            )

    def leave_composite_transform(self, node: AppliedPTransform) -> None:
        if node is self._inside:
            self._inside = None

    def visit_transform(self, node: AppliedPTransform) -> None:
        if self._inside is None:
            self.nodes.append(node)


def _refuse(node: AppliedPTransform, why: str) -> UnsupportedTransformError:
    return UnsupportedTransformError(
        f"transform {node.full_label!r} ({type(node.transform).__name__}): {why}"
    )


def _outermost(node: AppliedPTransform) -> AppliedPTransform:
    """The user's transform that ``node`` is part of: its ancestor just below the root."""
    while node.parent is not None and node.parent.parent is not None:
        node = node.parent
    return node


def _passthrough(node: AppliedPTransform) -> bool:
    """Reshuffle and global windowing change nothing in a per-lane ordered stream."""
    t = node.transform
    if isinstance(t, Reshuffle):
        return True
    return isinstance(t, core.WindowInto) and isinstance(t.windowing.windowfn, window.GlobalWindows)


def _check_primitive(node: AppliedPTransform) -> None:
    t = node.transform
    if _taken_whole(t) or _passthrough(node):
        return
    if isinstance(t, core.WindowInto):
        raise _refuse(
            node,
            "windowing is owned by zephon-flow (window b of a lane is its outputs "
            "[b*B/L, (b+1)*B/L)); remove the WindowInto",
        )
    if isinstance(t, core.ParDo):
        if t.side_inputs:
            raise _refuse(node, "side inputs are not supported")
        if len(node.outputs) != 1:
            raise _refuse(node, "multiple outputs (with_outputs) are not supported")
        return
    if isinstance(t, core.Flatten):
        raise _refuse(node, "Flatten gives no order; combine sources with ops.Mix(weights=...)")
    if isinstance(t, core.GroupByKey):
        raise _refuse(node, "GroupByKey is not supported; group inside a stateful DoFn (BagState)")
    if isinstance(t, core.Impulse):
        outer = _outermost(node)
        if outer is not node:  # a Beam read (beam.io.ReadFromText, ...) starts from an Impulse
            raise UnsupportedTransformError(
                f"transform {outer.full_label!r} ({type(outer.transform).__name__}) reads with a "
                f"Beam source, whose records the runner can neither deal to lanes nor resume; "
                f"read the data with a zephon-flow source instead: {SOURCES}"
            )
        raise _refuse(node, f"bare Impulse is not a zephon-flow source; use {SOURCES}")
    raise _refuse(
        node,
        "not one of the transforms the deterministic runner accepts (zephon-flow "
        "sources, Mix, ParDo, Reshuffle, WindowInto(GlobalWindows))",
    )


def describe_params(obj: Any) -> Any:
    """The parameters of an operator that change what it produces (for the fingerprint).

    A ``"code"`` entry is the digest of the user's code in it (``zephon_flow.core.code``): the
    function of ``ops.Map``/``beam.Map`` and friends, the class of a user's own DoFn. The
    fingerprint keeps it apart, as the part ``code <label>``. A user DoFn's ``"reaches"``
    (``reached_code``: the helpers, classes and constants of the user's modules its code names)
    become parts ``code <label> :: helper cut in module m``.
    """
    if isinstance(obj, core.CallableWrapperDoFn):  # beam.Map(fn) and friends: see ops.Map
        return beam_function_identity(obj)
    if hasattr(obj, "params"):
        described = obj.params()
    else:
        described = {
            "class": f"{type(obj).__module__}.{type(obj).__qualname__}",
            **{
                k: v
                for k, v in sorted(vars(obj).items())
                if isinstance(v, int | float | str | bool | type(None))
            },
        }
    own = class_code_digest(type(obj))
    if own is not None and isinstance(described, dict):
        described = dict(described)
        described["code"] = f"{described['code']}+{own}" if "code" in described else own
        reaches = reached_code(type(obj), obj)
        if reaches:  # the user's helpers, classes and constants it names: parts of their own
            described["reaches"] = reaches
    return described


class DeterministicRunner(PipelineRunner):  # type: ignore[misc]
    """A Beam ``PipelineRunner`` that compiles graphs for per-lane deterministic execution.

    ``zf.Loader`` uses ``compile``; ``run_pipeline`` compiles and reports the plan, since
    a zephon-flow pipeline is consumed batch by batch rather than run to completion.
    """

    def __init__(self, *, seed: int = 0) -> None:
        self.seed = seed

    def run_pipeline(self, pipeline: Pipeline, options: Any) -> PipelineResult:
        raise SpecError(
            "a zephon-flow pipeline is not run to completion: build a zf.LoaderSpec from it and "
            "iterate a zf.Loader (or serve it)"
        )

    def compile(self, pipeline: Pipeline, output: beam.PCollection) -> Plan:
        """The plan of ``pipeline`` up to ``output``, in the phases named in the module's doc."""
        nodes = _collect(pipeline)
        graph = _Graph.of(nodes, output)
        trace = self._trace(graph, output)
        for node in trace.path:
            _check_not_keyed(graph, node)
        common, back = self._classify(trace.path)
        return self._describe(graph, trace, common, back, output)

    def _trace(self, graph: _Graph, output: beam.PCollection) -> _Trace:
        """Walks back from ``output``: the chain after the mix (or the lone source), the mix,
        one chain per source; refuses transforms that do not lead to ``output``."""
        path: list[AppliedPTransform] = []
        node = graph.producer[output]
        while role_of(node.transform) is None:
            path.append(node)
            node = graph.producer[node.inputs[0]]
        path.reverse()
        used = {id(n) for n in path}
        mix_node = node if role_of(node.transform) == "mix" else None
        if mix_node is not None:
            used.add(id(mix_node))
            branches = [self._branch(graph.producer, graph.producer[inp], used) for inp in mix_node.inputs]
            if len(branches) != mix_node.transform.n_inputs:
                raise _refuse(mix_node, f"{mix_node.transform.n_inputs} weights for {len(branches)} inputs")
        else:
            branches = [self._branch(graph.producer, node, used)]
        unused = [n.full_label for n in graph.nodes if id(n) not in used]
        if unused:
            raise UnsupportedTransformError(
                f"transform(s) {', '.join(map(repr, unused))} do not lead to the PCollection that "
                f"build(p) returned; remove them"
            )
        return _Trace(path, mix_node, tuple(branches), [n for n in graph.nodes if id(n) in used])

    def _classify(
        self, path: list[AppliedPTransform]
    ) -> tuple[tuple[StatelessInvoker, ...], tuple[StatelessInvoker | StatefulInvoker, ...]]:
        """The stateless front (before the first stateful DoFn) and the ordered back."""
        chain = [n for n in path if not _passthrough(n)]
        first_stateful = next((i for i, n in enumerate(chain) if is_stateful(n.transform.fn)), len(chain))
        common = tuple(StatelessInvoker(n.full_label, n.transform.fn) for n in chain[:first_stateful])
        return common, tuple(self._invoker(n) for n in chain[first_stateful:])

    def _describe(
        self,
        graph: _Graph,
        trace: _Trace,
        common: tuple[StatelessInvoker, ...],
        back: tuple[StatelessInvoker | StatefulInvoker, ...],
        output: beam.PCollection,
    ) -> Plan:
        """The plan, with the graph and every operator's parameters for the fingerprint."""
        mix = trace.mix_node
        return Plan(
            sources=trace.branches,
            mixer=None if mix is None else mix.transform,
            mix_label=None if mix is None else mix.full_label,
            common=common,
            back=back,
            output_label=graph.producer[output].full_label,
            graph=tuple(
                (
                    n.full_label,
                    type(n.transform).__name__,
                    tuple(graph.producer[i].full_label for i in n.inputs if i in graph.producer),
                )
                for n in trace.ordered
            ),
            params=tuple(
                (n.full_label, describe_params(_operator(n))) for n in trace.ordered if not _passthrough(n)
            ),
        )

    def _branch(
        self, producer: dict[Any, AppliedPTransform], node: AppliedPTransform, used: set[int]
    ) -> SourcePlan:
        steps: list[AppliedPTransform] = []
        while role_of(node.transform) != "source":
            if role_of(node.transform) == "mix":
                raise _refuse(node, "a Mix feeding another Mix is not supported; use one Mix")
            used.add(id(node))
            if not _passthrough(node):
                if is_stateful(node.transform.fn):
                    raise _refuse(node, "stateful DoFns must come after the Mix of the sources")
                steps.append(node)
            node = producer[node.inputs[0]]
        used.add(id(node))
        node.transform.bind_label(node.full_label)
        steps.reverse()
        return SourcePlan(
            label=node.full_label,
            source=node.transform,
            chain=tuple(StatelessInvoker(n.full_label, n.transform.fn) for n in steps),
        )

    def _invoker(self, node: AppliedPTransform) -> StatelessInvoker | StatefulInvoker:
        fn = node.transform.fn
        if is_stateful(fn):
            return StatefulInvoker(node.full_label, fn, seed=dofn_seed(self.seed, node.full_label))
        return StatelessInvoker(node.full_label, fn)


def _collect(pipeline: Pipeline) -> list[AppliedPTransform]:
    """Phase *collect* and *check*: the graph's transforms, zephon-flow's own taken whole,
    each one accepted or refused by name."""
    collector = _Collector()
    pipeline.visit(collector)
    for node in collector.nodes:
        _check_primitive(node)
    return collector.nodes


@dataclass(frozen=True)
class _Graph:
    """Who produces each PCollection; a PCollection feeds at most one transform."""

    nodes: list[AppliedPTransform]
    producer: dict[Any, AppliedPTransform]

    @classmethod
    def of(cls, nodes: list[AppliedPTransform], output: beam.PCollection) -> _Graph:
        producer: dict[Any, AppliedPTransform] = {}
        consumers: dict[Any, list[AppliedPTransform]] = {}
        for node in nodes:
            for out in node.outputs.values():
                producer[out] = node
            for inp in node.inputs:
                consumers.setdefault(inp, []).append(node)
        for pcoll, users in consumers.items():
            if len(users) > 1:
                names = ", ".join(repr(u.full_label) for u in users)
                raise UnsupportedTransformError(
                    f"the output of {producer[pcoll].full_label!r} is consumed by several transforms "
                    f"({names}); a lane runs one chain, branch by writing another LoaderSpec"
                )
        if output not in producer:
            raise SpecError("build(p) must return the PCollection produced by the pipeline's last transform")
        return cls(nodes, producer)


@dataclass(frozen=True)
class _Trace:
    """Phase *trace*: the chain after the mix, the mix, the sources' chains, the used nodes."""

    path: list[AppliedPTransform]
    mix_node: AppliedPTransform | None
    branches: tuple[SourcePlan, ...]
    ordered: list[AppliedPTransform]


def _pair_hint(pcoll: Any) -> bool:
    """Whether a PCollection's element type (Beam infers it for a lambda) is a pair, Beam's KV."""
    hint = getattr(pcoll, "element_type", None)
    return isinstance(hint, typehints.TupleHint.TupleConstraint) and len(hint.tuple_types) == 2


def _keying(node: AppliedPTransform) -> bool:
    """Whether ``node`` keys its elements as Beam users do before a stateful DoFn: Beam's
    ``WithKeys``, or a ``beam.Map``/``ops.Map`` whose function returns ``(constant, value)``."""
    fn = getattr(node.transform, "fn", None)
    inner = getattr(fn, "fn", None)
    if type(fn).__module__.startswith("zephon_flow.") and callable(inner):
        return makes_constant_keyed_pairs(inner)  # ops.Map(lambda t: (0, t))
    if not isinstance(fn, core.CallableWrapperDoFn):
        return False
    wrapper = fn._fn
    code = getattr(wrapper, "__code__", None)
    if (
        code is not None
        and "fn" in code.co_freevars
        and getattr(wrapper, "__module__", "").startswith("apache_beam")
    ):
        wrapper = wrapper.__closure__[code.co_freevars.index("fn")].cell_contents
    if getattr(wrapper, "__module__", "") == "apache_beam.transforms.util" and "WithKeys" in getattr(
        wrapper, "__qualname__", ""
    ):
        return True
    return makes_constant_keyed_pairs(wrapper)


def _check_not_keyed(graph: _Graph, node: AppliedPTransform) -> None:
    """Refuses a keyed input to a stateful DoFn: zephon-flow keys every stateful DoFn by lane.

    Refused: the input of one of zephon-flow's own stateful operators (Pack, Shuffle, ...)
    whose element type is a pair, and the input of any stateful DoFn made by a keying transform
    (``_keying``). A user's stateful DoFn may take pairs it means as values (``(text, source)``
    from a Map that computes both): it receives ``(lane, (text, source))``.
    """
    t = node.transform
    if not isinstance(t, core.ParDo) or not is_stateful(t.fn) or not node.inputs:
        return
    pcoll = node.inputs[0]
    producer = graph.producer.get(pcoll)
    if producer is None:
        return
    own = type(t.fn).__module__.startswith("zephon_flow.")
    if not (own and _pair_hint(pcoll)) and not _keying(producer):
        return
    name = type(t.fn).__name__
    parent = producer.parent
    keyer = (
        parent.full_label
        if parent is not None and parent.full_label and parent.parts == [producer]
        else producer.full_label
    )
    raise _refuse(
        node,
        f"its input from {keyer!r} is (key, value) pairs, as Beam's own runners want a stateful "
        f"DoFn's input; zephon-flow keys every stateful DoFn by lane itself: {name} receives "
        f"(lane, value) and keeps its state per lane. Do not key: remove the keying from "
        f"{keyer!r} and give {name} the values themselves",
    )


def _operator(node: AppliedPTransform) -> Any:
    t = node.transform
    return t.fn if isinstance(t, core.ParDo) else t


__all__ = ["DeterministicRunner", "PipelineResult", "PipelineState", "describe_params"]
