"""Engine "torch": no XLA; train_fn runs in the calling process on cuda, else cpu."""
from __future__ import annotations

from .base import Engine, cores_error


class Local(Engine):
    """One device in the caller's process: what a CUDA script did before the swaps."""

    name = "torch"
    about = "one device, in this process"

    @classmethod
    def automatic(cls, info, cores) -> bool:
        return not info.has_xla

    @classmethod
    def supports(cls, info, cores):
        if info.has_tpu and not info.has_xla and not info.torch_reports_tpu:
            return (f"this host has a TPU ({info.accelerator}) and torch-tpu {info.torchtpu}, but torch "
                    f"reports no tpu accelerator, so training would run on the CPU: check the "
                    f"torch-tpu install (python -m tpu_utility doctor), or force engine='torchtpu'")
        if info.cuda_devices >= 2 and cores not in (1, info.cuda_devices) and not info.has_xla:
            return cores_error(info, cores)
        return None

    def __init__(self):
        import torch
        self._device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def device(self):
        return self._device
