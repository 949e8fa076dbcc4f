"""BatchNorm and LayerNorm under SPMD, written as reductions XLA's partitioner splits.

torch_xla lowers both to the `batch-norm-training` HLO (LayerNorm over a [1, N*S, E]
reshape), for which XLA's SPMD partitioner has no rule: it gathers the whole global batch
onto every device first, and what follows runs on all of it (torch_xla 2.8 and 2.9 alike,
with no switch of its own); written as reductions, a BatchNorm CNN's buffers per device
fall back to about one device's (docs/measured.md#spmd-audit-the-partitioned-programs-at-8-devices-issue-32). Inside the "spmd" child `F.batch_norm` and `F.layer_norm`
are replaced by these for XLA tensors, so `nn.BatchNorm*` and `nn.LayerNorm` use them;
other tensors, and code holding the original functions, are untouched. Statistics are
computed in float32 (BatchNorm's running variance unbiased, as torch's is) and the
output has the dtype torch_xla's own would have. The cost is host time, as ops; so
training BatchNorm in float32 is two lowered computations per layer, forward and
backward (below), bit-equal to the ops, which trace in about a hand-written loop's host
time (docs/measured.md#sgd-adam-and-adamw-as-one-computation-and-batchnorm-at-8-devices-lowered-issue-33-2026-11-26).
TPU_UTILITY_SPMD_NORMS=0 keeps torch_xla's own, to
compare on a TPU, where whether libtpu gathers the same way is not yet measured.

At one device (the single-device engine, and each replica of "launch") BatchNorm alone is
replaced, for what it keeps: torch_xla's own kernel leaves the biased batch variance in
`running_var` where torch keeps the unbiased one (2.7e-5 off CPU torch on a BatchNorm CNN
after 4 SGD steps; 14% of the update of a BatchNorm1d at 8 rows). TPU_UTILITY_SPMD_NORMS=0
keeps torch_xla's own there too. bfloat16 running statistics (a model cast with
`.to(torch.bfloat16)` or tu.bf16_weights) are updated in float32 and rounded, as torch's
CPU kernel does.
"""
from __future__ import annotations

import functools
import os

_LOW = ("torch.bfloat16", "torch.float16")
NORMS_VAR = "TPU_UTILITY_SPMD_NORMS"  # "0": torch_xla's own BatchNorm and LayerNorm


def use_partitioned_norms(layer_norm: bool = True) -> None:
    """In this process, from now on: BatchNorm (and LayerNorm, unless `layer_norm=False`) of
    XLA tensors as reductions; nothing where NORMS_VAR is "0"."""
    import torch.nn.functional as F
    if getattr(F.batch_norm, "_tpu_utility", False) or os.environ.get(NORMS_VAR, "1") == "0":
        return
    native_bn, native_ln = F.batch_norm, F.layer_norm

    def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,
                   momentum=0.1, eps=1e-5):
        if input.device.type != "xla":
            return native_bn(input, running_mean, running_var, weight, bias, training, momentum, eps)
        return _batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)

    def partitioned_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
        if input.device.type != "xla":
            return native_ln(input, normalized_shape, weight, bias, eps)
        return _layer_norm(input, tuple(normalized_shape), weight, bias, eps)

    batch_norm._tpu_utility = partitioned_layer_norm._tpu_utility = True
    batch_norm.__doc__, partitioned_layer_norm.__doc__ = native_bn.__doc__, native_ln.__doc__
    F.batch_norm = batch_norm
    if layer_norm:
        F.layer_norm = partitioned_layer_norm


def _batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps):
    import torch
    if (training and _lowerable(x, running_mean, running_var, weight, bias)
            and not torch.is_autocast_enabled("xla") and isinstance(momentum, float)):
        out, new_mean, new_var = _training_autograd().apply(
            x, weight, bias, running_mean, running_var, _number(momentum, x.device), eps)
        with torch.no_grad():
            torch._foreach_copy_([running_mean, running_var], [new_mean, new_var])
        return out
    return _batch_norm_ops(x, running_mean, running_var, weight, bias, training, momentum, eps)


def _batch_norm_ops(x, running_mean, running_var, weight, bias, training, momentum, eps):
    # Few ops, most on per-channel vectors: each op costs host time to trace, forward and
    # backward, and a layer is traced every step.
    import torch
    xf = x.float() if str(x.dtype) in _LOW else x
    if training:
        per_channel = x.numel() // x.size(1)
        if per_channel == 1:  # the check F.batch_norm makes
            raise ValueError(f"Expected more than 1 value per channel when training, got "
                             f"input size {x.size()}")
        var, mean = torch.var_mean(xf, dim=[0] + list(range(2, x.dim())), unbiased=False)
        if running_mean is not None:
            with torch.no_grad():  # lerp and copy_: what lerp_ becomes, less host time (in_place.py)
                low = str(running_mean.dtype) in _LOW  # bf16 statistics: updated in float32
                running_mean.copy_(torch.lerp(running_mean.float() if low else running_mean,
                                              mean, momentum))
                running_var.copy_(torch.lerp(running_var.float() if low else running_var,
                                             _unbiased(var, per_channel), momentum))
    else:
        mean, var = running_mean, running_var
    out = _normalized(xf, mean, var, weight, bias, eps)
    # autocast runs batch_norm in float32 on XLA; without it the output keeps x's dtype
    return out if torch.is_autocast_enabled("xla") else out.to(x.dtype)


def _unbiased(var, per_channel):
    return var * (per_channel / (per_channel - 1))


def _normalized(x, mean, var, weight, bias, eps):
    import torch
    shape = [1, -1] + [1] * (x.dim() - 2)
    scale = torch.rsqrt(var + eps)
    if weight is not None:
        scale = scale * weight
    centred = x - mean.reshape(shape)
    return centred * scale.reshape(shape) if bias is None else \
        torch.addcmul(bias.reshape(shape), centred, scale.reshape(shape))


# -- training BatchNorm as two computations -----------------------------------------------------
# The ops above, forward and backward, traced once per shape and lowered to one XLA
# computation each (compat.lower_once), as fused_step.py does for the optimizer: a layer's
# step is then two graph nodes to trace instead of some thirty. The backward computation is
# autograd's own backward of those ops, traced on placeholders, so the results are bit-equal
# to the ops traced one by one (tests/test_spmd.py). float32 only, autocast off, running
# statistics kept, weight and bias both or neither; anything else takes the ops above.

def _lowerable(x, running_mean, running_var, weight, bias) -> bool:
    import torch
    tensors = [x, running_mean, running_var] + ([weight, bias] if weight is not None else [])
    return ((weight is None) == (bias is None) and running_mean is not None
            and running_var is not None and x.numel() > x.size(1) > 0
            and all(t.dtype is torch.float32 for t in tensors))


_numbers: dict = {}  # (value, device): a 0-d device tensor, uploaded once


def _number(value, device):
    import torch
    key = (value, str(device))
    if key not in _numbers:
        if len(_numbers) > 64:  # momentum=None gives a new value every step
            _numbers.clear()
        _numbers[key] = torch.tensor(value, dtype=torch.float32).to(device)
    return _numbers[key]


def _call(kind, fn, inputs, key):
    from ..compat import call_lowered, lower_cached
    name = f"xla::tpu_utility_bn_{kind}"
    return call_lowered(name, lower_cached(name, key, fn, inputs), inputs)


def _forward(x, affine, eps, momentum=None, rest=()):
    import torch
    weight, bias = rest[:2] if affine else (None, None)
    var, mean = torch.var_mean(x, dim=[0] + list(range(2, x.dim())), unbiased=False)
    out = _normalized(x, mean, var, weight, bias, eps)
    if momentum is None:
        return out
    running_mean, running_var = rest[-2:]
    per_channel = x.numel() // x.size(1)
    return [out, torch.lerp(running_mean, mean, momentum),
            torch.lerp(running_var, _unbiased(var, per_channel), momentum)]


@functools.lru_cache(maxsize=None)
def _training_autograd():
    import torch

    class TrainingBatchNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
            affine = weight is not None
            params = [weight, bias] if affine else []
            inputs = [x] + params + [running_mean, running_var, momentum]
            out, new_mean, new_var = _call(
                "forward", lambda x, *rest: _forward(x, affine, eps, rest[-1], rest[:-1]),
                inputs, (affine, eps))
            ctx.save_for_backward(x, *params)
            ctx.affine, ctx.eps = affine, eps
            ctx.mark_non_differentiable(new_mean, new_var)
            return out, new_mean, new_var

        @staticmethod
        def backward(ctx, grad, _mean, _var):
            saved, affine, eps = list(ctx.saved_tensors), ctx.affine, ctx.eps
            if torch.is_grad_enabled():  # create_graph=True (a gradient penalty): the ops,
                return _differentiable_backward(ctx, saved, grad, affine, eps)  # differentiable

            def backward_of_forward(x, *rest):
                *params, grad = rest
                with torch.enable_grad():
                    leaves = [t.detach().requires_grad_() for t in [x] + params]
                    out = _forward(leaves[0], affine, eps, rest=leaves[1:])
                    return list(torch.autograd.grad(out, leaves, grad))

            grads = _call("backward", backward_of_forward, saved + [grad], (affine, eps))
            if affine:
                return grads[0], grads[1], grads[2], None, None, None, None
            return grads[0], None, None, None, None, None, None

    return TrainingBatchNorm


def _differentiable_backward(ctx, saved, grad, affine, eps):
    """The backward as autograd's own of the ops, with a graph of its own, for a backward
    that is itself differentiated (torch.autograd.grad(..., create_graph=True))."""
    import torch
    wanted = [t for t, need in zip(saved, ctx.needs_input_grad) if need]
    out = _forward(saved[0], affine, eps, rest=saved[1:])
    found = iter(torch.autograd.grad(out, wanted, grad, create_graph=True)) if wanted else iter(())
    grads = [next(found) if need else None for need in ctx.needs_input_grad[:len(saved)]]
    if not affine:
        grads += [None, None]
    return (*grads, None, None, None, None)


def _layer_norm(x, normalized_shape, weight, bias, eps):
    import torch
    xf = x.float() if str(x.dtype) in _LOW else x
    dims = tuple(range(-len(normalized_shape), 0))
    var, mean = torch.var_mean(xf, dim=dims, unbiased=False, keepdim=True)
    out = (xf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        out = out * weight if bias is None else torch.addcmul(bias, out, weight)
    elif bias is not None:
        out = out + bias
    # autocast leaves layer_norm's dtype as it is on XLA: the input's, promoted by the affine
    dtype = x.dtype
    for t in (weight, bias):
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return out.to(dtype)
