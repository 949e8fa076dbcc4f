"""Images: presize a dataset once, read the two Kaggle layouts, look at a batch.

A TPU on Kaggle or Colab is fed by 2-4 CPU cores; decoding and resizing full-size JPEGs
every epoch keeps it waiting. So:
- `presize_images` shrinks the files once (JPEG draft decoding, all cores, resumable);
  see presize.py;
- `ImageCsvDataset` / `ImageFolderDataset` read the two common Kaggle layouts; see
  datasets.py;
- `show_batch`, `normalize` and `denormalize` help look at and feed the result; see grid.py
  (the two normalisations live with the augmentation ops, augment/ops.py).

To write every decoded (optionally augmented) sample once to disk, so an epoch copies
arrays instead of decoding images, use `tpu_utility.cache.cache_dataset`: it caches any
dataset, images or not.

`import tpu_utility` stays cheap: torch, numpy and Pillow are imported inside the functions,
and the datasets are plain map-style classes (`__len__`, `__getitem__`), not torch ones.
"""
from .datasets import IMAGE_EXTENSIONS, ImageCsvDataset, ImageFolderDataset
from .grid import IMAGENET_MEAN, IMAGENET_STD, denormalize, normalize, show_batch
from .presize import PresizeReport, presize_images

__all__ = ["presize_images", "PresizeReport", "ImageCsvDataset", "ImageFolderDataset",
           "normalize", "denormalize", "show_batch", "IMAGENET_MEAN", "IMAGENET_STD",
           "IMAGE_EXTENSIONS"]
