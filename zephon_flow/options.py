"""The entry points' option groups (public module): see ``zephon_flow.engine.options``."""

from zephon_flow.engine.options import *  # noqa: F403
from zephon_flow.engine.options import __all__ as __all__
