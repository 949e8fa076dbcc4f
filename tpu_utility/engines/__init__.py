"""Engines: the ways `run` can run train_fn, each one file behind the `Engine` interface.

| name | file | replicas | where |
| --- | --- | --- | --- |
| "single" | xla_single.py | 1 | one XLA device, in a child process |
| "spmd" | xla_spmd.py | 1, its batches sharded over every device | one child process (the default for every device of one host, TPU or CPU) |
| "launch" | xla_replicas.py | one per XLA device | child processes, threads where a process has several devices (TPU v2/v3); the default on TPU pods |
| "distributed" | distributed.py | one per process | child processes over torch.distributed: NCCL on CUDA GPUs, gloo on CPU |
| "torchtpu" | torchtpu.py | one per TPU chip | spawned processes on Google's TorchTPU runtime (experimental) |
| "torch" | local.py | 1 | the calling process, on cuda or cpu (no XLA) |

The interface is in base.py. `run` picks a class (`choose`), starts its processes, and
makes one instance per replica, held by that replica's record (replica.py, whose
`current()` the device, the optimizer step, the loader, metrics and gathering ask); none
of them tests an engine's name. A run on more than one core that names no engine takes
TPU_UTILITY_ENGINE's, so a script switches without an edit. A new engine is one new file
plus one line in REGISTRY. Importing this package imports no torch.
"""
from __future__ import annotations

import numbers
import os
from typing import TYPE_CHECKING, Dict, Mapping, Optional, Type

from .base import Engine, cores_error
from .distributed import Distributed
from .local import Local
from .torchtpu import TorchTpu
from .xla_replicas import XlaReplicas
from .xla_single import XlaSingle
from .xla_spmd import XlaSpmd

if TYPE_CHECKING:
    from ..environment import TpuInfo

# In the order `choose` asks them whether they are this host's automatic choice.
REGISTRY: Dict[str, Type[Engine]] = {cls.name: cls for cls in (
    XlaSingle, XlaReplicas, XlaSpmd, TorchTpu, Distributed, Local)}

ENGINE_VAR = "TPU_UTILITY_ENGINE"

# The other way to run every device of one host, named in the run's first line.
_OTHER = {"spmd": "launch", "launch": "spmd"}


def choose(cores: int, info: "TpuInfo", name: Optional[str] = None,
           env: Mapping[str, str] = os.environ) -> Type[Engine]:
    """The engine class for `cores` on this host, or `name`'s, or for more than one core
    TPU_UTILITY_ENGINE's in `env`; a ValueError says why not."""
    if name is not None and name not in REGISTRY:
        raise ValueError(f"engine must be one of {tuple(REGISTRY)} or None, got {name!r}")
    if isinstance(cores, bool) or not isinstance(cores, numbers.Integral):
        raise ValueError(f"cores must be an int, got {cores!r}")
    cores = int(cores)
    named = "engine"
    if name is None and cores > 1 and env.get(ENGINE_VAR):
        name, named = env[ENGINE_VAR], ENGINE_VAR
        if name not in REGISTRY:
            raise ValueError(f"{ENGINE_VAR} must be one of {tuple(REGISTRY)}, got {name!r}: "
                             f"unset it to let run() choose")
    if name is not None:
        cls = REGISTRY[name]
    else:
        cls = next((c for c in REGISTRY.values() if c.automatic(info, cores)), None)
        if cls is None:
            raise ValueError(cores_error(info, cores))
    why = cls.supports(info, cores) or (cores_error(info, cores) if cores < 1 else None)
    if why:  # cores < 1: refused on every host, even by engines that would run any int
        raise ValueError(f"{ENGINE_VAR}={name}: {why}" if named == ENGINE_VAR else why)
    return cls


def describe(cls: Type[Engine], info: "TpuInfo", cores: int) -> str:
    """One line: the engine that runs `cores` here, and how to pick the other one."""
    line = f"tpu_utility: engine {cls.name!r} on {cores} device(s), {cls.about}"
    other = REGISTRY.get(_OTHER.get(cls.name, ""))
    if other is not None and other.supports(info, cores) is None:
        line += (f"; for {other.about}, pass engine={other.name!r} to run() or set "
                 f"{ENGINE_VAR}={other.name}")
    return line


def outside_run() -> Engine:
    """The engine for work outside `run`: one device in this process (replica.py keeps one
    per process)."""
    from ..environment import xla_version
    return XlaSingle() if xla_version() else Local()
