"""The `Engine` interface that every engine implements, and what all engines share."""
from __future__ import annotations

import contextlib
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional,
                    Sequence, Tuple)

from .._tree import map_tensors
from ..checks import check_optimizer_device

if TYPE_CHECKING:
    import torch
    from ..environment import TpuInfo


class Engine:
    """One replica's view of the run, plus (classmethods) how the parent starts replicas.

    `world_size` is the data-parallel width (devices that share each global batch: what
    `scale_lr_bs` scales by); `replicas` is how many copies of train_fn run, each on its
    own slice of the data; `rank` is this copy's index, 0 being the master. Single-replica
    engines inherit the identity collectives below; multi-replica engines supply the
    primitives (`_all_reduce_sum`, `_all_gather`, `_broadcast`, `_barrier`,
    `_average_gradients(grads)`, in place), and everything built on them is shared.
    """

    name: str = ""
    start_methods: Tuple[str, ...] = ("fork", "spawn")  # how its child processes may start
    world_size: int = 1
    replicas: int = 1
    rank: int = 0
    local_replicas: int = 1  # replicas on this host, which share its CPU cores
    heartbeat: Any = None  # set by run in each replica: stall.Beat, or None (no stall watch)
    rng_offset_applied: bool = False  # this replica's random streams moved apart (`offset_rng`)
    owns_host_rng: bool = True  # False: a replica thread whose CPU generators another owns

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
        child's `start` receives (picklable)."""
        yield None

    @classmethod
    def start(cls, setup: Any, local_rank: int, nprocs: int, cores: int,
              body: Callable[["Engine"], None]) -> None:
        """In child process `local_rank` of `nprocs`: initialise, then `body(engine)` per replica."""
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

    def beat(self) -> None:
        """Progress (a batch arrived, a step was taken), for run's stall watch: one store."""
        if self.heartbeat is not None:
            self.heartbeat.beat()

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

    # Built on the collectives, the same for every engine.

    def optimizer_step(self, opt, closure: Optional[Callable] = None, **step_kwargs) -> Any:
        """`opt.step()` with the gradients averaged over replicas (`sync_gradients`).

        With a `closure` (LBFGS calls it several times a step) each call's gradients are
        averaged, and its loss too: LBFGS branches on `float(loss)`, and replicas that
        branched apart would call the closure, and so the collectives, a different number
        of times, and wait on each other for ever.
        """
        if closure is None:
            self.sync_gradients(opt)
            out = opt.step(**step_kwargs)
        else:
            if self.replicas > 1:
                self._first_step(opt)
                closure = self._averaging(opt, closure)
            out = opt.step(self._cut_after(closure, opt), **step_kwargs)
        self.beat()
        return out

    def sync_gradients(self, opt) -> None:
        """What must happen before a step of `opt`: its gradients averaged over replicas.

        Before an optimizer's first step the master's values of its parameters are
        broadcast, so replicas that drew different initial weights (threads sharing one
        RNG, a seed per rank) train one model from then on. Before that, once per optimizer,
        its parameters must be on this replica's device (`checks.check_optimizer_device`).
        """
        self._check_device(opt)
        if self.replicas > 1:
            self._first_step(opt)
            self._average_grads_of(_params(opt))

    def average_gradients(self, params: Iterable["torch.Tensor"]) -> None:
        """`.grad` of `params` averaged over replicas, for an update written by hand; the
        first time a tensor comes by, every replica takes the master's value of it."""
        params = list(params)
        if self.device().type != "cpu":  # checked each call: `params` is new each time
            check_optimizer_device(params, self.device(), gradless_only=True)
        if self.replicas > 1:
            self._make_identical(params)
            self._average_grads_of(params)

    def sync_module(self, model) -> None:
        """Make `model`'s parameters and buffers the master's, on every replica (and then
        move the replicas' random streams apart, `offset_rng`)."""
        if self.replicas > 1:
            tensors = list(model.parameters()) + list(model.buffers())
            self.broadcast(tensors)
            self._synced()[1].update((id(t), t) for t in tensors)
            self.offset_rng()

    def offset_rng(self) -> None:
        """Move this replica's random streams apart from the other replicas', once.

        Replicas start from one random state (forked, or seeded alike), so each would draw
        the same noise and dropout masks: a batch of 128 noise samples over 8 replicas
        would hold 16 distinct ones. Once the weights agree (the first broadcast), each
        replica of rank r > 0 reseeds from its states and r (`rng.offset_by_rank`); the
        master keeps its streams, so it draws what a one-device run draws.
        """
        if self.replicas > 1 and not self.rng_offset_applied:
            self.rng_offset_applied = True
            if self.rank > 0:
                from .. import rng
                rng.offset_by_rank(self.rank, self, host=self.owns_host_rng)

    def _check_device(self, opt) -> None:
        """Once per optimizer, after a backward and before its first step: refuse one
        whose parameters are elsewhere than this device and got no gradient (it was made
        before `model.to(device)`); parameters with gradients elsewhere are trained there
        on purpose."""
        checked = self._synced()[2]
        if opt not in checked:
            if self.device().type != "cpu":
                check_optimizer_device(_params(opt), self.device(), gradless_only=True)
            checked.add(opt)

    def _first_step(self, opt) -> None:
        """Before `opt`'s first step: its parameters made the master's on every replica."""
        opts = self._synced()[0]
        if opt not in opts:
            self._make_identical(_params(opt))
            opts.add(opt)

    def _make_identical(self, params) -> None:
        """The master's values broadcast into those of `params` not yet made identical."""
        tensors = self._synced()[1]
        self.broadcast([p for p in params if tensors.get(id(p)) is not p])
        tensors.update((id(p), p) for p in params)
        self.offset_rng()

    def _average_grads_of(self, params) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            self._average_gradients(grads)

    def _cut_after(self, closure: Callable, opt) -> Callable:
        """`closure` followed by the step's cut: LBFGS evaluates it several times a step and
        reads each loss; uncut, each read runs a graph that holds every evaluation so far.
        The first call's backward is what `_check_device` needs."""
        def cut():
            loss = closure()
            self._check_device(opt)
            self.sync()
            return loss
        return cut

    def _averaging(self, opt, closure: Callable) -> Callable:
        """`closure` whose gradients and loss come out averaged over replicas."""
        import torch

        def averaged():
            loss = closure()
            self._average_grads_of(_params(opt))
            if loss is None:
                return None
            value = (loss.detach() if torch.is_tensor(loss)
                     else torch.tensor(float(loss), device=self.device()))
            (total,) = self._all_reduce_sum([value])
            return total / self.replicas if torch.is_tensor(loss) else float(total) / self.replicas
        return averaged

    def _synced(self):
        """(optimizers, {id: tensor}) already made identical on every replica, and the
        optimizers whose device was checked. Weak, so a model built later at a freed
        address is synced again; keyed by id because a tensor's == is elementwise."""
        if "_synced_state" not in self.__dict__:
            import weakref
            self._synced_state = (weakref.WeakSet(), weakref.WeakValueDictionary(),
                                  weakref.WeakSet())
        return self._synced_state

    def __repr__(self) -> str:
        return f"<engine {self.name!r}: rank {self.rank} of {self.replicas}, world size {self.world_size}>"


def _params(opt) -> list:
    return [p for g in opt.param_groups for p in g["params"]]


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
