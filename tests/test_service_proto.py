"""The committed stubs are exactly what scripts/gen_proto.py makes from proto/, and they import."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STUBS = ROOT / "zephon_flow" / "service" / "_proto"


def test_generated_stubs_are_current(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = sorted(p.name for p in tmp_path.iterdir())
    committed = sorted(p.name for p in STUBS.iterdir() if p.name != "__init__.py" and p.is_file())
    assert fresh == committed
    stale = [n for n in fresh if (tmp_path / n).read_bytes() != (STUBS / n).read_bytes()]
    assert stale == [], f"regenerate with: python scripts/gen_proto.py ({stale} differ)"


def test_stubs_import_with_the_installed_protobuf_runtime() -> None:
    from zephon_flow.service._proto import batch_service_pb2, batch_service_pb2_grpc

    service = batch_service_pb2.DESCRIPTOR.services_by_name["BatchService"]
    assert [m.name for m in service.methods] == [
        "StreamBatches",
        "Ack",
        "Checkpoint",
        "Status",
        "ChangeMixture",
    ]
    assert service.methods_by_name["StreamBatches"].server_streaming
    assert hasattr(batch_service_pb2_grpc, "BatchServiceStub")
    assert importlib.util.find_spec("grpc_health.v1.health") is not None
