"""The gRPC batch service: ``zephon serve`` (server.py) and ``zf.Client`` (client.py)."""

from zephon_flow.service.client import Client
from zephon_flow.service.server import BatchServer, checkpoint_path

__all__ = ["BatchServer", "Client", "checkpoint_path"]
