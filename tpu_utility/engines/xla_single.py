"""Engine "single": one XLA device in a child process; also what every XLA engine shares.

XLA records each step as a graph: `feed` uploads batches ahead and cuts the graph once a
step (torch_xla's MpDeviceLoader), `after_step` defers host reads to a step closure so a
read never runs a step twice, and `zeros` uploads data rather than baking a constant
into the graph. The XLA engines run in child processes, so the caller (a notebook
kernel) never holds the runtime and a later run can still start one of its own.
"""
from __future__ import annotations

import contextlib
import gc
import multiprocessing.context as mpc
from dataclasses import dataclass
from typing import Optional

from .base import Engine, cores_error
from .spmd_norms import use_partitioned_norms


@dataclass(frozen=True)
class XlaSetup:
    """What the children of the multi-device XLA engines need, from `prepare`."""

    cache: Optional[str]  # the folder for compiled graphs, or None
    devices: int = 1  # the run's devices (SPMD starts its runtime with them)
    processes: int = 1  # child processes (the thread-per-device launch needs the count)


class XlaSingle(Engine):
    """One replica on one XLA device."""

    name = "single"
    about = "one device"

    @classmethod
    def automatic(cls, info, cores) -> bool:
        return info.has_xla and cores == 1

    @classmethod
    def supports(cls, info, cores):
        if not info.has_xla:
            return cls._no_xla()
        if cores != 1:
            return f"engine='single' runs on one device; pass cores=1, got cores={cores}"
        return None

    @classmethod
    def _no_xla(cls) -> str:
        return (f"engine={cls.name!r} needs torch_xla, which is not installed; use engine=None "
                f"(runs on cuda or cpu)")

    @classmethod
    def _every_device(cls, info, cores):
        """Why this engine cannot run `cores` when it needs all of the host's XLA devices."""
        if not info.has_xla:
            return cls._no_xla()
        if cores != info.num_devices:
            return cores_error(info, cores)
        return None

    @classmethod
    def processes(cls, info, cores):
        from ..compat import runtime_started
        # A process that already holds its one device just runs there.
        return (0, 1) if runtime_started() else (1, 1)

    @classmethod
    @contextlib.contextmanager
    def prepare(cls, info, cores, start_method, timeout):
        from ..compat import runtime_started
        if runtime_started():
            raise RuntimeError(
                f"run(cores={cores}) needs a fresh XLA runtime, but this process already started "
                f"it: the XLA device was used outside run() (get_device() or a tensor moved to "
                f"it at the top level). Restart the kernel (or script) and keep all device "
                f"work inside train_fn.")
        if start_method == "fork":
            import torch_xla  # noqa: F401  (imported once here, shared by every forked child)
        from ..environment import compile_cache_dir
        yield cls._setup(compile_cache_dir(info), info, cores)

    @classmethod
    def _setup(cls, cache: Optional[str], info, cores: int):
        """What `start` receives: one device needs only the compiled graphs' folder."""
        return cache

    @classmethod
    def start(cls, setup, local_rank, body) -> None:
        from ..compat import init_one_device, use_compile_cache
        use_compile_cache(setup)
        init_one_device()
        body(cls())

    def device(self):
        import torch_xla
        from ..memory import watch_compiles
        from ..recompute import install, installed, note_step
        if not installed():  # gradient checkpointing: torch's needs a device module for XLA
            install()
            note_step()
        watch_compiles()  # before the first compile: torch_xla reads its debug settings once
        use_partitioned_norms(layer_norm=False)  # BatchNorm's running_var as torch keeps it
        return torch_xla.device()

    def loader_options(self, num_workers):
        return {"multiprocessing_context": _GcFrozenFork()} if num_workers > 0 else {}

    def feed(self, loader):
        import torch_xla.distributed.parallel_loader as pl
        from ..compat import quiet_jax_probes
        quiet_jax_probes()
        return _ClosingFeed(pl.MpDeviceLoader(loader, self.device(),
                                              input_sharding=self._input_sharding()))

    def _input_sharding(self):
        return None

    def after_step(self, fn, *tensors) -> None:
        import torch_xla.core.xla_model as xm
        xm.add_step_closure(fn, tensors)  # runs at the next graph cut, once the step has run

    def sync(self) -> None:
        from ..compat import end_step
        from ..recompute import note_step
        end_step()
        note_step()

    def rng_state(self):
        import torch_xla.core.xla_model as xm
        # A host integer after a graph cut: reading it runs nothing on the device.
        return xm.get_rng_state(self.device())

    def set_rng_state(self, state) -> None:
        import torch_xla.core.xla_model as xm
        if state is not None:
            xm.set_rng_state(int(state), self.device())

    def cut_step(self) -> None:
        from ..compat import cut_before_next_batch
        from ..recompute import note_step
        cut_before_next_batch()
        note_step()

    def zeros(self, shape):
        import torch
        import torch_xla.core.xla_model as xm
        # torch.zeros(device=xla) would be a graph constant, and the first step that
        # updates it a graph of its own; so would `.to(device)` of a 0-dim zero (0.0 is a
        # special scalar), joining the next step's graph where no cut comes before it
        # (after tu.sync()). Uploaded as the loader uploads batches, it is data at once.
        return xm.send_cpu_data_to_device([torch.zeros(shape)], self.device())[0]


class _ClosingFeed:
    """An MpDeviceLoader whose epoch, stopped early, also stops its loading threads (and
    so the DataLoader workers they hold), rather than leaving them blocked on a queue."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        from ..compat import close_feed
        from ..recompute import note_step
        batches = iter(self.loader)
        try:
            for batch in batches:  # each comes after the loader's cut
                note_step()
                yield batch
        finally:
            close_feed(batches)


class _GcFrozenForkProcess(mpc.ForkProcess):
    @staticmethod
    def _Popen(process_obj):
        gc.freeze()
        try:
            return mpc.ForkProcess._Popen(process_obj)
        finally:
            gc.unfreeze()


class _GcFrozenFork(mpc.ForkContext):
    """A fork context for DataLoader workers under XLA whose children never collect the
    objects they inherit.

    A worker is forked from the loader's thread while the main thread runs XLA. If the
    worker's garbage collector then frees an inherited XLA tensor, its destructor waits
    for a lazy-tensor lock that the main thread held at the fork, and the worker hangs
    (seen in a benchmark). Freezing the GC around the fork keeps inherited objects out of
    the child's collections.
    """

    Process = _GcFrozenForkProcess
