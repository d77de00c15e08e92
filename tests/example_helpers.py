"""Loading the scripts in examples/ as modules (they are not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(stem: str) -> ModuleType:
    """``examples/<stem>.py`` as the module ``stem``, registered in ``sys.modules`` (functions
    of its pipeline are pickled by reference)."""
    spec = importlib.util.spec_from_file_location(stem, EXAMPLES / f"{stem}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[stem] = module
    spec.loader.exec_module(module)
    return module
