"""The public face: ``__all__`` is sorted, complete and importable, and every name is documented."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

import zephon_flow

PUBLIC_MODULES = ["zephon_flow", "zephon_flow.operators", "zephon_flow.errors", "zephon_flow.options"]


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_all_is_sorted_without_duplicates(module_name: str) -> None:
    names = importlib.import_module(module_name).__all__
    assert list(names) == sorted(set(names))


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_name_in_all_is_importable(module_name: str) -> None:
    module = importlib.import_module(module_name)
    for name in module.__all__:
        exec(f"from {module_name} import {name}", {})
        assert getattr(module, name) is not None


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_name_is_documented(module_name: str) -> None:
    module = importlib.import_module(module_name)
    undocumented = [
        name for name in module.__all__ if not (inspect.getdoc(getattr(module, name)) or "").strip()
    ]
    assert undocumented == []


def test_all_names_every_public_object_of_the_package() -> None:
    # Names defined or re-exported at the top level that do not start with "_" are in __all__,
    # apart from submodules and the version string.
    exported = {
        name
        for name, value in vars(zephon_flow).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    }
    assert exported == set(zephon_flow.__all__)


def test_the_design_names_are_public() -> None:
    # DESIGN.md: "LoaderSpec, Loader, merge_states ... and the operators; keep them".
    assert {"LoaderSpec", "Loader", "merge_states"} <= set(zephon_flow.__all__)
    from zephon_flow import operators

    assert {"ReadJsonl", "ReadParquet", "Mix", "Tokenize", "Pack", "Shuffle"} <= set(operators.__all__)


def test_every_error_class_derives_from_zephon_error() -> None:
    from zephon_flow import errors

    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.ZephonError)


def test_the_api_reference_lists_every_public_name() -> None:
    # docs/api.md names its members for mkdocstrings: a name left out is missing from the site.
    from pathlib import Path

    from zephon_flow import operators

    api = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\s+- (\w+)$", api, re.M))
    assert set(zephon_flow.__all__) - listed == set()
    documented = set(re.findall(r"^::: [\w.]+\.(\w+)$", api, re.M))
    assert set(operators.__all__) - documented == set()
    assert "::: zephon_flow.cluster.OwnedLoader" in api and "::: zephon_flow.errors" in api
