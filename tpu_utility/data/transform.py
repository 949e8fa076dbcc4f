"""`DeviceTransform`: all a loader knows of augmentation (`make_loader(augment=...)`).

Three methods: `keys` makes each sample's random key on the host as its batch loads (the
keys travel with the batch), and `train_batch` / `eval_batch` transform the batch on the
device, traced into the step's graph. `tu.aug_transforms(...)` returns one; the loader
checks an object's methods, not its class, so it imports no augmentation code.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:
    import torch

METHODS = ("keys", "train_batch", "eval_batch")


class DeviceTransform(Protocol):
    """A batch transform on the device, with per-sample randomness from keys made on the host.

    The keys are a function of (seed, epoch, places) alone, so a seeded run transforms each
    sample alike on any engine and core count, and a resumed run as the uninterrupted one:
    the loader's place is the transform's whole random state.
    """

    def keys(self, seed: int, epoch: int, places: Sequence[int]) -> "torch.Tensor":
        """Host side, once per training batch as it loads (in a DataLoader worker, if any).

        Args:
            seed: the loader's seed.
            epoch: the epoch the batch belongs to.
            places: each sample's place in the epoch's global order (over every replica).

        Returns:
            One key per sample (a tensor whose first dim is len(places)), collated with
            the batch and uploaded with it.
        """

    def train_batch(self, batch: Any, keys: "torch.Tensor") -> Any:
        """On the device: a training batch transformed with its samples' `keys`.

        Args:
            batch: the collated batch, on the device.
            keys: what `keys` made for its samples, on the device.
        """

    def eval_batch(self, batch: Any) -> Any:
        """On the device: an evaluation batch (or a training batch of `train=False`)
        through the transform's deterministic part.

        Args:
            batch: the collated batch, on the device (without its `valid` flags when padded).
        """


def check_transform(transform: Any) -> None:
    """Refuse what is not a DeviceTransform, by its methods (any class may be one).

    Args:
        transform: the loader's `augment`, not None.
    """
    missing = [m for m in METHODS if not callable(getattr(transform, m, None))]
    if missing and callable(transform) and getattr(transform, "__name__", "") == "aug_transforms":
        raise TypeError("augment=tu.aug_transforms passes the function: call it, "
                        "augment=tu.aug_transforms(...)")
    if missing:
        raise TypeError(f"augment must be what tu.aug_transforms(...) returns, got "
                        f"{type(transform).__name__} (a DeviceTransform has the methods "
                        f"keys, train_batch and eval_batch; it lacks {', '.join(missing)})")
