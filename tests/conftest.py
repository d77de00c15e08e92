"""Session fixtures: a tiny corpus with its tokenizer, and the demo corpus, each built once;
the on-disk caches (seek indexes, tokenizer verdicts) in a folder of the session's own; and how
the suite is shared between pytest-xdist's workers (``scripts/check.sh``)."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator

import pytest
from helpers import Corpus, make_corpus
from hypothesis import settings

from zephon_flow.demo_data import DemoData, build_demo_data

# Property tests draw the same examples on every run by default ("repeatable"), so a red suite
# means the change broke something, never that a random draw found an old bug on CI's turn.
# ``scripts/fuzz.sh`` runs them with fresh random draws ("explore") to look for new cases;
# what it finds is pinned with ``@example`` beside the test.
settings.register_profile("repeatable", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("ZEPHON_HYPOTHESIS", "repeatable"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The order in which xdist's workers are handed the modules (``scripts/check.sh``: ``-n 2
    --dist loadfile --no-loadscope-reorder``; a module is one unit of work, run whole by one
    worker, so that its fixtures of module scope, a local Ray or reference digests, are built
    once and its tests run in their order, as in a run without workers): the modules that hold
    a test marked slow first, then the larger ones, so that the run ends on short modules. Each
    module's tests keep their order; a run without workers keeps the order of the files."""
    if not hasattr(config, "workerinput"):  # not an xdist worker
        return
    module_of = {id(item): item.nodeid.split("::")[0] for item in items}
    size = Counter(module_of.values())
    slow = {module_of[id(item)] for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: (module_of[id(item)] not in slow, -size[module_of[id(item)]]))


@pytest.fixture(scope="session", autouse=True)
def own_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``ZEPHON_CACHE_DIR`` for the session (tests that study the cache set their own), so
    tests neither read nor fill the user's ``~/.cache/zephon-flow``."""
    before = os.environ.get("ZEPHON_CACHE_DIR")
    os.environ["ZEPHON_CACHE_DIR"] = str(tmp_path_factory.mktemp("zephon-cache"))
    yield
    if before is None:
        del os.environ["ZEPHON_CACHE_DIR"]
    else:
        os.environ["ZEPHON_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    """60 JSONL documents, 40 Parquet rows (row groups of 8) and a 300-token BPE tokenizer."""
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoData:
    """The real demo corpus (stdlib prose and code), small variant: about 6 s to build."""
    return build_demo_data(str(tmp_path_factory.mktemp("demo")), max_code_files=40, vocab_size=512)
