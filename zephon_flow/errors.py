"""The exception hierarchy (public module): see ``zephon_flow.core.errors``, where it is drawn."""

from zephon_flow.core.errors import *  # noqa: F403
from zephon_flow.core.errors import __all__ as __all__
