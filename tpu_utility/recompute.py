"""Gradient checkpointing on XLA: torch's own `torch.utils.checkpoint`, made to work there.

`model.gradient_checkpointing_enable()` (Hugging Face) and `torch.utils.checkpoint.checkpoint`
stop on XLA with `module 'torch' has no attribute 'xla'`: torch saves and restores the random
state of the inputs' device through a module `torch.<device type>`, and torch_xla registers
none. Made to run, they would still save nothing: XLA compiles forward and backward as one
program, merges the recomputation with the forward it repeats (common subexpressions) or
schedules it early, and every activation stays alive.

`install()` (the XLA engines call it as they start) gives torch what it asks for:
- `torch.xla`, a device module whose random state is torch_xla's per-device seed, so a
  recomputed dropout draws the mask the forward drew: results equal those without
  checkpointing (tests/test_recompute.py);
- before each recomputation, its floating-point inputs tied to the gradient arriving at the
  checkpointed block (plus zero, computed from that gradient: exact, and not foldable), under
  an optimization barrier, as `torch_xla.utils.checkpoint` puts one. The recomputation then
  depends on the backward having reached the block: XLA can neither merge it with the forward
  nor run it early, and the compiled program's peak falls (docs/measured.md). The barrier
  alone does not do it on XLA:CPU, whose compiler drops barriers before scheduling.
  With `use_reentrant=True` (transformers 4.x's default) torch hands the block's gradient to
  the recomputation; with `use_reentrant=False` (5.x's) a hook on the block's last operation
  catches it as the backward arrives.

These hook torch's checkpoint at names it looks up when called (`CheckpointFunction`,
`detach_variable`, `_checkpoint_without_reentrant_generator`, `_CheckpointFrame`), so a
`checkpoint` bound before `install()` (transformers binds it when imported) gets them too;
blocks with no XLA tensor run exactly as before.
"""
from __future__ import annotations

import contextlib
import threading
import types
from typing import Any, List, Optional

from .compat import register_device_module

_INSTALLED = False
_INSTALLING = threading.Lock()  # replica threads (one per device) ask for the device at once
_LOCAL = threading.local()  # what a block's recomputation ties to, handed over as torch runs it


def install() -> None:
    """Make torch's gradient checkpointing work on XLA devices (idempotent).

    Example:
        >>> from tpu_utility import recompute
        >>> recompute.install()
        >>> import torch
        >>> torch.xla.device_count()
        1

    Args:
        (none)
    """
    global _INSTALLED
    with _INSTALLING:
        if _INSTALLED:
            return
        import torch
        import torch.utils.checkpoint as tuc
        if not hasattr(torch, "xla"):
            register_device_module("xla", _device_module())
        tuc.CheckpointFunction = _reentrant(tuc.CheckpointFunction)
        tuc.detach_variable = _tied_detach(tuc.detach_variable)
        tuc._checkpoint_without_reentrant_generator = _non_reentrant(
            tuc._checkpoint_without_reentrant_generator)
        tuc._CheckpointFrame = _frame(tuc._CheckpointFrame)
        _INSTALLED = True


def _device_module() -> types.ModuleType:
    """What torch's checkpoint and `torch.random.fork_rng` call on `torch.<device type>`:
    one device per replica (SPMD's devices share one seed)."""
    module = types.ModuleType("torch.xla", "torch_xla's random seed, as torch's checkpoint asks")
    module.device = lambda index=None: contextlib.nullcontext()
    module.device_count = lambda: 1
    module.get_rng_state = get_rng_state
    module.set_rng_state = set_rng_state
    module.is_available = lambda: True
    module._initialized = True  # torch stashes the random state only of a started device
    return module


# torch_xla keeps two seeds per device: the running one, which each random operation
# advances (f below) and which get/set_rng_state read and write, and the step's base, from
# which each graph cut starts the next step (g below). Setting the running seed sets the
# base too (xla_graph_executor.cpp, 2.8 and 2.9), so torch's restore after a recomputation
# would start every later step from another base than the run without checkpointing: other
# dropout masks from the second step on. The engine notes the base at each cut it makes
# (`note_step`); the first set in a step then puts the next step's base back as a step
# closure (run after the cut advanced it), where the running seed shows that base is the
# step's own (reachable from it by the draws made since).
_MASK = 2 ** 64 - 1
_DRAWS = 1 << 16  # draws in one step searched for the base: BERT-large draws ~100


def _f(x: int) -> int:
    return (2531011 + 214013 * x) & _MASK  # the running seed's step (GetRngSeed)


def _g(x: int) -> int:
    return (1012031 + 7012063 * x) & _MASK  # the base's step at a cut (MarkStep)


_SEEDS = {"base": None, "restoring": False}


def note_step() -> None:
    """After a graph cut: the running seed is the new step's base."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    if _INSTALLED:
        _SEEDS["base"], _SEEDS["restoring"] = xm.get_rng_state(torch_xla.device()), False


def get_rng_state(device=None) -> int:
    import torch_xla
    import torch_xla.core.xla_model as xm
    return xm.get_rng_state(torch_xla.device())


def set_rng_state(state, device=None) -> None:
    import torch_xla
    import torch_xla.core.xla_model as xm
    if not _SEEDS["restoring"] and _SEEDS["base"] is not None:
        base = _SEEDS["base"]
        if _reachable(base, get_rng_state()):
            xm.add_step_closure(_restore_base, (base,))
        _SEEDS["restoring"] = True
    xm.set_rng_state(int(state), torch_xla.device())


def _reachable(base: int, running: int) -> bool:
    x = base
    for _ in range(_DRAWS):
        if x == running:
            return True
        x = _f(x)
    return x == running


def _restore_base(base: int) -> None:
    import torch_xla
    import torch_xla.core.xla_model as xm
    xm.set_rng_state(_g(base), torch_xla.device())
    note_step()


def _xla(values) -> List:
    import torch
    return [t for t in values if isinstance(t, torch.Tensor) and t.device.type == "xla"]


def _zero_from(grads) -> Optional[Any]:
    """A float32 zero computed from the first gradient (NaN and inf give zero too)."""
    import torch
    for g in _xla(grads):
        if g.numel():
            return torch.nan_to_num(g.detach().reshape(-1)[0].float() * 0, 0.0, 0.0, 0.0)
    return None


def _tie(inputs: List, grads) -> List:
    """`inputs` with each floating XLA tensor replaced by itself plus a zero from `grads`
    (new tensors, `requires_grad` kept), then one optimization barrier over them all."""
    import torch
    zero = _zero_from(grads) if grads else None
    out = []
    for x in inputs:
        if zero is not None and isinstance(x, torch.Tensor) and x.device.type == "xla" \
                and x.is_floating_point():
            y = (x.detach() + zero.to(x.dtype)).detach()
            y.requires_grad_(x.requires_grad)
            x = y
        out.append(x)
    xla = _xla(out) + _xla(grads or ())
    if xla:
        import torch_xla.core.xla_model as xm
        xm.optimization_barrier_(xla)
    return out


def _reentrant(base):
    class CheckpointFunction(base):
        """torch's reentrant checkpoint; its backward hands the block's gradient to the
        recomputation's inputs (through `detach_variable`, below). A block on XLA with
        parameters to train and no input that takes gradients is refused: reentrant
        checkpointing would give those parameters no gradient, and torch only warns."""

        @classmethod
        def apply(cls, function, preserve_rng_state, *args):
            import torch
            if torch.is_grad_enabled() and _xla(args) and not any(
                    isinstance(a, torch.Tensor) and a.requires_grad for a in args) \
                    and _trains(function):
                raise RuntimeError(
                    "checkpoint(use_reentrant=True): no input of this block requires grad (frozen "
                    "embeddings?), so its parameters would get no gradient: pass "
                    "use_reentrant=False, or for a Hugging Face model call "
                    "model.enable_input_require_grads() after gradient_checkpointing_enable()")
            return super().apply(function, preserve_rng_state, *args)

        @staticmethod
        def backward(ctx, *grads):
            _LOCAL.grads = grads
            try:
                return base.backward(ctx, *grads)
            finally:
                _LOCAL.grads = None

    return CheckpointFunction


def _trains(function) -> bool:
    """Whether `function` (a module, a module's bound method, a partial of either) has a
    parameter that takes gradients; False where it cannot tell."""
    import functools
    import torch
    while isinstance(function, functools.partial):
        function = function.func
    module = function if isinstance(function, torch.nn.Module) else getattr(function, "__self__", None)
    return isinstance(module, torch.nn.Module) and any(p.requires_grad for p in module.parameters())


def _tied_detach(base):
    def detach_variable(inputs):
        grads = getattr(_LOCAL, "grads", None)
        out = base(inputs)
        return tuple(_tie(list(out), grads)) if grads and _xla(out) else out

    return detach_variable


class _Block:
    """One non-reentrant checkpointed block: the gradient that reached its last operation."""

    grads = None


def _non_reentrant(base):
    def generator(fn, preserve_rng_state=True, context_fn=None, *rest, **kwargs):
        import torch.utils.checkpoint as tuc
        context_fn = context_fn or tuc.noop_context_fn
        if not _xla(list(rest) + list(kwargs.values())):
            yield from base(fn, preserve_rng_state, context_fn, *rest, **kwargs)
            return
        block, last = _Block(), _LastResult()

        def contexts():
            forward, recompute = context_fn()
            stack = contextlib.ExitStack()
            stack.enter_context(forward)
            stack.enter_context(last)
            return stack, recompute

        _LOCAL.block = block  # taken by the _CheckpointFrame the base makes
        inner = base(fn, preserve_rng_state, contexts, *rest, **kwargs)
        next(inner)
        yield
        with contextlib.suppress(StopIteration):
            next(inner)
        node = getattr(last.tensor, "grad_fn", None)
        if node is not None:
            def arrived(grad_outputs):
                block.grads = grad_outputs
            node.register_prehook(arrived)
        last.tensor = None

    return generator


def _frame(base):
    class _CheckpointFrame(base):
        """torch's non-reentrant checkpoint frame; its recomputation's inputs tied to the
        gradient that reached the block."""

        def __init__(self, recompute_fn, *args, **kwargs):
            block = getattr(_LOCAL, "block", None)
            _LOCAL.block = None

            def recompute(*inputs):  # the forward's kwargs dict, then its args
                kwargs_in, *args_in = inputs
                if block is None or block.grads is None:
                    return recompute_fn(kwargs_in, *args_in)
                grads, block.grads = block.grads, None
                names = list(kwargs_in)
                tied = _tie(list(args_in) + [kwargs_in[k] for k in names], grads)
                return recompute_fn(dict(zip(names, tied[len(args_in):])), *tied[:len(args_in)])

            super().__init__(recompute, *args, **kwargs)

    return _CheckpointFrame


def _last_result_mode():
    from torch.overrides import TorchFunctionMode

    class LastResult(TorchFunctionMode):
        """Keeps the last tensor that needs a gradient made inside the block's forward: its
        operation is the first of the block that the backward reaches."""

        tensor = None

        def __torch_function__(self, func, types, args=(), kwargs=None):
            import torch
            out = func(*args, **(kwargs or {}))
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            if isinstance(first, torch.Tensor) and first.requires_grad:
                self.tensor = first
            return out

    return LastResult


def _LastResult():
    global _LAST_RESULT
    if _LAST_RESULT is None:
        _LAST_RESULT = _last_result_mode()
    return _LAST_RESULT()


_LAST_RESULT = None


def installed() -> bool:
    """Whether `install()` ran in this process."""
    return _INSTALLED
