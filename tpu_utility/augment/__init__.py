"""On-device augmentation: a fresh crop, flip, affine, lighting, cutout, mixup or cutmix for
every sample of every epoch, computed on the device in the training step's graph.

A TPU host's 2-4 CPU cores cannot augment per sample fast enough to keep a TPU busy, and
caching augmented copies freezes them. Here the host only uploads (uint8) images and one
int32 key per sample; everything else runs on the device:
- `aug_transforms` (transforms.py) checks the arguments and applies the ops in order;
- ops.py holds the ops, each given its per-sample parameters as tensors;
- draw.py is the counter-based generator the parameters come from.
"""
from .transforms import Augment, aug_transforms

__all__ = ["aug_transforms", "Augment"]
