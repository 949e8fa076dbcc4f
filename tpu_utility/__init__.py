"""tpu_utility: run a functional PyTorch CUDA script on one TPU core or on all of them."""
from .amp import GradScaler, autocast
from .augment import aug_transforms
from .bf16_weights import bf16_weights
from .checkpoint import load_state, save, save_state
from .data import make_loader
from .devices import (all_reduce, average_gradients, get_device, has_accelerator, is_master,
                      master_print, optimizer_step, rank, scale_lr_bs, sync, to_cpu,
                      world_size)
from .environment import doctor, setup_tpu
from .cache import CachedDataset, cache_dataset, open_cache
from .images import (ImageCsvDataset, ImageFolderDataset, PresizeReport, denormalize, normalize,
                     presize_images, show_batch)
from .fsdp import fsdp
from .functionalization import FunctionalizationCheck, check_functionalization
from .launcher import ReplicasExited, run
from .loop import accuracy, gather, lr_find, predict, train_one_cycle
from .preemption import Preempted
from .reporting import report
from .stall import Stalled

__all__ = ["setup_tpu", "get_device", "optimizer_step", "make_loader", "scale_lr_bs", "run",
           "average_gradients", "train_one_cycle", "lr_find", "predict", "save", "accuracy", "master_print",
           "is_master", "rank", "world_size", "sync", "report", "doctor", "presize_images",
           "PresizeReport", "ImageCsvDataset", "ImageFolderDataset", "cache_dataset",
           "open_cache", "CachedDataset", "show_batch", "normalize", "denormalize",
           "ReplicasExited", "autocast", "GradScaler", "gather", "save_state", "load_state",
           "Preempted", "Stalled", "to_cpu", "aug_transforms", "check_functionalization",
           "FunctionalizationCheck", "has_accelerator", "all_reduce", "fsdp", "bf16_weights"]
