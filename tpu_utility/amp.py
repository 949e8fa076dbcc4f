"""Mixed precision as a swap: `tu.autocast()` and `tu.GradScaler()` for torch.cuda.amp's.

The standard Kaggle AMP loop has no `opt.step()` to swap: `scaler.step(opt)` calls it.
These two keep that loop's shape on every device:

| device | `autocast()` | `GradScaler()` |
| --- | --- | --- |
| XLA (TPU) | bf16 | no scaling (bf16 has fp32's range), no host read; `step` is `optimizer_step` |
| CUDA | fp16 | torch's real scaler; `step` first averages gradients over replicas |
| CPU | off, as torch.cuda.amp is without a GPU | as on XLA |
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, ContextManager, Dict, Optional

from .replica import current


def autocast(enabled: bool = True) -> "Autocast":
    """The swap for `torch.cuda.amp.autocast()` (or `torch.autocast("cuda")`), as a
    context manager or as a decorator.

    bf16 on XLA and TorchTPU (TPUs have no fast fp16), fp16 on CUDA, and nothing on a
    CPU, where the CUDA script's autocast did nothing either. The device is looked up
    each time the block is entered, not when `autocast()` is called: `@tu.autocast()` on
    a model's `forward` runs at import, outside `run`, where asking for the device would
    start the XLA runtime in the caller (and a later `run(cores=8)` would refuse).

    Args:
        enabled: False runs the block at full precision, as torch's `enabled=False`.

    Example:
        >>> import torch, tpu_utility as tu
        >>> with tu.autocast():
        ...     y = torch.nn.Linear(4, 4).to(tu.get_device())(torch.ones(2, 4, device=tu.get_device()))
        >>> @tu.autocast()  # at import: no device asked for yet
        ... def forward(model, x):
        ...     return model(x)
    """
    return Autocast(enabled)


class Autocast(contextlib.ContextDecorator):
    """What `autocast()` returns: the precision of the calling replica's device, chosen
    on entry.

    Example (CPU tensors are not cast, on any device):
        >>> import torch, tpu_utility as tu
        >>> with tu.autocast():
        ...     y = torch.ones(2, 2) @ torch.ones(2, 2)
        >>> isinstance(tu.autocast(), tu.Autocast), y.dtype
        (True, torch.float32)
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._entered: list = []  # a stack: one instance may be entered again inside itself

    def __enter__(self) -> None:
        device = current().engine.device()
        if not self.enabled or device.type == "cpu":
            context: ContextManager = contextlib.nullcontext()
        else:
            context = autocast_context("fp16" if device.type == "cuda" else "bf16", device)
        context.__enter__()
        self._entered.append(context)

    def __exit__(self, *exc) -> Optional[bool]:
        return self._entered.pop().__exit__(*exc)

    def _recreate_cm(self) -> "Autocast":
        # as a decorator, a fresh one per call: replica threads may call it at once
        return Autocast(self.enabled)


def autocast_context(precision: str, device) -> ContextManager:
    """The precision policy of the loops' `precision=` argument on `device`."""
    import torch
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "fp16":
        if device.type in ("xla", "tpu"):
            raise ValueError("precision='fp16' is not supported on TPUs (they have no fast "
                             "fp16, and there is no loss scaling here): use precision='bf16'")
        return torch.autocast(device.type, dtype=torch.float16)
    raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16', got {precision!r}")


def GradScaler(**kwargs: Any):  # noqa: N802 (named like the class it replaces)
    """The swap for `torch.cuda.amp.GradScaler()`: keep `scaler.scale(loss).backward()`,
    `scaler.step(opt)` and `scaler.update()` as they are.

    On CUDA it is torch's scaler (fp16 needs loss scaling), whose `step` and `unscale_`
    first average the gradients over replicas. Elsewhere (XLA: bf16 needs no scaling) it
    scales nothing, never reads the device, and its `step(opt)` is `tu.optimizer_step(opt)`.

    Example:
        >>> import torch, tpu_utility as tu
        >>> w = torch.nn.Parameter(torch.ones(2, device=tu.get_device()))
        >>> opt = torch.optim.SGD([w], lr=0.1)
        >>> scaler = tu.GradScaler()
        >>> scaler.scale(w.sum()).backward(); _ = scaler.step(opt); scaler.update()
    """
    if current().engine.device().type == "cuda":
        return _cuda_scaler_class()(**kwargs)
    return NoScaler()


class NoScaler:
    """GradScaler's interface with a scale of 1: for bf16 (XLA) and CPU runs."""

    def scale(self, outputs):
        return outputs

    def unscale_(self, optimizer) -> None:
        pass

    def step(self, optimizer, *args: Any, **kwargs: Any):
        # as torch's: the arguments go to optimizer.step (a closure, for LBFGS)
        from . import step
        return step.of().optimizer_step(optimizer, *args, **kwargs)

    def update(self, new_scale: Optional[float] = None) -> None:
        pass

    def get_scale(self) -> float:
        return 1.0

    def is_enabled(self) -> bool:
        return False

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        pass


@functools.lru_cache(maxsize=None)
def _cuda_scaler_class():
    """torch's GradScaler, averaging gradients over replicas before it unscales them (so
    every replica finds the same infs and skips the same steps). Built on first use:
    importing tpu_utility imports no torch."""
    import torch

    class ReplicaGradScaler(torch.amp.GradScaler):
        def __init__(self, **kwargs):
            super().__init__("cuda", **kwargs)
            self._averaged = set()  # optimizers whose gradients are averaged this step

        def unscale_(self, optimizer):
            self._average(optimizer)
            return super().unscale_(optimizer)

        def step(self, optimizer, *args, **kwargs):
            self._average(optimizer)
            try:
                return super().step(optimizer, *args, **kwargs)
            finally:
                self._averaged.discard(id(optimizer))

        def _average(self, optimizer):
            if id(optimizer) not in self._averaged:
                from . import step
                step.of().sync_gradients(optimizer)
                self._averaged.add(id(optimizer))

    return ReplicaGradScaler
