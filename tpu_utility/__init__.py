"""tpu_utility: run a functional PyTorch CUDA script on one TPU core or on all of them."""
from .data import make_loader
from .devices import get_device, is_master, master_print, optimizer_step
from .environment import setup_tpu
from .launcher import run
from .schedules import scale_lr_bs

__all__ = ["setup_tpu", "get_device", "optimizer_step", "make_loader", "scale_lr_bs", "run",
           "master_print", "is_master"]
