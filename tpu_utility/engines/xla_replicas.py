"""Engine "launch": one replica per XLA device, as `torch_xla.launch` runs them.

The default on TPU pods only; on one host `engine="launch"` (or TPU_UTILITY_ENGINE=launch)
picks it over "spmd". A TPU v5e-8 or v6e-8 runs 8 processes of one device each; a v2/v3
runs 4 processes of two threads each, so a replica is a thread and has an engine of its
own. Collectives are torch_xla's, inside the step's graph. On XLA:CPU they hang between
replicas (pytorch/xla#5005), so there this engine runs only with one device; the
"distributed" engine proves the same multi-replica code with real collectives.
"""
from __future__ import annotations

from .xla_single import XlaSetup, XlaSingle


class XlaReplicas(XlaSingle):
    name = "launch"
    about = "one process per device"

    @classmethod
    def automatic(cls, info, cores) -> bool:  # a pod: every host runs its own processes
        return info.has_xla and info.has_tpu and info.hosts > 1 and cores == info.num_devices > 1

    @classmethod
    def supports(cls, info, cores):
        why = cls._every_device(info, cores)
        if why:
            return why
        if not info.has_tpu and info.num_devices > 1:
            return (f"engine='launch' on XLA:CPU with {info.num_devices} devices would hang: "
                    f"collectives between CPU replica threads do not work in torch_xla "
                    f"(pytorch/xla#5005). Use engine='spmd' (the default for cores>1 on CPU), "
                    f"engine='distributed' (processes over gloo) or cores=1.")
        return None

    @classmethod
    def processes(cls, info, cores):
        if info.has_tpu:
            from ..compat import local_tpu_processes
            return local_tpu_processes(), info.num_devices
        return 1, 1

    @classmethod
    def _setup(cls, cache, info, cores):
        return XlaSetup(cache, processes=cls.processes(info, cores)[0])

    @classmethod
    def start(cls, setup, local_rank, body) -> None:
        import os
        from ..compat import run_thread_per_device, use_compile_cache
        # A folder per process: torch_xla's cache is not documented as safe for writers that share one.
        use_compile_cache(setup.cache and os.path.join(setup.cache, f"process-{local_rank}"))
        # One thread per device of this process; each makes its engine once its device is set.
        run_thread_per_device(local_rank, setup.processes, lambda: body(cls()))

    def __init__(self):
        import torch_xla
        import torch_xla.runtime as xr
        self.world_size = self.replicas = xr.world_size()
        self.rank = xr.global_ordinal()
        self.local_replicas = xr.local_device_count()
        # Threads of one process (v2/v3) share its CPU generators: in replica.py its first owns them.
        self.thread_index = torch_xla.device().index

    def _all_reduce_sum(self, tensors):
        import torch_xla.core.xla_model as xm
        return xm.all_reduce(xm.REDUCE_SUM, [t.clone() for t in tensors])

    def _all_gather(self, tensor):
        import torch_xla.core.xla_model as xm
        return xm.all_gather(tensor, dim=0)

    def _broadcast(self, tensors) -> None:
        import torch_xla.core.xla_model as xm
        xm.collective_broadcast(tensors, root_ordinal=0)

    def _barrier(self) -> None:
        import torch_xla.core.xla_model as xm
        xm.rendezvous("tpu_utility.barrier")

    def _average_gradients(self, grads) -> None:
        import torch_xla.core.xla_model as xm
        # What xm.reduce_gradients does with several replicas, for any list of gradients.
        xm.all_reduce(xm.REDUCE_SUM, grads, scale=1.0 / self.replicas)
