"""train_one_cycle's running loss: one device scalar per replica and optimizer, kept from
call to call.

Without functionalization torch_xla orders a graph's outputs by their tensors' age, so a
fresh sum, younger than the optimizer's state, made a second call's step a new graph to
compile. So the same tensor is handed back while each call's epochs end cleanly (an
epoch's end zeroes it), else fresh zeros; a new optimizer (the next fold) gets a fresh one,
younger than its state-to-be, as the first call had. This module alone writes it.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from ..replica import current

if TYPE_CHECKING:
    import torch

# replica: {optimizer: [the device scalar, whether an epoch's end left it zeroed]}
_KEPT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def running_loss(opt) -> "torch.Tensor":
    """The device scalar train_one_cycle sums `opt`'s training losses in, for the calling
    replica."""
    me = current()
    mine = _KEPT.setdefault(me, weakref.WeakKeyDictionary())
    kept = mine.get(opt)
    if kept is None or not kept[1]:
        kept = mine[opt] = [me.engine.zeros(()), True]
    return kept[0]


def in_use(opt) -> None:
    """An epoch starts adding into it: not zero until the epoch's end says so."""
    _KEPT[current()][opt][1] = False


def zeroed(opt) -> None:
    """An epoch's end zeroed it: the next call may take it again."""
    _KEPT[current()][opt][1] = True
