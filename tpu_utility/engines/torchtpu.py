"""Engine "torchtpu" (experimental): Google's TorchTPU runtime, one process per chip.

TorchTPU (the `torch-tpu` package) is a native PyTorch backend for TPU v4, v5e, v5p, v6e
and v7: device "tpu", eager like CUDA, a plain DataLoader, a plain `optimizer.step()`,
`torch.autocast("tpu")`. It is to replace torch_xla, whose last release is 2.9. Neither
Kaggle nor Colab ships it, and this engine has not run on TPU hardware: it is the
"distributed" engine with TorchTPU's device, its launch environment and its `tpu_dist`
collectives, started with spawn as TorchTPU requires. `run` picks it only where torch_xla
is absent, Google's torch-tpu is installed and torch reports a "tpu" accelerator;
`engine="torchtpu"` forces it. Nothing here allocates on "tpu" before a replica runs:
on a host without a TPU, a tpu tensor aborts the process.
"""
from __future__ import annotations

import contextlib

from .base import cores_error
from .distributed import Distributed


class TorchTpu(Distributed):
    name = "torchtpu"
    about = "one process per chip on TorchTPU"
    start_methods = ("spawn",)

    @classmethod
    def automatic(cls, info, cores) -> bool:
        return not info.has_xla and info.torchtpu is not None and info.torch_reports_tpu

    @classmethod
    def supports(cls, info, cores):
        if info.has_xla:
            return (f"engine='torchtpu' runs where torch_xla is not installed, and torch_xla "
                    f"{info.torch_xla_version} is: use engine=None, or uninstall torch_xla")
        if info.torchtpu is None:
            return ("engine='torchtpu' needs Google's torch-tpu package, which is not installed "
                    "(a package of the same name from another vendor does not count)")
        if cores not in (1, info.num_devices):
            return cores_error(info, cores)
        return None

    @classmethod
    def _backend(cls, info) -> str:
        return "tpu_dist"

    @classmethod
    @contextlib.contextmanager
    def prepare(cls, info, cores, start_method, timeout):
        if start_method != "spawn":
            raise ValueError(
                "engine='torchtpu' starts its replicas with spawn only: leave start_method unset "
                "(or pass 'spawn'), and define train_fn in a .py module that the replicas can import")
        import torch
        torch.tpu.distributed.set_tpu_launch_env()  # TorchTPU's per-chip environment, before spawning
        with super().prepare(info, cores, start_method, timeout) as setup:
            yield setup

    @staticmethod
    def _device_for(backend: str, local_rank: int):
        import torch
        return torch.device("tpu")  # this process's chip, as set_tpu_launch_env arranged
