"""SGD's, Adam's and AdamW's step on XLA as one computation, traced once and replayed.

torch traces an optimizer's step anew every step: for each parameter tensor SGD's foreach
step makes about five graph nodes and Adam's about ten, and torch_xla builds, shapes and
hashes each one on the host. For `torch.optim.SGD`, `Adam` and `AdamW` this module writes
the same update, the operations of torch's foreach implementation in the same order, and
lowers it once per shape and configuration to an XLA computation (compat.lower_once). Each
step after that is one call of it: its inputs are the parameters, gradients and state, and
one small vector of the numbers that change from step to step (lr, momentum, beta1, the bias
corrections), computed on the host as torch computes them; its outputs are copied back into
the parameters and state. The numbers that stay (weight decay, dampening, beta2, eps) are
written into the computation as torch writes them into its graph.

The step's host CPU falls to a fraction of torch's own (SGD's least: one call has a fixed
cost, and SGD's own update is small; docs/measured.md#the-optimizer-steps-host-cpu). Parameters, gradients and state are
bit-equal to torch's foreach step, and so to its per-parameter one for these three
(tests/test_fused_step.py: torch_xla 2.8 and 2.9, one device and 8 SPMD devices,
functionalization on and off, lr, momentum and beta1 moved every step).

It applies where the result is torch's own foreach step: exactly these three classes (not
subclasses), `foreach` on (the library's default on XLA; an explicit `foreach=False` is
kept), no `maximize`, `capturable`, `differentiable` or `fused`, numbers (not tensors) for
the hyperparameters, float32 dense tensors on one XLA device, the state already made by a
first step of torch's own, and no step hooks. Elsewhere `step` returns False having done
nothing, and the caller runs `opt.step()`. TPU_UTILITY_FUSED_STEP=0 turns it off.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from numbers import Real
from typing import Callable, List, Optional

from .compat import call_lowered, lower_cached

ENV = "TPU_UTILITY_FUSED_STEP"
_NAME = "xla::tpu_utility_step"


@dataclass(frozen=True)
class _Plan:
    """One param group's step: what goes in, what comes out, and where it goes."""

    key: tuple  # the configuration; with the tensors' shapes, the computation's cache key
    fn: Callable  # the update, traced once: (*tensors, numbers) -> the targets' new values
    tensors: list  # parameters, gradients, state
    numbers: Callable  # () -> the step's moving numbers, as torch computes them
    targets: list  # where the outputs are copied, in order
    before: Optional[Callable] = None  # torch's own first move (Adam's step counters)


def step(opt, device) -> bool:
    """Take `opt`'s step as one XLA computation per param group, where that gives torch's
    own foreach step (see the module's docstring); False, with nothing done, elsewhere.

    Args:
        opt: the optimizer, its gradients already averaged over replicas.
        device: the device the step runs on (a torch.device).

    Example:
        >>> import torch
        >>> from tpu_utility import fused_step
        >>> opt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
        >>> fused_step.step(opt, torch.device("cpu"))  # not XLA: torch's own step runs
        False
    """
    if device.type != "xla" or os.environ.get(ENV, "1") == "0":
        return False
    planner = _planner(opt)
    if planner is None or _hooked(opt):
        return False
    plans = []
    for group in opt.param_groups:
        if not _plain(group):
            return False
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        if not _dense_float32(params, device):
            return False
        plan = planner(opt, group, params)
        if plan is None:
            return False
        plans.append(plan)
    import torch
    with torch.no_grad():
        for plan in plans:
            _run(plan, device)
    return True


def _hooked(opt) -> bool:
    """Step hooks would not run on a step that bypasses `opt.step`; an instance's own `step`
    other than an LR scheduler's counting wrapper may do anything."""
    from torch.optim import optimizer as torch_optimizer
    own_step = vars(opt).get("step")
    return bool(getattr(opt, "_optimizer_step_pre_hooks", None)
                or getattr(opt, "_optimizer_step_post_hooks", None)
                or getattr(torch_optimizer, "_global_optimizer_pre_hooks", None)
                or getattr(torch_optimizer, "_global_optimizer_post_hooks", None)
                or (own_step is not None and not getattr(own_step, "_wrapped_by_lr_sched", False)))


def _plain(group) -> bool:
    return (group.get("foreach") is True and not group.get("maximize")
            and not group.get("capturable") and not group.get("differentiable")
            and not group.get("fused") and _number(group.get("lr"))
            and _number(group.get("weight_decay", 0)))


def _number(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def _dense_float32(tensors, device) -> bool:
    import torch
    from .compat import sharded
    for t in tensors:
        g = t.grad
        if (t.dtype is not torch.float32 or g.dtype is not torch.float32 or g.is_sparse
                or t.device != device or g.device != device or sharded(t)):
            return False  # split over devices (tu.fsdp): torch's own step, partitioned by XLA
    return True


def _state_tensors(tensors, params, device) -> bool:
    """State tensors that the computation can take in place of torch's: shaped as their
    parameters, float32, on the device."""
    import torch
    return all(isinstance(s, torch.Tensor) and s.dtype is torch.float32 and s.device == device
               and s.shape == p.shape for s, p in zip(tensors, params))


def _run(plan: _Plan, device) -> None:
    import torch
    # lowered before `before`: a failure there leaves torch's counters as they were
    lowered = lower_cached(_NAME, plan.key, plan.fn,
                           plan.tensors + [torch.zeros(len(plan.numbers()))])
    if plan.before is not None:
        plan.before()
    # the step's numbers as torch's own step rounds them: Python floats to float32
    numbers = torch.tensor(plan.numbers(), dtype=torch.float32).to(device)
    outputs = call_lowered(_NAME, lowered, plan.tensors + [numbers])
    torch._foreach_copy_(plan.targets, list(outputs))


# -- SGD ---------------------------------------------------------------------------------------

def _sgd(opt, group, params) -> Optional[_Plan]:
    momentum, dampening = group["momentum"], group["dampening"]
    nesterov, decay = group["nesterov"], group["weight_decay"]
    if not (_number(momentum) and _number(dampening)):
        return None
    grads = [p.grad for p in params]
    bufs: List = []
    if momentum != 0:
        bufs = [opt.state[p].get("momentum_buffer") if p in opt.state else None for p in params]
        if not _state_tensors(bufs, params, params[0].device):
            return None  # the first step makes them: torch's own
    # torch adds momentum * buf into the gradients themselves when it made no new ones
    grads_out = momentum != 0 and nesterov and decay == 0
    lr = group["lr"]
    numbers = (lambda: [momentum, -lr]) if momentum != 0 else (lambda: [-lr])
    key = ("sgd", momentum != 0, dampening, nesterov, decay, len(params))
    fn = functools.partial(_sgd_update, n=len(params), momentum=momentum != 0,
                           dampening=dampening, nesterov=nesterov, decay=decay)
    targets = params + bufs + (grads if grads_out else [])
    return _Plan(key, fn, params + grads + bufs, numbers, targets)


def _sgd_update(*tensors, n, momentum, dampening, nesterov, decay) -> List:
    """torch's _multi_tensor_sgd, per tensor, with momentum and -lr from the vector."""
    import torch
    params, grads, numbers = tensors[:n], tensors[n:2 * n], tensors[-1]
    bufs = tensors[2 * n:3 * n] if momentum else ()
    if decay != 0:
        grads = [torch.add(g, p, alpha=decay) for g, p in zip(grads, params)]
    new_bufs = []
    if momentum:
        m = numbers[0]
        new_bufs = [torch.add(b * m, g, alpha=1 - dampening) for b, g in zip(bufs, grads)]
        if nesterov:
            grads = [g + b * m for g, b in zip(grads, new_bufs)]
        else:
            grads = new_bufs
    neg_lr = numbers[-1]
    new_params = [p + g * neg_lr for p, g in zip(params, grads)]
    grads_out = list(grads) if momentum and nesterov and decay == 0 else []
    return new_params + new_bufs + grads_out


# -- Adam and AdamW ----------------------------------------------------------------------------

def _adam(opt, group, params) -> Optional[_Plan]:
    import torch
    betas, eps = group["betas"], group["eps"]
    amsgrad, decoupled = group.get("amsgrad", False), group.get("decoupled_weight_decay", False)
    if not (isinstance(betas, tuple) and len(betas) == 2 and all(map(_number, betas))
            and _number(eps)):
        return None
    beta1, beta2 = betas
    state = [opt.state[p] if p in opt.state else {} for p in params]
    names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    moments = [[s.get(name) for s in state] for name in names]
    steps = [s.get("step") for s in state]
    device = params[0].device
    if not all(_state_tensors(m, params, device) for m in moments) or not all(
            isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() == 0
            for t in steps):
        return None  # the first step makes them (and a capturable step keeps them elsewhere)
    lr, decay = group["lr"], group["weight_decay"]

    def advance():  # what torch's step does to its counters first
        torch._foreach_add_(steps, torch.tensor(1.0, device="cpu"), alpha=1.0)

    def numbers():  # torch's own arithmetic on Python floats, after `advance`
        corrections1 = [1 - beta1 ** t.item() for t in steps]
        corrections2 = [1 - beta2 ** t.item() for t in steps]
        step_sizes = [(lr / c) * -1 for c in corrections1]
        roots = [c ** 0.5 for c in corrections2]
        shrink = [1 - lr * decay] if decay != 0 and decoupled else []
        return [1 - beta1] + shrink + step_sizes + roots

    key = ("adam", amsgrad, decoupled, decay, beta2, eps, len(params))
    fn = functools.partial(_adam_update, n=len(params), amsgrad=amsgrad, decoupled=decoupled,
                           decay=decay, beta2=beta2, eps=eps)
    grads = [p.grad for p in params]
    moment_tensors = [t for m in moments for t in m]
    return _Plan(key, fn, params + grads + moment_tensors, numbers, params + moment_tensors,
                 before=advance)


def _adam_update(*tensors, n, amsgrad, decoupled, decay, beta2, eps) -> List:
    """torch's _multi_tensor_adam (not capturable), per tensor, with 1 - beta1, AdamW's
    1 - lr * weight_decay, the step sizes and the bias corrections' roots from the vector."""
    import torch
    params, grads = tensors[:n], tensors[n:2 * n]
    exp_avgs, exp_avg_sqs = tensors[2 * n:3 * n], tensors[3 * n:4 * n]
    max_sqs = tensors[4 * n:5 * n] if amsgrad else ()
    numbers = tensors[-1]
    weight1, at = numbers[0], 1
    if decay != 0:
        if decoupled:
            params = [p * numbers[1] for p in params]
            at = 2
        else:
            grads = [torch.add(g, p, alpha=decay) for g, p in zip(grads, params)]
    step_sizes, roots = numbers[at:at + n], numbers[at + n:at + 2 * n]
    exp_avgs = [torch.lerp(m, g, weight1) for m, g in zip(exp_avgs, grads)]
    exp_avg_sqs = [torch.addcmul(v * beta2, g, g, value=1 - beta2)
                   for v, g in zip(exp_avg_sqs, grads)]
    if amsgrad:
        max_sqs = [torch.maximum(m, v) for m, v in zip(max_sqs, exp_avg_sqs)]
        denominators = [torch.sqrt(m) for m in max_sqs]
    else:
        denominators = [torch.sqrt(v) for v in exp_avg_sqs]
    denominators = [(d / roots[i]) + eps for i, d in enumerate(denominators)]
    params = [p + (m / d) * step_sizes[i]
              for i, (p, m, d) in enumerate(zip(params, exp_avgs, denominators))]
    return params + exp_avgs + exp_avg_sqs + list(max_sqs)


def _planner(opt) -> Optional[Callable]:
    import torch
    # exactly these classes: a subclass may step otherwise
    return {torch.optim.SGD: _sgd, torch.optim.Adam: _adam,
            torch.optim.AdamW: _adam}.get(type(opt))
