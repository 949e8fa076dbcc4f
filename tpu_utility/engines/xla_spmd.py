"""Engine "spmd": one process drives every XLA device; each batch is sharded over them.

This is real data parallelism on XLA:CPU too, where collectives between replica
threads hang upstream (pytorch/xla#5005): gradients come out global, so there is one
replica and nothing to reduce.
"""
from __future__ import annotations

import os

from .xla_single import XlaSetup, XlaSingle


class XlaSpmd(XlaSingle):
    name = "spmd"

    @classmethod
    def automatic(cls, info, cores) -> bool:
        return info.has_xla and not info.has_tpu and cores == info.num_devices > 1

    @classmethod
    def supports(cls, info, cores):
        return cls._every_device(info, cores)

    @classmethod
    def processes(cls, info, cores):
        return 1, 1

    @classmethod
    def _setup(cls, cache, info, cores):
        return XlaSetup(cache, devices=cores)

    @classmethod
    def start(cls, setup, local_rank, body) -> None:
        from ..compat import quiet_spmd_on_cpu, use_compile_cache
        if os.environ.get("PJRT_DEVICE") == "CPU":  # read once, when the runtime starts
            os.environ["CPU_NUM_DEVICES"] = str(setup.devices)
        quiet_spmd_on_cpu()
        use_compile_cache(setup.cache)
        import numpy as np
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
        xr.use_spmd()
        n = xr.global_runtime_device_count()
        if n != setup.devices:
            raise RuntimeError(f"SPMD found {n} devices, expected cores={setup.devices}")
        mesh = xs.Mesh(np.arange(n), (n,), ("data",))
        xs.set_global_mesh(mesh)
        body(cls(mesh, n, xr.process_index()))

    def __init__(self, mesh, devices: int, process_index: int):
        self.mesh, self.world_size = mesh, devices
        self.rank = process_index  # one controller per host: host 0 prints and saves

    def shard(self):
        return 1, 0  # one replica reads every global batch; the devices split it

    def per_step_batch(self, per_core):
        return per_core * self.world_size

    def _input_sharding(self):
        return _BatchSharding(self.mesh)

    def zeros(self, shape):
        import torch_xla.distributed.spmd as xs
        from ..compat import quiet_jax_probes
        quiet_jax_probes()
        t = super().zeros(shape)
        # Replicated, as the step's own outputs are, so a second call reuses the graphs.
        xs.mark_sharding(t, self.mesh, (None,) * t.dim())
        return t


class _BatchSharding:
    """Shards dim 0 of every input tensor over the mesh's "data" axis, whatever its rank.

    torch_xla's ShardingSpec fits one rank only; images and labels differ in rank.
    """

    minibatch = False

    def __init__(self, mesh):
        self.mesh = mesh
        self._specs = {}

    def xla_spec(self, t):
        # A batch that does not split evenly (an evaluation loader's last one) is replicated:
        # XLA's SPMD partitioner aborts the process on some ops over uneven shards (a
        # scatter_ into a tensor sized from the batch: "Check failed:
        # ShapeUtil::IsScalarWithElementType", torch_xla 2.8 and 2.9), and a replicated batch
        # gives the same results, at the cost of computing that one batch on every device.
        if t.dim() == 0 or t.shape[0] % self.mesh.size() != 0:
            return None
        if t.dim() not in self._specs:
            import torch_xla.distributed.spmd as xs
            self._specs[t.dim()] = xs.ShardingSpec(self.mesh, ("data",) + (None,) * (t.dim() - 1))
        return self._specs[t.dim()].xla_spec(t)
