"""Argument checks shared by every public function, so a refusal reads the same anywhere."""
from __future__ import annotations

import math
import numbers
from typing import Any, Iterable, Optional


def check_int(value: Any, name: str, *, low: int = 1, high: Optional[int] = None,
              who: str = "", why: str = "", none_ok: bool = False) -> Optional[int]:
    """Refuse anything but an integer in [low, high] (bools too), naming the argument;
    return it as a Python int. NumPy's integers pass, as torch takes them (`np.int64(2)`
    from a config or an arange), and come back as ints, which JSON and pickle keep as such.

    Example:
        >>> check_int(0, "epochs")
        Traceback (most recent call last):
        ...
        ValueError: epochs must be a positive int, got 0
        >>> check_int(5, "num_it", low=30, why=" (the suggestions need 30 points)")
        Traceback (most recent call last):
        ...
        ValueError: num_it must be an int >= 30 (the suggestions need 30 points), got 5
    """
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low or (
            high is not None and value > high):
        bound = (f"an int in {low}..{high}" if high is not None
                 else "a positive int" if low == 1 else f"an int >= {low}")
        or_none = " or None" if none_ok else ""
        prefix = f"{who}: " if who else ""
        raise ValueError(f"{prefix}{name} must be {bound}{or_none}{why}, got {value!r}")
    return int(value)


def check_positive(value: Any, name: str, *, who: str = "", why: str = "",
                   none_ok: bool = False) -> Optional[float]:
    """Refuse anything but a finite number > 0 (bools too), naming the argument; return
    it as a Python int or float (NumPy's scalars pass, as in check_int).

    Example:
        >>> check_positive(0, "clip", none_ok=True, why=" (0 would zero every gradient)")
        Traceback (most recent call last):
        ...
        ValueError: clip must be a positive number or None (0 would zero every gradient), got 0
    """
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or value <= 0:
        or_none = " or None" if none_ok else ""
        prefix = f"{who}: " if who else ""
        raise ValueError(f"{prefix}{name} must be a positive number{or_none}{why}, got {value!r}")
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def check_optimizer_device(params: Iterable[Any], device: Any, who: str = "", *,
                           gradless_only: bool = False) -> None:
    """Refuse an optimizer (its parameters) that is not on `device`, the device its
    model trains on: on XLA `model.to(device)` makes new Parameter objects, so an
    optimizer made before the move holds the old CPU ones and would train nothing (on
    CUDA the move keeps them, which is why CUDA scripts get away with that order).

    `gradless_only` (after a backward): only parameters without a gradient count, so a
    model trained on the CPU on purpose, whose parameters have gradients there, passes.

    Example:
        >>> import torch
        >>> check_optimizer_device([torch.zeros(1)], torch.device("xla", 0), "optimizer_step")
        Traceback (most recent call last):
        ...
        ValueError: optimizer_step: the optimizer holds parameters on cpu but the model trains on xla:0, so stepping it would train nothing (on XLA, model.to(device) makes new parameters and an optimizer made before the move keeps the old ones): create the optimizer after model.to(device)
    """
    stray = next((p for p in params if p.device.type != device.type
                  and not (gradless_only and p.grad is not None)), None)
    if stray is not None:
        prefix = f"{who}: " if who else ""
        raise ValueError(
            f"{prefix}the optimizer holds parameters on {stray.device} but the model trains on "
            f"{device}, so stepping it would train nothing (on XLA, model.to(device) makes new "
            f"parameters and an optimizer made before the move keeps the old ones): create the "
            f"optimizer after model.to(device)")


def check_parameters(params: Any, who: str) -> list:
    """`params` as a list of tensors, or one sentence saying what was passed instead and
    what to pass: the same check on one replica, several, and under SPMD, before any
    collective (a module or a used-up generator passed at one replica did nothing, and at
    two failed inside the collective).

    Example:
        >>> import torch
        >>> check_parameters(torch.nn.Linear(2, 2), "average_gradients(params)")
        Traceback (most recent call last):
        ...
        TypeError: average_gradients(params): pass model.parameters(), got an nn.Module (Linear)
    """
    import torch
    fix = "pass model.parameters()"
    if isinstance(params, torch.nn.Module):
        raise TypeError(f"{who}: {fix}, got an nn.Module ({type(params).__name__})")
    if isinstance(params, torch.Tensor):
        raise TypeError(f"{who}: {fix} or a list of parameters ([w]), got a single tensor")
    if isinstance(params, (dict, str, bytes)) or not isinstance(params, Iterable):
        why = " (a state_dict's tensors take no gradients)" if isinstance(params, dict) else ""
        raise TypeError(f"{who}: {fix} or a list of parameters{why}, got {type(params).__name__}")
    params = list(params)
    if not params:
        raise ValueError(f"{who}: got no parameters (a generator such as model.parameters() is "
                         f"used up by its first pass, e.g. by the optimizer): call "
                         f"model.parameters() again for each call")
    for i, p in enumerate(params):
        if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
            raise TypeError(f"{who}: {fix}, got (name, parameter) pairs (named_parameters())")
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{who}: {fix} or a list of tensors, got a {type(p).__name__} at "
                            f"position {i}")
        if not (isinstance(p, torch.nn.Parameter) or p.requires_grad or p.grad is not None):
            raise TypeError(f"{who}: {fix}: the tensor at position {i} takes no gradient (a "
                            f"plain tensor, not a parameter, with requires_grad=False)")
    return params
