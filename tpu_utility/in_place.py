"""An optimizer's in-place updates traced as an out-of-place op and a copy on XLA.

Under torch_xla's functionalization (its default), every in-place op on an XLA tensor is
first run again on meta tensors, to catch the shape errors only the in-place form has.
Adam's `lerp_`, `addcmul_` and `addcdiv_` (and `maximum_` for amsgrad) have Python meta
kernels only, so that rerun is most of an optimizer step's host time, foreach or not
(docs/measured.md). `x.copy_(torch.lerp(x, y, w))` is what functionalization makes of
`x.lerp_(y, w)` anyway: the graph holds the same operations, and the rerun is skipped.
Its tensors are made in another order, so the compiled program's outputs come in another
order; XLA may round such a program differently. Measured on XLA:CPU: bit-equal to
torch's own foreach step for Adam, AdamW, NAdam, Adagrad, RMSprop and SGD on torch_xla 2.8
and 2.9, and for AdamW with amsgrad on 2.9; on 2.8 that one differed by 6e-8
(tests/test_foreach.py). (NAdam's and Adagrad's foreach steps round differently from
their per-parameter ones in torch itself.)
The checks stay: `copy_` refuses a result whose shape is not `x`'s (a broadcast
the in-place op would refuse), and where the result's dtype is not `x`'s the in-place op
itself runs, so torch's casting rules and errors are its own.

SGD, Adam and AdamW take fused_step.py's path instead from their second step; this one
serves their first step, which makes the state, and every other optimizer.
It applies to the ops of `_OPS` (foreach and Tensor-method forms) on functional
tensors with autograd off, as inside `optimizer.step()`: with
autograd on, an in-place op and its copy record different graphs, so those are left as
they are. The step's host CPU falls to about a third of torch's own for Adam's kind, less
for SGD with momentum, whose updates by a number stay in place
(docs/measured.md#the-optimizer-steps-host-cpu). (With `clip_grad_norm_`'s per-gradient `mul_` it cost more than it saved, so
clipping is left alone.)
"""
from __future__ import annotations

import contextlib
import functools
from typing import ContextManager

from .compat import functional_tensor_check, functionalization_on

# Pointwise ops torch's optimizers update their state with, in place. The arithmetic
# four by a Python number trace faster in place (C++ meta kernels, no operand to upload),
# so those stay in place; by a tensor, and the rest, run as a copy (measured per op).
_ARITHMETIC = ("add", "sub", "mul", "div")
_OPS = _ARITHMETIC + ("lerp", "addcmul", "addcdiv", "sqrt", "rsqrt", "maximum", "minimum",
                      "neg", "exp", "pow", "clamp", "clamp_min", "clamp_max", "abs", "sign",
                      "reciprocal")


@functools.lru_cache(maxsize=None)
def _twins() -> dict:
    """{in-place function: (foreach?, its out-of-place twin, in place by a number?)}."""
    import torch
    twins = {}
    for name in _OPS:
        for space, prefix, foreach in ((torch, "_foreach_", True), (torch.Tensor, "", False)):
            inplace = getattr(space, f"{prefix}{name}_", None)
            outplace = getattr(space, f"{prefix}{name}", None)
            if inplace is not None and outplace is not None:
                twins[inplace] = (foreach, outplace, name in _ARITHMETIC)
    return twins


@functools.lru_cache(maxsize=None)
def _mode():
    import torch
    from torch.overrides import TorchFunctionMode
    twins, functional, copy_all = _twins(), functional_tensor_check(), torch._foreach_copy_

    class OutOfPlace(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            twin = twins.get(func)
            if twin is None or torch.is_grad_enabled() or not args:
                return func(*args, **kwargs)
            foreach, outplace, by_number_in_place = twin
            target = args[0]
            if by_number_in_place and len(args) > 1 and isinstance(args[1], (int, float)):
                return func(*args, **kwargs)
            if foreach:
                if not target or not all(functional(t) for t in target):
                    return func(*args, **kwargs)
                results = outplace(*args, **kwargs)
                if any(r.dtype != t.dtype for r, t in zip(results, target)):
                    return func(*args, **kwargs)
                copy_all(target, results)
                return None
            if not functional(target):
                return func(*args, **kwargs)
            result = outplace(*args, **kwargs)
            if result.dtype != target.dtype:
                return func(*args, **kwargs)
            return target.copy_(result)

    return OutOfPlace()


def as_copies(device) -> ContextManager:
    """A context in which the in-place updates of `_OPS`, with autograd off, run as an
    out-of-place op and a `copy_` where that saves host time: on an XLA `device` whose
    tensors are functionalized. Elsewhere it does nothing.

    Args:
        device: the device the step runs on (a torch.device).

    Example:
        >>> import torch
        >>> from tpu_utility.in_place import as_copies
        >>> x = torch.zeros(3)
        >>> with as_copies(x.device), torch.no_grad():
        ...     _ = x.add_(1)
        >>> x.tolist()
        [1.0, 1.0, 1.0]
    """
    if device.type == "xla" and functionalization_on():
        return _mode()
    return contextlib.nullcontext()
