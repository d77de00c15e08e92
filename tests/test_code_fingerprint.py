"""The code of user functions and DoFns in the fingerprint: edits refuse, cosmetics do not."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import apache_beam as beam
import pytest
from helpers import chain_spec, write_jsonl

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.batches import batch_digest
from zephon_flow.core.checkpoint.store import encode_state
from zephon_flow.core.code import function_code_digest
from zephon_flow.core.errors import FingerprintMismatchError

MODULE_V1 = '''
import apache_beam as beam
from zephon_flow import operators as ops

class Upper(beam.DoFn):
    """Upper-cases a document."""

    def process(self, text):
        yield text.upper()

def words(text):
    return len(text.split())

lengths = ops.Map(lambda text: len(text))
'''

# Comments, blank lines, a docstring edit and indentation of a continuation: same code.
MODULE_COSMETIC = '''
import apache_beam as beam
from zephon_flow import operators as ops


class Upper(beam.DoFn):
    """Upper-cases a document (reworded docstring)."""

    def process(self, text):
        # a comment
        yield text.upper(
        )

def words(text):

    return len(text.split())   # trailing comment

lengths = ops.Map(lambda text: len(text))
'''

MODULE_EDITED = MODULE_V1.replace("text.upper()", "text.lower()").replace(
    "len(text.split())", "len(text.split()) + 1"
)


def load(tmp_path: Path, source: str, name: str = "user_dofns") -> types.ModuleType:
    """Writes ``source`` as module ``name`` and imports it afresh (as a user's edit would be)."""
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    sys.modules.pop(name, None)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def spec_of(jsonl: str, module: types.ModuleType) -> zf.LoaderSpec:
    return chain_spec(
        jsonl,
        ("upper", module.Upper()),
        ("words", ops.Map(module.words)),
        global_batch_size=2,
    )


@pytest.fixture
def jsonl(tmp_path: Path) -> str:
    return write_jsonl(tmp_path / "docs.jsonl", [f"doc number {i}" for i in range(20)])


def test_code_parts_are_in_the_fingerprint(tmp_path: Path, jsonl: str) -> None:
    fp = spec_of(jsonl, load(tmp_path, MODULE_V1)).fingerprint
    assert "code upper" in fp and "code words" in fp
    assert "code src" not in fp  # zephon-flow's own operators are versioned with the package


def test_comments_blank_lines_and_docstrings_do_not_count(tmp_path: Path, jsonl: str) -> None:
    before = spec_of(jsonl, load(tmp_path, MODULE_V1)).fingerprint
    after = spec_of(jsonl, load(tmp_path, MODULE_COSMETIC)).fingerprint
    assert before == after


def test_an_edited_dofn_refuses_the_old_checkpoint_by_name(tmp_path: Path, jsonl: str) -> None:
    old = spec_of(jsonl, load(tmp_path, MODULE_V1))
    with zf.Loader(old) as loader:
        for step, _ in loader:
            if step == 2:
                state = loader.state_dict()
                break
    new = spec_of(jsonl, load(tmp_path, MODULE_EDITED))
    with pytest.raises(FingerprintMismatchError) as err:
        zf.Loader(new, state=state)
    message = str(err.value)
    assert "operator upper: code changed" in message
    assert "operator words: code changed" in message
    assert "allow_code_change=True" in message
    # The edit changes the stream, which the resume check (verify_resume) refuses on its own.
    with zf.Loader(new, state=state, allow_code_change=True, verify_resume=False) as loader:
        step, _ = next(iter(loader))
    assert step == 3
    resumed = zf.Loader(new, state=state, allow_code_change=True)
    try:
        assert resumed.state_dict()["fingerprint"] == new.fingerprint
    finally:
        resumed.close()


def test_a_changed_parameter_is_not_excused_by_allow_code_change(tmp_path: Path, jsonl: str) -> None:
    module = load(tmp_path, MODULE_V1)
    old = chain_spec(jsonl, ("upper", module.Upper()), ("words", ops.Map(module.words)), global_batch_size=2)
    with zf.Loader(old) as loader:
        next(iter(loader))
        state = loader.state_dict()
    new = chain_spec(
        jsonl, ("upper", module.Upper()), ("words", ops.Map(module.words, batched=False)), global_batch_size=2
    )
    zf.Loader(new, state=state, allow_code_change=True).close()  # same parameters: fine
    other = chain_spec(jsonl, ("upper", module.Upper()), global_batch_size=2)
    with pytest.raises(FingerprintMismatchError, match="graph"):
        zf.Loader(other, state=state, allow_code_change=True)


def test_lambdas_are_identified_by_their_source(tmp_path: Path) -> None:
    module = load(tmp_path, MODULE_V1)
    assert function_code_digest(module.lengths.fn).startswith("source:")
    again = load(tmp_path, "# moved down a line\n" + MODULE_V1, name="user_dofns_moved")
    assert function_code_digest(module.lengths.fn) == function_code_digest(again.lengths.fn)
    edited = load(tmp_path, MODULE_V1.replace("len(text))", "len(text) * 2)"), name="user_dofns_x2")
    assert function_code_digest(module.lengths.fn) != function_code_digest(edited.lengths.fn)


def test_bytecode_does_not_count_where_source_exists(tmp_path: Path) -> None:
    """The digest is of the parsed source, so a Python upgrade (new bytecode) changes nothing."""
    module = load(tmp_path, MODULE_V1)
    before = function_code_digest(module.words)
    module.words.__code__ = module.words.__code__.replace(co_code=module.lengths.fn.__code__.co_code)
    assert function_code_digest(module.words) == before


def test_code_without_source_falls_back_to_bytecode() -> None:
    namespace: dict[str, object] = {}
    exec("def made(x):\n    return x + 1\n", namespace)  # no file: no source
    made = namespace["made"]
    assert isinstance(made, types.FunctionType)
    assert function_code_digest(made).startswith("bytecode:")


def test_beam_map_is_identified_by_source(tmp_path: Path, jsonl: str) -> None:
    module = load(tmp_path, MODULE_V1)

    def build(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "src" >> ops.ReadJsonl(jsonl)
        return docs | "n" >> beam.Map(module.words)

    fp = zf.LoaderSpec(build, lanes=1, global_batch_size=1).fingerprint
    edited = load(tmp_path, MODULE_EDITED)

    def build2(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "src" >> ops.ReadJsonl(jsonl)
        return docs | "n" >> beam.Map(edited.words)

    fp2 = zf.LoaderSpec(build2, lanes=1, global_batch_size=1).fingerprint
    assert fp["code n"] != fp2["code n"]
    assert fp["operator n"] == fp2["operator n"]


PROBE = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("zcode", sys.argv[1])
code = importlib.util.module_from_spec(spec)
spec.loader.exec_module(code)
sys.path.insert(0, sys.argv[2])
import user_dofns as m
print(sys.version_info[:2], "|", code.function_code_digest(m.words), code.function_code_digest(m.lengths.fn.__wrapped__),
      code.class_code_digest(m.Upper), code.global_names(m.words.__code__))
"""


def other_pythons() -> list[str]:
    """Other CPython 3.10+ interpreters on this machine (pyenv's or on PATH); often none."""
    import glob
    import shutil

    found = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[0-9]*/bin/python")))
    found += [p for p in (shutil.which(f"python3.{minor}") for minor in (10, 12, 13, 14)) if p]
    return found


def test_the_same_source_gives_the_same_digests_on_other_python_versions(tmp_path: Path) -> None:
    """``zephon_flow/core/code.py`` needs only the standard library, so other interpreters can run it."""
    source = (
        MODULE_V1.replace("lengths = ops.Map(", "lengths = Wrap(")
        .replace("from zephon_flow import operators as ops\n", "")
        .replace("import apache_beam as beam\n", "")
    )
    source = source.replace("class Upper(beam.DoFn):", "class Upper:")
    source = (
        "class Wrap:\n    def __init__(self, fn):\n        self.fn = fn\n        fn.__wrapped__ = fn\n\n"
        + source
    )
    (tmp_path / "user_dofns.py").write_text(source)
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    code_py = Path(__file__).resolve().parent.parent / "zephon_flow" / "core" / "code.py"
    results = {}
    # This interpreter twice under different hash seeds (always), then every other one found.
    runs = [(sys.executable, "0"), (sys.executable, "12345"), *((p, "0") for p in other_pythons())]
    for python, hash_seed in runs:
        out = subprocess.run(
            [python, str(probe), str(code_py), str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
        )
        if out.returncode == 0:  # (a pyenv shim without that version fails: not an interpreter)
            version, digests = out.stdout.split("|")
            results[f"{version.strip()} (hash seed {hash_seed})"] = digests
    assert sum(1 for label in results if label.endswith("(hash seed 12345)")) == 1, results
    assert len(set(results.values())) == 1, results


def test_a_checkpoint_from_before_code_was_fingerprinted(tmp_path: Path, jsonl: str) -> None:
    """Such a state has no ``code`` parts: refused with that reason, adopted with the flag."""
    module = load(tmp_path, MODULE_V1)
    spec = chain_spec(jsonl, ("upper", module.Upper()), global_batch_size=2)
    with zf.Loader(spec) as loader:
        next(iter(loader))
        state = loader.state_dict()
    state["fingerprint"] = {k: v for k, v in state["fingerprint"].items() if not k.startswith("code ")}
    with pytest.raises(FingerprintMismatchError) as err:
        zf.Loader(spec, state=state)
    assert str(err.value) == (
        "the checkpoint was written for another pipeline; these parts of the fingerprint differ: "
        "operator upper: code changed (the checkpoint has no digest of the code of upper: it was "
        "written before zephon-flow fingerprinted code); if the code change is deliberate (a fix or "
        "a refactor you accept for the rest of the run), pass allow_code_change=True to zf.Loader"
    )
    with zf.Loader(spec, state=state, allow_code_change=True) as loader:
        assert next(iter(loader))[0] == 1


# -- what a DoFn's code reaches: the user's helpers, classes and constants ------------------
HELPER_V1 = """
import apache_beam as beam
import numpy as np
import cut_helpers

LIMIT = 5

def cut(text):
    return text[:LIMIT]

def again(n):  # recursive: the walk must end
    return n if n <= 0 else again(n - 1) + 0

class Cut(beam.DoFn):
    def process(self, text):
        yield np.full(4, len(cut(text)) + again(2) + cut_helpers.OFFSET, dtype=np.int32)
"""

HELPERS_MODULE = "OFFSET = 0\n"


def helper_spec(tmp_path: Path, jsonl: str, source: str, helpers: str = HELPERS_MODULE) -> zf.LoaderSpec:
    load(tmp_path, helpers, name="cut_helpers")
    module = load(tmp_path, source, name="cut_dofns")
    return chain_spec(jsonl, ("cut", module.Cut()), global_batch_size=2)


def checkpoint_at(spec: zf.LoaderSpec, step: int) -> dict[str, object]:
    with zf.Loader(spec) as loader:
        for at, _ in loader:
            if at == step:
                return loader.state_dict()
    raise AssertionError("the stream ended")


def test_a_dofns_helpers_and_constants_are_parts_of_the_fingerprint(tmp_path: Path, jsonl: str) -> None:
    fp = helper_spec(tmp_path, jsonl, HELPER_V1).fingerprint
    assert sorted(p for p in fp if p.startswith("code cut")) == [
        "code cut",
        "code cut :: constant LIMIT in module cut_dofns",
        "code cut :: constant OFFSET in module cut_helpers",
        "code cut :: helper again in module cut_dofns",
        "code cut :: helper cut in module cut_dofns",
    ]  # numpy, Beam and zephon-flow are not the user's code


def test_an_edited_helper_refuses_the_old_checkpoint_naming_the_dofn_and_the_helper(
    tmp_path: Path, jsonl: str
) -> None:
    old = helper_spec(tmp_path, jsonl, HELPER_V1)
    state = checkpoint_at(old, 1)
    with zf.Loader(old, state=state) as loader:
        assert next(iter(loader))[1]["data"].tolist() == [[5, 5, 5, 5], [5, 5, 5, 5]]
    new = helper_spec(tmp_path, jsonl, HELPER_V1.replace("text[:LIMIT]", "text[:LIMIT + 3]"))
    assert new.fingerprint["code cut"] == old.fingerprint["code cut"]  # the class is the same
    with pytest.raises(FingerprintMismatchError) as err:
        zf.Loader(new, state=state)
    assert str(err.value) == (
        "the checkpoint was written for another pipeline; these parts of the fingerprint differ: "
        "operator cut: code changed (helper cut in module cut_dofns); if the code change is "
        "deliberate (a fix or a refactor you accept for the rest of the run), pass "
        "allow_code_change=True to zf.Loader"
    )
    # The edit changes the stream, which the resume check (verify_resume) refuses on its own.
    with zf.Loader(new, state=state, allow_code_change=True, verify_resume=False) as loader:
        step, batch = next(iter(loader))
    assert step == 2 and batch["data"].tolist() == [[8, 8, 8, 8], [8, 8, 8, 8]]


def test_a_changed_constant_or_a_helper_in_another_module_is_named(tmp_path: Path, jsonl: str) -> None:
    old = helper_spec(tmp_path, jsonl, HELPER_V1)
    state = checkpoint_at(old, 0)
    new = helper_spec(tmp_path, jsonl, HELPER_V1.replace("LIMIT = 5", "LIMIT = 8"), "OFFSET = 1\n")
    with pytest.raises(FingerprintMismatchError) as err:
        zf.Loader(new, state=state)
    assert (
        "differ: operator cut: code changed (constant LIMIT in module cut_dofns, "
        "constant OFFSET in module cut_helpers);" in str(err.value)
    )
    edited_class = helper_spec(tmp_path, jsonl, HELPER_V1.replace("+ again(2)", "+ again(3)"))
    with pytest.raises(FingerprintMismatchError, match=r"differ: operator cut: code changed; if"):
        zf.Loader(edited_class, state=state)


HASH_PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
import cut_dofns
from zephon_flow.core.code import reached_code
print(sorted(reached_code(cut_dofns.Cut).items()))
"""


def test_what_a_dofn_reaches_has_the_same_digests_under_any_hash_seed(tmp_path: Path) -> None:
    (tmp_path / "cut_helpers.py").write_text("OFFSET = frozenset({'a', 'b', 'c', 'd'})\n")
    (tmp_path / "cut_dofns.py").write_text(HELPER_V1)
    (tmp_path / "probe.py").write_text(HASH_PROBE)
    outputs = {
        subprocess.run(
            [sys.executable, str(tmp_path / "probe.py"), str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("0", "1", "4242")
    }
    assert len(outputs) == 1 and "constant OFFSET in module cut_helpers" in next(iter(outputs))


def test_a_function_a_dofn_holds_is_part_of_what_it_reaches(tmp_path: Path, jsonl: str) -> None:
    source = HELPER_V1 + (
        "\nclass Apply(beam.DoFn):\n    def __init__(self, fn):\n        self.fn = fn\n\n"
        "    def process(self, text):\n        yield self.fn(text)\n"
    )
    load(tmp_path, HELPERS_MODULE, name="cut_helpers")
    module = load(tmp_path, source, name="cut_dofns")
    fp = chain_spec(jsonl, ("apply", module.Apply(module.cut)), global_batch_size=2).fingerprint
    assert sorted(p for p in fp if p.startswith("code apply")) == [
        "code apply",
        "code apply :: constant LIMIT in module cut_dofns",
        "code apply :: helper cut in module cut_dofns",
    ]


def test_an_attribute_does_not_bring_a_global_of_the_same_name(tmp_path: Path, jsonl: str) -> None:
    source = HELPER_V1.replace("LIMIT = 5\n", "LIMIT = 5\ntext = 'a global named like the attribute'\n")
    source = source.replace(
        "    def process(self, text):\n", "    def process(self, text):\n        self.text = text\n"
    )
    fp = helper_spec(tmp_path, jsonl, source).fingerprint
    assert not any("constant text" in p for p in fp)
    assert "code cut :: constant LIMIT in module cut_dofns" in fp


def test_a_checkpoint_from_before_helpers_were_fingerprinted_is_refused_with_that_reason(
    tmp_path: Path, jsonl: str
) -> None:
    spec = helper_spec(tmp_path, jsonl, HELPER_V1)
    state = checkpoint_at(spec, 0)
    written = state["fingerprint"]
    assert isinstance(written, dict)
    state["fingerprint"] = {k: v for k, v in written.items() if " :: " not in k}
    with pytest.raises(FingerprintMismatchError) as err:
        zf.Loader(spec, state=state)
    assert str(err.value) == (
        "the checkpoint was written for another pipeline; these parts of the fingerprint differ: "
        "operator cut: code changed (constant LIMIT in module cut_dofns, constant OFFSET in module "
        "cut_helpers, helper again in module cut_dofns, helper cut in module cut_dofns) (the "
        "checkpoint has no digests of what the code of cut reaches: it was written before "
        "zephon-flow fingerprinted a DoFn's helpers); if the code change is deliberate (a fix or a "
        "refactor you accept for the rest of the run), pass allow_code_change=True to zf.Loader"
    )
    with zf.Loader(spec, state=state, allow_code_change=True) as loader:
        assert next(iter(loader))[0] == 1


SHIPPED_WORKER = """
import json, pickle, sys
import zephon_flow as zf
from zephon_flow.core.batches import batch_digest
spec = pickle.loads(open(sys.argv[1], "rb").read())
assert "cut_dofns" not in sys.modules  # as in a Ray worker: the module came by value
with zf.Loader(spec, state=open(sys.argv[2], "rb").read()) as loader:
    step, batch = next(iter(loader))
print(json.dumps({"fingerprint": spec.fingerprint, "step": step, "digest": batch_digest(batch)}))
"""


def test_a_spec_shipped_by_value_keeps_the_fingerprint_its_creator_computed(
    tmp_path: Path, jsonl: str
) -> None:
    """Ray (and Beam's pickler) ship a pipeline module that its workers cannot import by value:
    there the DoFn's module is in no ``sys.modules`` and its class has no source file, so a
    fingerprint recomputed in the worker lost the helper parts and changed ``code cut``
    (bytecode stood in), and a lane owner refused the embedded Loader's checkpoint. A spec
    pickled before anyone asked its fingerprint carries its creator's: the worker resumes."""
    import helpers

    cloudpickle = pytest.importorskip("ray").cloudpickle
    spec = helper_spec(tmp_path, jsonl, HELPER_V1)
    shipped = [sys.modules["cut_dofns"], sys.modules["cut_helpers"], helpers]
    for module in shipped:
        cloudpickle.register_pickle_by_value(module)
    try:
        (tmp_path / "spec.pkl").write_bytes(cloudpickle.dumps(spec))  # fingerprint not asked yet
    finally:
        for module in shipped:
            cloudpickle.unregister_pickle_by_value(module)
    (tmp_path / "state.zf").write_bytes(encode_state(zf.LoaderState.from_plain(checkpoint_at(spec, 1))))
    with zf.Loader(spec) as loader:
        expected = {step: batch_digest(batch) for _, (step, batch) in zip(range(3), loader, strict=False)}
    worker = tmp_path / "worker"  # no cut_dofns.py here: the module is not importable
    worker.mkdir()
    env = {**os.environ, "PYTHONPATH": ""}
    out = subprocess.run(
        [sys.executable, "-c", SHIPPED_WORKER, str(tmp_path / "spec.pkl"), str(tmp_path / "state.zf")],
        cwd=worker,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["fingerprint"] == spec.fingerprint
    assert "code cut :: helper cut in module cut_dofns" in got["fingerprint"]
    assert (got["step"], got["digest"]) == (2, expected[2])
