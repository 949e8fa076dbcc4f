"""tpu_utility: run a functional PyTorch CUDA script on one TPU core or on all of them."""
from .compat import keep_root_logging

keep_root_logging()  # before anything imports torch_xla: the script's logging set-up stays its own
from .amp import Autocast, GradScaler, autocast
from .augment import Augment, aug_transforms
from .bf16_weights import bf16_weights
from .checkpoint import load_state, save, save_state
from .data import DeviceLoader, make_loader
from .devices import (all_reduce, average_gradients, get_device, has_accelerator, is_master,
                      Scaled, master_print, optimizer_step, rank, rows_per_step, scale_lr_bs,
                      sync, to_cpu, world_size)
from .environment import TpuInfo, doctor, setup_tpu
from .cache import CachedDataset, cache_dataset, open_cache
from .images import (ImageCsvDataset, ImageFolderDataset, PresizeReport, denormalize, normalize,
                     presize_images, show_batch)
from .fsdp import fsdp
from .functionalization import FunctionalizationCheck, check_functionalization
from .launch.parent import plan, run
from .launch.preemption import Preempted
from .launch.results import ReplicasExited
from .launch.stall import Stalled
from .planning import Plan
from .loop import History, LRFindResult, accuracy, gather, lr_find, predict, train_one_cycle
from .reporting import XlaReport, report

__all__ = [
    "Augment", "Autocast", "CachedDataset", "DeviceLoader", "FunctionalizationCheck",
    "GradScaler", "History", "ImageCsvDataset", "ImageFolderDataset", "LRFindResult",
    "Plan", "Preempted", "PresizeReport", "ReplicasExited", "Scaled", "Stalled", "TpuInfo",
    "XlaReport", "accuracy", "all_reduce", "aug_transforms", "autocast",
    "average_gradients", "bf16_weights", "cache_dataset", "check_functionalization",
    "denormalize", "doctor", "fsdp", "gather", "get_device", "has_accelerator",
    "is_master", "load_state", "lr_find", "make_loader", "master_print", "normalize",
    "open_cache", "optimizer_step", "plan", "predict", "presize_images", "rank", "report",
    "rows_per_step", "run", "save", "save_state", "scale_lr_bs", "setup_tpu", "show_batch", "sync",
    "to_cpu", "train_one_cycle", "world_size",
]
