"""`tu.bf16_weights(model, optimizer)`: the model's weights in bfloat16, the optimizer
stepping float32 master copies of them.

A bfloat16 weight keeps 8 bits of mantissa: an update smaller than 1/256 of the weight
rounds away, so AdamW stepping bfloat16 weights itself (its moments bfloat16 too, made
like the weights) stops learning at small learning rates, silently. Here the optimizer
steps float32 copies instead; each step the model's bfloat16 gradients become the copies'
(float32, then averaged), and the copies, rounded, become the weights. The forward and
backward run in bfloat16 on the device with no casts (weights gathered by `tu.fsdp` are
half the bytes); the copies and the optimizer's state stay float32.

Per parameter that is 2 bytes of weight, 2 of gradient (between backward and step), and 4
of master copy plus the optimizer's own (AdamW: 8): as many bytes as float32 training
keeps, laid out otherwise; what falls is the activations and the compiled step's peak
(docs/measured.md). The copies are the optimizer's parameters, so `tu.fsdp` splits them
as it splits the weights, and its `state_dict()` carries them (under "fp32_masters"):
`checkpoint=`, `save_best=` and `tu.save(optimizer.state_dict())` resume exactly.
The optimizer step (step.py) moves the gradients and the values at each `optimizer_step`.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, List, Tuple

if TYPE_CHECKING:
    import torch

KEY = "fp32_masters"


def bf16_weights(model: "torch.nn.Module", optimizer: "torch.optim.Optimizer") -> "torch.nn.Module":
    """Keep `model` in bfloat16 and have `optimizer` step float32 master copies of its
    weights; returns `model`.

    Call it once, after the optimizer is made (and after `tu.fsdp(model)`, if used). The
    model's floating parameters and buffers become bfloat16 (`model.to(torch.bfloat16)`),
    and floating tensors given to its forward are cast to bfloat16 on the way in. Step with
    `tu.optimizer_step(optimizer)` (or train_one_cycle): it moves the gradients to the
    copies, steps them and writes them back rounded. Updates far below a weight's bfloat16
    resolution add up in the copies, as in float32 training (tests/test_bf16_weights.py).

    Example:
        >>> import torch, tpu_utility as tu
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> _ = tu.bf16_weights(model, opt)
        >>> model.weight.dtype, opt.param_groups[0]["params"][0].dtype
        (torch.bfloat16, torch.float32)

    Args:
        model: the torch module to train, on this run's device.
        optimizer: its optimizer, made over `model.parameters()` (or groups of them).
    """
    import torch
    from .checks import check_optimizer_device
    from . import step
    from .replica import current
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"bf16_weights(model, optimizer): pass the torch module first, got "
                        f"{type(model).__name__}")
    if not hasattr(optimizer, "param_groups") or not callable(getattr(optimizer, "step", None)):
        raise TypeError(f"bf16_weights(model, optimizer): pass the torch optimizer second, got "
                        f"{type(optimizer).__name__}")
    complex_ = next(((n, t) for n, t in list(model.named_parameters()) + list(model.named_buffers())
                     if t.is_complex()), None)
    if complex_ is not None:  # model.to(bfloat16) would keep only its real part, silently
        raise TypeError(f"bf16_weights(model, optimizer): {complex_[0]!r} is {str(complex_[1].dtype)[6:]}, "
                        f"and bfloat16 has no complex type (the cast would drop its imaginary "
                        f"part): keep it as two real tensors (real and imaginary), or train this "
                        f"model in float32")
    first = next(iter(model.parameters()), None)
    if first is not None:  # an optimizer made before model.to(device) holds the old parameters
        check_optimizer_device((p for g in optimizer.param_groups for p in g["params"]),
                               first.device, "bf16_weights(model, optimizer)")
    replica = current()
    if step.of(replica).masters_of(optimizer):
        raise RuntimeError("bf16_weights(model, optimizer): this optimizer already steps float32 "
                           "copies; call it once per optimizer")
    pairs = copies_for(optimizer, {id(p) for p in model.parameters()})
    if not pairs:
        raise ValueError("bf16_weights(model, optimizer): the optimizer holds none of the model's "
                         "floating parameters: make it over model.parameters()")
    model.to(torch.bfloat16)  # in place: the optimizer's old parameters are these objects
    step.of(replica).keep_masters(optimizer, pairs)
    # A group added later (optimizer.add_param_group) gets copies of its bfloat16 weights
    # at once, before a state is loaded into it; without them its updates round away.
    optimizer.add_param_group = functools.partial(_add_group, optimizer.add_param_group,
                                                  optimizer, pairs)
    optimizer.register_state_dict_post_hook(functools.partial(_save, pairs))
    optimizer.register_load_state_dict_pre_hook(functools.partial(_load, pairs))
    model.register_forward_pre_hook(_inputs_to_bf16, with_kwargs=True)
    return model


def copies_for(optimizer, weights) -> List[Tuple["torch.Tensor", "torch.Tensor"]]:
    """Float32 copies of the optimizer's floating parameters whose ids are in `weights`, put
    in their place in its groups (a step's state follows its copy): (copy, weight) pairs."""
    import torch
    pairs: List[Tuple["torch.Tensor", "torch.Tensor"]] = []
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            if id(p) not in weights or not p.is_floating_point():
                continue
            master = torch.nn.Parameter(p.detach().to(torch.float32, copy=True),
                                        requires_grad=p.requires_grad)
            group["params"][i] = master
            if p in optimizer.state:  # a step taken before: its state follows the copy
                optimizer.state[master] = optimizer.state.pop(p)
            pairs.append((master, p))
    return pairs


def _add_group(add, optimizer, pairs, group) -> None:
    """`optimizer.add_param_group(group)`, its bfloat16 weights then stepped as copies."""
    import torch
    from . import step
    from .replica import current
    before = {id(p) for g in optimizer.param_groups for p in g["params"]}
    add(group)
    new = {id(p) for p in optimizer.param_groups[-1]["params"]
           if id(p) not in before and p.dtype == torch.bfloat16}
    added = copies_for(optimizer, new)
    pairs.extend(added)
    step.of(current()).split_copies(added)


def _save(pairs, optimizer, state_dict):
    """The copies' values beside the optimizer's state (a plain optimizer ignores the key)."""
    state_dict[KEY] = [m.detach() for m, _ in pairs]
    return state_dict


def _load(pairs, optimizer, state_dict):
    """The saved copies put back; a state dict without them (saved before bf16_weights, or
    by a plain optimizer) leaves copies of the weights as they are now."""
    import torch
    saved = state_dict.get(KEY)
    if saved is not None and len(saved) != len(pairs):
        raise ValueError(f"optimizer.load_state_dict: the state dict holds {len(saved)} float32 "
                         f"master copies and this optimizer {len(pairs)}: load the state of "
                         f"the same model and optimizer")
    with torch.no_grad():
        for i, (master, weight) in enumerate(pairs):
            master.copy_(saved[i] if saved is not None else weight)
    return state_dict


def _inputs_to_bf16(module, args, kwargs):
    """Floating tensors given to the forward, in bfloat16 (ids, masks and labels of an
    integer type pass as they are)."""
    import torch

    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.bfloat16:
            return x.to(torch.bfloat16)
        return x
    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}
