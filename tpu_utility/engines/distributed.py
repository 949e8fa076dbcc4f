"""Engine "distributed": one process per replica over torch.distributed, no XLA.

On a host without torch_xla that has N CUDA GPUs (Kaggle's "GPU T4 x2"), run(cores=N)
starts N processes, one GPU each, over NCCL. `engine="distributed"` on a CPU runs any
number of processes over gloo: how the multi-replica code is tested with real
collectives. Rank 0 hosts the rendezvous store on a port the OS picks and tells the
others through a queue, so no port is guessed; process-group start and every
collective wait at most the run's `timeout=` (30 minutes without one). Gradients are averaged in `optimizer_step`, in 25 MB buckets
all reduced at once, rather than by wrapping the model in DDP: the swapped train_fn
never sees its model wrapped, and benchmarks/bench_distributed.py measures the cost.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

from .base import Engine, cores_error

_BUCKET_BYTES = 25 * 2 ** 20  # DDP's default bucket size
_DEFAULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class _Setup:
    ports: Any  # a multiprocessing queue: rank 0 posts the store's port for the others
    backend: str  # "nccl", "gloo" (or "tpu_dist", TorchTPU's)
    timeout_s: float
    processes: int  # one per replica


class Distributed(Engine):
    name = "distributed"
    about = "one process per replica over torch.distributed"

    @classmethod
    def automatic(cls, info, cores) -> bool:
        return not info.has_xla and info.cuda_devices >= 2 and cores == info.cuda_devices

    @classmethod
    def supports(cls, info, cores):
        if cores < 1:
            return f"cores must be >= 1 for engine='distributed' (one process each), got {cores}"
        if cls._backend(info) == "nccl" and cores > info.cuda_devices:
            return cores_error(info, cores)
        return None

    @classmethod
    def _backend(cls, info) -> str:
        return "nccl" if not info.has_xla and info.cuda_devices >= 1 else "gloo"

    @classmethod
    def processes(cls, info, cores):
        return cores, cores

    @classmethod
    @contextlib.contextmanager
    def prepare(cls, info, cores, start_method, timeout):
        import multiprocessing
        import torch
        backend = cls._backend(info)
        if backend == "nccl" and start_method == "fork" and torch.cuda.is_initialized():
            raise RuntimeError(
                "run() forks one process per GPU, but CUDA was already used in this process "
                "(a tensor or model moved to cuda at the top level), and a forked child "
                "cannot use CUDA after that. Restart the kernel and keep all device work "
                "inside train_fn.")
        # Rank 0 hosts the store and posts its port here. Not the caller: a forked child
        # hung creating its store while the caller's store thread ran.
        ports = multiprocessing.get_context(start_method).Queue()
        yield _Setup(ports, backend, float(timeout) if timeout else _DEFAULT_TIMEOUT_S, cores)

    @classmethod
    def start(cls, setup, local_rank, body) -> None:
        import datetime
        import torch
        import torch.distributed as dist
        nprocs = setup.processes
        if setup.backend == "nccl":
            try:
                torch.cuda.set_device(local_rank)
            except RuntimeError as e:
                raise RuntimeError(
                    f"replica {local_rank} cannot use CUDA ({e}). In a forked replica that means "
                    f"the caller initialised CUDA before run(): torch.cuda.is_available() at the "
                    f"top of a notebook is enough. Restart the kernel and keep CUDA calls inside "
                    f"train_fn.") from e
        else:  # replicas share the host's cores
            torch.set_num_threads(min(torch.get_num_threads(), max(1, (os.cpu_count() or 1) // nprocs)))
        timeout = datetime.timedelta(seconds=setup.timeout_s)
        if local_rank == 0:  # on a free port that the OS picks: nothing to guess or collide
            store = dist.TCPStore("127.0.0.1", 0, world_size=nprocs, is_master=True,
                                  wait_for_workers=False, timeout=timeout)
            for _ in range(nprocs - 1):
                setup.ports.put(store.port)
        else:
            port = setup.ports.get(timeout=setup.timeout_s)
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        with _quiet_stdout(setup.backend == "gloo"):
            dist.init_process_group(setup.backend, store=store, rank=local_rank,
                                    world_size=nprocs, timeout=timeout)
        try:
            body(cls(setup.backend, local_rank, nprocs, cls._device_for(setup.backend, local_rank)))
        finally:
            dist.destroy_process_group()

    @staticmethod
    def _device_for(backend: str, local_rank: int):
        import torch
        return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")

    def __init__(self, backend: str, rank: int, replicas: int, device):
        self.backend, self.rank, self._device = backend, rank, device
        self.world_size = self.replicas = self.local_replicas = replicas

    def device(self):
        return self._device

    def _all_reduce_sum(self, tensors):
        import torch.distributed as dist
        out = [t.detach().clone() for t in tensors]
        for bucket in _buckets(out):
            flat = _concat(bucket)
            dist.all_reduce(flat)
            _copy_back(flat, bucket)
        return out

    def _all_gather(self, tensor):
        import torch
        import torch.distributed as dist
        tensor = tensor.detach().contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.replicas)]
        dist.all_gather(parts, tensor)
        return torch.cat(parts)

    def _broadcast(self, tensors) -> None:
        import torch.distributed as dist
        for bucket in _buckets(tensors):
            flat = _concat(bucket)
            dist.broadcast(flat, src=0)
            _copy_back(flat, bucket)

    def _barrier(self) -> None:
        import torch.distributed as dist
        dist.barrier()

    def _average_gradients(self, grads) -> None:
        import torch.distributed as dist
        pending = []
        for bucket in _buckets(grads):  # every bucket in flight at once
            flat = _concat(bucket)
            pending.append((dist.all_reduce(flat, async_op=True), flat, bucket))
        for work, flat, bucket in pending:
            work.wait()
            flat /= self.replicas
            _copy_back(flat, bucket)


@contextlib.contextmanager
def _quiet_stdout(quiet: bool):
    """gloo's C++ prints "[Gloo] Rank N is connected to M peer ranks" to file descriptor 1
    as each replica joins (not through c10's logger: TORCH_CPP_LOG_LEVEL does not reach
    it); errors still raise. The descriptor itself is pointed at /dev/null meanwhile."""
    if not quiet:
        yield
        return
    import sys
    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _buckets(tensors):
    """`tensors` in runs of one dtype and device, each run at most _BUCKET_BYTES (or one tensor)."""
    bucket, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > _BUCKET_BYTES or (t.dtype, t.device) != (bucket[0].dtype, bucket[0].device)):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def _concat(bucket):
    """A bucket of tensors as one flat tensor: one collective instead of one each."""
    import torch
    return torch.cat([t.reshape(-1) for t in bucket]) if len(bucket) > 1 else bucket[0].detach().reshape(-1).clone()


def _copy_back(flat, bucket) -> None:
    """The reduced flat tensor's slices back into the bucket's tensors."""
    offset = 0
    for t in bucket:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
