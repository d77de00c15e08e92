"""Test-only launcher: torchtitan 0.3.0's trainer on CPU, under torchrun (or alone).

    torchrun --nproc_per_node 2 tests/titan_launch.py --module titan_config --config zephon_tiny ...

torchtitan has no device option (it picks CUDA when no accelerator is found), imports triton
kernels for expert parallelism whatever the model (torch's CPU wheels have no triton) and,
after its first step, calls ``torch.distributed.set_timeout``, which torch 2.13 lacks. This
shim makes torch report the CPU as the accelerator before torchtitan is imported (and gives
``torch.cpu`` the memory queries torchtitan's monitor makes), stands a stub in for those kernels (used only by expert parallelism), starts a gloo process group
itself (torchtitan then keeps it), and skips the timeout change. Nothing else changes.
"""

from __future__ import annotations

import logging
import os
import sys
import types
from typing import Any, NoReturn

import torch
import torch._utils
import torch.distributed as dist

torch._utils._get_available_device_type = lambda: "cpu"  # read once, when torchtitan is imported
# What torchtitan's memory monitor asks of its device module, which torch.cpu lacks.
_CPU_MODULE: dict[str, Any] = {
    "get_device_name": lambda device=None: "cpu",
    "get_device_properties": lambda device=None: types.SimpleNamespace(total_memory=1 << 34, name="cpu"),
    "reset_peak_memory_stats": lambda device=None: None,
    "empty_cache": lambda: None,
    "memory_stats": lambda device=None: {},
}
for _name, _fn in _CPU_MODULE.items():
    if not hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, _fn)


class _NoKernels(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args: Any, **kwargs: Any) -> NoReturn:
            raise RuntimeError(f"titan_launch: triton kernel {name} is not available on CPU")

        return unavailable


_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
sys.modules.setdefault(_KERNELS, _NoKernels(_KERNELS))


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # titan_config
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)

    import torchtitan.distributed.utils as dist_utils
    from torchtitan import train

    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None
    logging.getLogger("apache_beam").setLevel(logging.WARNING)  # torchtitan logs the root at INFO
    train.main()


if __name__ == "__main__":
    main()
