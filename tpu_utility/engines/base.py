"""The `Engine` interface that every engine implements, and what all engines share."""
from __future__ import annotations

import contextlib
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional,
                    Sequence, Tuple)

from .._tree import map_tensors

if TYPE_CHECKING:
    import torch
    from ..environment import TpuInfo


class Engine:
    """The backend of one replica (its device, feed, collectives and step cut), plus
    (classmethods) how the parent starts replicas. What a replica owns besides (its
    heartbeat, stop board, random-stream flag, what it made identical) is its record in
    step.py, which builds the optimizer step on these collectives.

    `world_size` is the data-parallel width (devices that share each global batch: what
    `scale_lr_bs` scales by); `replicas` is how many copies of train_fn run, each on its
    own slice of the data; `rank` is this copy's index, 0 being the master. Single-replica
    engines inherit the identity collectives below; multi-replica engines supply the
    primitives (`_all_reduce_sum`, `_all_gather`, `_broadcast`, `_barrier`,
    `_average_gradients(grads)`, in place).
    """

    name: str = ""
    about: str = ""  # what a run with it looks like, in a few words (the run's first line)
    start_methods: Tuple[str, ...] = ("fork", "spawn")  # how its child processes may start
    world_size: int = 1
    replicas: int = 1
    rank: int = 0
    local_replicas: int = 1  # replicas on this host, which share its CPU cores
    fed_devices: int = 1  # accelerator devices this replica's input pipeline feeds
    thread_index: int = 0  # this replica's place among replica threads of one process

    # -- the launching side: classmethods, run in the caller; none starts a runtime ----------

    @classmethod
    def automatic(cls, info: "TpuInfo", cores: int) -> bool:
        """Whether `run(cores=...)` picks this engine on this host when none is named."""
        return False

    @classmethod
    def supports(cls, info: "TpuInfo", cores: int) -> Optional[str]:
        """None, or one sentence saying why this engine cannot run `cores` here."""
        return None

    @classmethod
    def processes(cls, info: "TpuInfo", cores: int) -> Tuple[int, int]:
        """(processes to start, replicas on this host that report back); (0, 1): in the caller."""
        return 0, 1

    @classmethod
    def in_caller(cls, info: "TpuInfo", cores: int) -> "Engine":
        """The engine for a run in the calling process (when `processes` gives 0)."""
        return cls()

    @classmethod
    @contextlib.contextmanager
    def prepare(cls, info: "TpuInfo", cores: int, start_method: str,
                timeout: Optional[float]) -> Iterator[Any]:
        """In the caller, around the whole run: check the host, and yield what every
        child's `start` receives (picklable): all it needs, process and device counts
        included."""
        yield None

    @classmethod
    def start(cls, setup: Any, local_rank: int, body: Callable[["Engine"], None]) -> None:
        """In child process `local_rank`: initialise from `setup` (what `prepare` yielded),
        then call `body(engine)` once per replica of this process."""
        raise NotImplementedError(f"engine {cls.name!r} runs in the calling process")

    # -- the replica side -------------------------------------------------------------------

    def device(self) -> "torch.device":
        raise NotImplementedError

    def shard(self) -> Tuple[int, int]:
        """(number of slices, this replica's slice) for the DistributedSampler."""
        return self.replicas, self.rank

    def per_step_batch(self, per_core: int) -> int:
        """The rows one step of this replica reads, for a per-core batch size."""
        return per_core

    def loader_options(self, num_workers: int) -> Dict[str, Any]:
        """Extra DataLoader arguments this engine needs."""
        return {}

    def feed(self, loader) -> Iterable:
        """An iterable, re-iterated every epoch, of `loader`'s batches on the device.

        `loader` is an iterable with a length (the DataLoader behind make_loader's guard,
        which catches what loading raises wherever the feed iterates it)."""
        return _ToDevice(loader, self.device())

    def after_step(self, fn: Callable, *tensors) -> None:
        """Call `fn(*tensors)` once the step has run (now, where nothing is deferred)."""
        fn(*tensors)

    def sync(self) -> None:
        """Run everything pending (XLA cuts its graph here)."""

    def cut_step(self) -> None:
        """At a step boundary: run the step now, where the feed would before the next
        batch, leaving the run on the random stream it would have had."""
        self.sync()

    def rng_state(self) -> Any:
        """The device's own random generator state (None for the CPU: torch's covers it)."""
        import torch
        device = self.device()
        return torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def set_rng_state(self, state: Any) -> None:
        import torch
        device = self.device()
        if state is not None and device.type == "cuda":
            torch.cuda.set_rng_state(state, device)

    def parameter_mesh(self) -> Any:
        """The SPMD mesh `tu.fsdp` splits parameters over (its first axis), or None where
        parameters cannot be split over devices."""
        return None

    def zeros(self, shape) -> "torch.Tensor":
        """Zeros on the device, as data that later steps update in place."""
        import torch
        return torch.zeros(shape, device=self.device())

    # Collectives over replicas: identities with one replica.

    def all_reduce_sum(self, tensors: Sequence["torch.Tensor"]) -> List["torch.Tensor"]:
        """The sum of each tensor over replicas (new tensors)."""
        return list(tensors) if self.replicas == 1 else self._all_reduce_sum(list(tensors))

    def all_gather(self, tensor: "torch.Tensor") -> "torch.Tensor":
        """Every replica's `tensor`, concatenated along dim 0 in rank order."""
        return tensor if self.replicas == 1 else self._all_gather(tensor)

    def broadcast(self, tensors: Sequence["torch.Tensor"]) -> None:
        """Overwrite `tensors`, in place, with the master's values."""
        if self.replicas > 1 and tensors:
            import torch
            with torch.no_grad():
                self._broadcast(list(tensors))

    def barrier(self) -> None:
        """Wait until every replica gets here."""
        if self.replicas > 1:
            self._barrier()

    def average_in_place(self, tensors: Sequence["torch.Tensor"]) -> None:
        """Overwrite `tensors` (gradients), in place, with their mean over replicas."""
        if self.replicas > 1 and tensors:
            self._average_gradients(list(tensors))

    def __repr__(self) -> str:
        return f"<engine {self.name!r}: rank {self.rank} of {self.replicas}, world size {self.world_size}>"


class _ToDevice:
    """A loader's batches with every tensor moved to `device` (re-iterable)."""

    def __init__(self, loader, device):
        self.loader, self.device = loader, device

    def __iter__(self):
        for batch in self.loader:
            yield map_tensors(batch, lambda t: t.to(self.device, non_blocking=True))


def cores_error(info: "TpuInfo", cores: int) -> str:
    """The sentence for a core count this host does not have."""
    if info.has_xla or info.has_tpu:
        if info.num_devices == 1:
            one = f"TPU {info.accelerator} has one core" if info.has_tpu else "XLA:CPU with one device"
            return f"cores must be 1 on this host ({one}), got {cores!r}"
        where = (f"TPU {info.accelerator}" if info.has_tpu
                 else "XLA:CPU (set CPU_NUM_DEVICES to change)")
        return f"cores must be 1 or {info.num_devices} on this host ({where}), got {cores!r}"
    if info.cuda_devices < 2:
        one = "one CUDA GPU" if info.cuda_devices == 1 else "no GPU"
        return f"cores must be 1 on this host (no torch_xla, {one}: one device), got {cores!r}"
    return (f"cores must be 1 or {info.cuda_devices} on this host ({info.cuda_devices} CUDA "
            f"GPUs, no torch_xla: one process per GPU), got {cores!r}")
