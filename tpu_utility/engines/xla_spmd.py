"""Engine "spmd": one process drives every XLA device; each batch is sharded over them.

The default for `cores` = every device of one host, TPU or CPU, as torch_xla's own data
parallel example recommends: one process traces each step once and holds one copy of the
dataset, and gradients come out global, so there is one replica and nothing to reduce.
It is also real data parallelism on XLA:CPU, where collectives between replica threads
hang upstream (pytorch/xla#5005), so it is the multi-device path the tests run.
BatchNorm sees the whole global batch, as SyncBatchNorm would; it and LayerNorm are
computed as reductions the partitioner splits (spmd_norms.py; docs/measured.md audits
what XLA's partitioner makes of each layer).
"""
from __future__ import annotations

import os

from .spmd_norms import use_partitioned_norms
from .xla_single import XlaSetup, XlaSingle


class XlaSpmd(XlaSingle):
    name = "spmd"
    about = "one process; each batch split over the devices"

    @classmethod
    def automatic(cls, info, cores) -> bool:
        return info.has_xla and info.hosts == 1 and cores == info.num_devices > 1

    @classmethod
    def supports(cls, info, cores):
        if info.hosts > 1:  # a mesh over every host's devices is not what `cores` counts
            return (f"engine='spmd' runs on one host, and this TPU is a pod of {info.hosts} "
                    f"hosts: use engine='launch' (the default here)")
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
        if os.environ.get("PJRT_DEVICE") == "TPU":
            with_rng_flag(os.environ)
        quiet_spmd_on_cpu()
        use_compile_cache(setup.cache)
        import numpy as np
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
        xr.use_spmd()
        use_partitioned_norms()
        n = xr.global_runtime_device_count()
        if n != setup.devices:
            raise RuntimeError(f"SPMD found {n} devices, expected cores={setup.devices}")
        mesh = xs.Mesh(np.arange(n), (n,), ("data",))
        xs.set_global_mesh(mesh)
        body(cls(mesh, n, xr.process_index()))

    def __init__(self, mesh, devices: int, process_index: int):
        import torch_xla.runtime as xr
        self.mesh, self.world_size = mesh, devices
        self.rank = process_index  # one controller per host: host 0 prints and saves
        # On XLA:CPU the devices are this host's own cores, busy computing.
        self.fed_devices = devices if xr.device_type() != "CPU" else 1

    def shard(self):
        return 1, 0  # one replica reads every global batch; the devices split it

    def per_step_batch(self, per_core):
        return per_core * self.world_size

    def _input_sharding(self):
        return _BatchSharding(self.mesh)

    def parameter_mesh(self):
        return self.mesh  # tu.fsdp splits over the axis that splits the batch, as FSDPv2

    def zeros(self, shape):
        import torch_xla.distributed.spmd as xs
        from ..compat import quiet_jax_probes
        quiet_jax_probes()
        t = super().zeros(shape)
        # Replicated, as the step's own outputs are, so a second call reuses the graphs.
        xs.mark_sharding(t, self.mesh, (None,) * t.dim())
        return t


RNG_FLAG = "--xla_tpu_spmd_rng_bit_generator_unsafe"


def with_rng_flag(env) -> None:
    """Add `--xla_tpu_spmd_rng_bit_generator_unsafe=true` to LIBTPU_INIT_ARGS unless the
    user's value names that flag: without it each chip draws the random bits of the whole
    global batch (a dropout mask per layer) and keeps its slice (pytorch/xla#7813); with it,
    each chip draws only its own. "Unsafe" means the bits differ from one device's, not
    that they repeat. torch_xla's own SPMD configs and MaxText set it."""
    args = env.get("LIBTPU_INIT_ARGS", "")
    if RNG_FLAG not in args:
        env["LIBTPU_INIT_ARGS"] = f"{args} {RNG_FLAG}=true".strip()


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
