"""Text padded to a few lengths: a collate that pads each batch to its own longest row
(`DataCollatorWithPadding`, every HF example) gives XLA a new shape, and a new compile,
for almost every batch. Padding further, to the next of a few bucket lengths, bounds the
shapes; the attention mask keeps the extra padding out of the model's outputs and loss.

Padding goes on the right whatever side the collate padded: the real tokens keep their
positions, so models that number positions from 0 (most) give the same outputs.
"""
from __future__ import annotations

import numbers
from typing import Any, Mapping, Optional, Sequence, Union

Buckets = Union[None, bool, Sequence[int]]

# Powers of two and 1.5x powers of two: at most 50% padding added, 20% on average, and
# 5 lengths from 16 to 64, 10 to 512. 8 divides each (TPU tiles).
_FIRST = 16


def bucket_length(n: int, lengths: Optional[Sequence[int]] = None,
                  cap: Optional[int] = None) -> int:
    """The length a batch of `n` columns is padded to: the smallest bucket of at least n.

    Example:
        >>> [bucket_length(n) for n in (5, 16, 17, 33, 100, 129, 500)]
        [16, 16, 24, 48, 128, 192, 512]
        >>> bucket_length(70, cap=77), bucket_length(20, cap=77)  # a tokenizer's limit
        (77, 24)
        >>> bucket_length(70, lengths=(64, 128)), bucket_length(300, lengths=(64, 128))
        (128, 300)

    Args:
        n: the batch's length (columns of its attention mask).
        lengths: the bucket lengths; None for the default ladder (16, 24, 32, 48, 64, ...).
            A batch longer than the longest keeps its length.
        cap: a length never padded past (the tokenizer's `model_max_length`): a batch
            of at most `cap` columns is padded to at most `cap`.
    """
    if lengths is not None:
        target = min((b for b in lengths if b >= n), default=n)
    else:
        target = _FIRST
        while target < n:
            target = target * 3 // 2 if target & (target - 1) == 0 else target * 4 // 3
    if cap is not None and n <= cap < target:
        target = cap
    return target


def check_buckets(buckets: Buckets) -> Buckets:
    """`make_loader(buckets=...)` checked: None, True, False, or increasing lengths (a tuple)."""
    if buckets is None or isinstance(buckets, bool):
        return buckets
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence):
        raise TypeError(f"make_loader(buckets=...) takes None (pad ragged text batches to the "
                        f"default lengths), True, False or a list of lengths such as "
                        f"[64, 128, 256], got {type(buckets).__name__}")
    lengths = tuple(buckets)
    if not lengths or any(isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1
                          for b in lengths) \
            or list(lengths) != sorted(set(lengths)):
        raise ValueError(f"make_loader(buckets={list(buckets)!r}): the lengths must be positive "
                         f"ints in increasing order, such as [64, 128, 256]")
    return tuple(int(b) for b in lengths)


class Bucketed:
    """A batch padded to a bucket, from the collate (a worker, perhaps) to the training
    process, with what its sequence tensors were padded with: `Settle` may pad it further.
    `where` is the path of indices to the dict inside (`(batch, valid)`, `(batch, keys)`)."""

    def __init__(self, batch, where: tuple, fills: dict):
        self.batch, self.where, self.fills = batch, where, fills


def padded_to_bucket(batch: Any, samples: list, buckets: Buckets, collate_fn=None,
                     positions: Optional[int] = None):
    """(`batch` with its sequence tensors padded on the right to a bucket length, the
    fill of each), when it is a mapping with a 2-D `attention_mask`: always with `buckets`
    True or lengths, and with None (the default) when the collate padded the samples to
    the batch's longest (their `input_ids` or `attention_mask` differ in length).
    Anything else comes back as it is, with no fills (None).

    Each tensor whose first two dimensions are the mask's is padded: `attention_mask` with
    0; `input_ids` with the collate's tokenizer's pad token; the rest with the value the
    collate put under the mask's zeros; `labels` with -100, which the loss ignores. A
    tensor whose values under the mask's zeros differ (it does not line up with the mask:
    a seq2seq batch's labels) is left as it is.

    Args:
        batch: what the collate returned.
        samples: the samples it collated.
        buckets: make_loader's `buckets=` (not False).
        collate_fn: the user's collate (its `tokenizer` gives the pad token and limit).
        positions: the fewest positions a model here takes (hf.position_limit()), a limit
            as the tokenizer's is.
    """
    import torch
    if not isinstance(batch, Mapping):
        return batch, None
    mask = batch.get("attention_mask")
    if not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
        return batch, None
    rows, n = mask.shape
    if buckets is None and not _ragged(samples, n):
        return batch, None
    tokenizer = getattr(collate_fn, "tokenizer", None)
    cap = getattr(tokenizer, "model_max_length", None)
    cap = cap if isinstance(cap, int) and cap < 10 ** 6 else None  # HF's "no limit" is 1e30
    if positions is not None:
        cap = positions if cap is None else min(cap, positions)
    masked = mask == 0
    fills = {key: _fill(key, value, masked, getattr(tokenizer, "pad_token_id", None))
             for key, value in batch.items() if isinstance(value, torch.Tensor) and
             value.dim() >= 2 and tuple(value.shape[:2]) == (rows, n)}
    fills = {key: fill for key, fill in fills.items() if fill is not None}
    target = bucket_length(n, buckets if isinstance(buckets, tuple) else None, cap)
    return padded(batch, fills, target), fills


def padded(batch, fills: dict, target: int):
    """`batch` with the tensors of `fills` padded on the right to `target` columns."""
    import torch
    n = batch["attention_mask"].shape[1]
    if target <= n:
        return batch
    out = batch if hasattr(batch, "__setitem__") else dict(batch)
    for key, fill in fills.items():
        value = batch[key]
        pad = fill.to(value.dtype).expand(value.shape[0], target - n, *value.shape[2:])
        out[key] = torch.cat([value, pad], dim=1)
    return out


class Settle:
    """One replica's loader's bucket lengths, met in its first epoch: later epochs pad a
    batch whose own bucket was not met up to the nearest one that was (compiled already),
    so that after the first pass over the data (which meets its longest rows) XLA compiles
    nothing more. A batch longer than every length met adds its own."""

    def __init__(self):
        self.met: set = set()
        self.first_epoch = True

    def __call__(self, bucketed: Bucketed):
        inner = bucketed.batch
        for i in bucketed.where:
            inner = inner[i]
        n = inner["attention_mask"].shape[1]
        longer = [m for m in self.met if m > n]
        if n in self.met or self.first_epoch or not longer:
            self.met.add(n)
            return bucketed.batch
        inner = padded(inner, bucketed.fills, min(longer))
        return _put(bucketed.batch, bucketed.where, inner)


def _put(batch, where: tuple, inner):
    if not where:
        return inner
    parts = list(batch)
    parts[where[0]] = _put(parts[where[0]], where[1:], inner)
    return type(batch)(parts)


def _fill(key: str, value, masked, pad_id) -> Any:
    """What `key` is padded with, or None: it does not line up with the mask (a seq2seq
    batch's labels, padded to the longest label row, which may be as long as the longest
    input row by chance), and is left as the collate made it."""
    import torch
    if key == "attention_mask":
        return torch.tensor(0)
    if key == "input_ids" and isinstance(pad_id, int):
        return torch.tensor(pad_id)
    if bool(masked.any()):  # what the collate itself padded this key with, if one value
        under = value[masked]
        if not bool((under == under[0]).all()):
            return None
        if key != "labels":
            return under[0]
    # Labels past the collate's own length are ignored by the loss (-100), so the loss is
    # the one the unpadded batch gives, whatever the collate put under its own padding.
    return torch.tensor(-100 if key == "labels" else 0)


def _ragged(samples: list, n: int) -> bool:
    """Whether the collate padded: some sample's ids (or mask) are shorter than the batch."""
    for sample in samples:
        if not isinstance(sample, Mapping):
            return False
        ids = sample.get("input_ids", sample.get("attention_mask"))
        if ids is None or not hasattr(ids, "__len__"):
            return False
        if len(ids) != n:
            return True
    return False
