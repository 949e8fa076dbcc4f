"""BatchNorm and LayerNorm under SPMD, written as reductions XLA's partitioner splits.

torch_xla lowers both to the `batch-norm-training` HLO (LayerNorm over a [1, N*S, E]
reshape), for which XLA's SPMD partitioner has no rule: it gathers the whole global batch
onto every device first, and what follows runs on all of it. Measured at 8 devices
(docs/measured.md, benchmarks/bench_spmd_audit.py): a BatchNorm CNN's buffers per device
were 6.6x one device's, and 0.92x written as reductions; torch_xla 2.8 and 2.9 alike, and
with no switch of its own. Inside the "spmd" child `F.batch_norm` and `F.layer_norm`
are replaced by these for XLA tensors, so `nn.BatchNorm*` and `nn.LayerNorm` use them;
other tensors, and code holding the original functions, are untouched. Statistics are
computed in float32 (BatchNorm's running variance unbiased, as torch's is) and the
output has the dtype torch_xla's own would have. The cost is host time: a BatchNorm
layer traces about 0.5 ms more per step (17 layers at 8 devices: 26.6 ms against 18.8;
XLA:CPU ran the step 6x faster). TPU_UTILITY_SPMD_NORMS=0 keeps torch_xla's own, to
compare on a TPU, where whether libtpu gathers the same way is not yet measured.
"""
from __future__ import annotations

_LOW = ("torch.bfloat16", "torch.float16")


def use_partitioned_norms() -> None:
    """In this process, from now on: BatchNorm and LayerNorm of XLA tensors as reductions."""
    import torch.nn.functional as F
    if getattr(F.batch_norm, "_tpu_utility", False):
        return
    native_bn, native_ln = F.batch_norm, F.layer_norm

    def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,
                   momentum=0.1, eps=1e-5):
        if input.device.type != "xla":
            return native_bn(input, running_mean, running_var, weight, bias, training, momentum, eps)
        return _batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)

    def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
        if input.device.type != "xla":
            return native_ln(input, normalized_shape, weight, bias, eps)
        return _layer_norm(input, tuple(normalized_shape), weight, bias, eps)

    batch_norm._tpu_utility = layer_norm._tpu_utility = True
    batch_norm.__doc__, layer_norm.__doc__ = native_bn.__doc__, native_ln.__doc__
    F.batch_norm, F.layer_norm = batch_norm, layer_norm


def _batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps):
    # Few ops, most on per-channel vectors: each op costs host time to trace, forward and
    # backward, and a layer is traced every step.
    import torch
    shape = [1, -1] + [1] * (x.dim() - 2)
    xf = x.float() if str(x.dtype) in _LOW else x
    if training:
        per_channel = x.numel() // x.size(1)
        if per_channel == 1:  # the check F.batch_norm makes
            raise ValueError(f"Expected more than 1 value per channel when training, got "
                             f"input size {x.size()}")
        var, mean = torch.var_mean(xf, dim=[0] + list(range(2, x.dim())), unbiased=False)
        if running_mean is not None:
            with torch.no_grad():  # lerp and copy_: what lerp_ becomes, less host time (in_place.py)
                running_mean.copy_(torch.lerp(running_mean, mean, momentum))
                running_var.copy_(torch.lerp(running_var, var * (per_channel / (per_channel - 1)),
                                             momentum))
    else:
        mean, var = running_mean, running_var
    scale = torch.rsqrt(var + eps)
    if weight is not None:
        scale = scale * weight
    centred = xf - mean.reshape(shape)
    out = centred * scale.reshape(shape) if bias is None else \
        torch.addcmul(bias.reshape(shape), centred, scale.reshape(shape))
    # autocast runs batch_norm in float32 on XLA; without it the output keeps x's dtype
    return out if torch.is_autocast_enabled("xla") else out.to(x.dtype)


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
