"""The replica: what one copy of train_fn owns while it runs, and what is built on it.

A replica is a record: its engine (the backend: device, feed, collectives), the
heartbeat run's stall watch reads, the stop board its preemption agrees on, whether its
random streams were moved apart, and the weak sets of what it already made identical
across replicas. `run` makes one per replica and makes it current (`activate`, the only
writer of the one ContextVar); outside `run` each process has one of its own. The
per-replica operations (`optimizer_step`, `average_gradients`, `sync_module`) live here
because they read and write that record; the engine only supplies the collectives.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, Optional

from . import fused_step, memory, rng
from .checks import check_optimizer_device, check_parameters
from .engines import Engine, outside_run
from .host_bound import Span
from .in_place import as_copies
from .preemption import StopBoard
from .reads import ReadWatch

if TYPE_CHECKING:
    import torch
    from .stall import Beat

_CURRENT: ContextVar[Optional["Replica"]] = ContextVar("tpu_utility_replica", default=None)
WARM_STEPS = 2  # a check run's steps before its host clock starts: their graphs compile


class StepLimit(BaseException):
    """A check run's replica took its optimizer steps: unwinds train_fn (a BaseException,
    so the user's `except Exception` does not swallow it)."""


class Replica:
    """One replica's record: its engine and the state that belongs to it alone.

    Example (outside `run`, the process's own replica on one device):
        >>> from tpu_utility import replica
        >>> me = replica.current()
        >>> me.engine.replicas, me.rng_moved, me.heartbeat is None
        (1, False, True)
        >>> me.optimizer_step  # doctest: +ELLIPSIS
        <bound method Replica.optimizer_step of <replica of <engine ...>>>

    Args:
        engine: the backend this replica runs on.
        heartbeat: run's stall-watch slot for this replica's process, or None.
        board: the run's StopBoard, or None outside run (each checkpointing call then
            gets a fresh one: a SIGTERM handled once must not stop the next call).
        stop_after: for `check_functionalization`: raise StepLimit after this many
            optimizer steps, timing the host's tracing of each step that compiled nothing.
    """

    def __init__(self, engine: Engine, heartbeat: Optional["Beat"] = None,
                 board: Optional[StopBoard] = None, stop_after: Optional[int] = None):
        self.engine, self.heartbeat, self.board = engine, heartbeat, board
        # check_functionalization's run: stop after this many optimizer steps, timing
        # the host's tracing from the end of step WARM_STEPS on.
        self.stop_after, self.steps = stop_after, 0
        self._last_opt = None
        self._span: Optional[Span] = None
        self._timed = [0.0, 0]  # host seconds, steps timed
        self.rng_moved = False  # this replica's random streams moved apart (`offset_rng`)
        # Weak, so a model built later at a freed address is synced again; tensors keyed
        # by id because a tensor's == is elementwise.
        self._synced_opts: "weakref.WeakSet" = weakref.WeakSet()
        self._synced_tensors: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
        self._checked_opts: "weakref.WeakSet" = weakref.WeakSet()
        # optimizer: [train_one_cycle's running loss on the device, zeroed by an epoch's end]
        self._running_losses: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.reads = ReadWatch()  # the lines that read the device in the second step
        # tu.fsdp's parameters by id (weak: a k-fold loop's old models are freed) and splits
        self._splits: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
        self._split_ops: Dict[int, Any] = {}
        self._measured: "weakref.WeakSet" = weakref.WeakSet()
        self._models: "weakref.WeakSet" = weakref.WeakSet()  # sync_module's: the loops' models
        # optimizer: [(float32 copy it steps, the model's bfloat16 weight)] (tu.bf16_weights)
        self._masters: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.memory: Optional[memory.Memory] = None  # at the first optimizer's first step

    @property
    def owns_host_rng(self) -> bool:
        """Whether this replica moves the process's CPU generators: replica threads of one
        process (TPU v2/v3) share them, and the process's first moves them."""
        return self.engine.thread_index == 0

    def stop_board(self) -> StopBoard:
        """The run's StopBoard; outside `run`, a fresh one of this call's own."""
        return self.board if self.board is not None else StopBoard(1)

    def beat(self) -> None:
        """Progress (a batch arrived, a step was taken), for run's stall watch: one store."""
        if self.heartbeat is not None:
            self.heartbeat.beat()

    # -- random state --------------------------------------------------------------------------

    def capture_rng(self) -> Dict[str, Any]:
        """This replica's generators, and whether they were moved apart (for a checkpoint)."""
        return {**rng.capture(self.engine), "offset": self.rng_moved}

    def restore_rng(self, saved: Dict[str, Any]) -> None:
        """Put back what `capture_rng` returned. A checkpoint from before replicas drew
        apart (no "offset") continues as it was saved."""
        rng.restore(saved, self.engine)
        self.rng_moved = bool(saved.get("offset", True))

    def offset_rng(self) -> None:
        """Move this replica's random streams apart from the other replicas', once.

        Replicas start from one random state (forked, or seeded alike), so each would draw
        the same noise and dropout masks: a batch of 128 noise samples over 8 replicas
        would hold 16 distinct ones. Once the weights agree (the first broadcast), each
        replica of rank r > 0 reseeds from its states and r (`rng.offset_by_rank`); the
        master keeps its streams, so it draws what a one-device run draws.
        """
        engine = self.engine
        if engine.replicas > 1 and not self.rng_moved:
            self.rng_moved = True
            if engine.rank > 0:
                rng.offset_by_rank(engine.rank, engine, host=self.owns_host_rng)

    # -- train_one_cycle's running loss --------------------------------------------------------

    def running_loss(self, opt) -> "torch.Tensor":
        """The device scalar that train_one_cycle sums `opt`'s training losses in: the same
        tensor from call to call while each call's epochs end cleanly (an epoch's end zeroes
        it), else fresh zeros. Without functionalization torch_xla orders a graph's outputs
        by their tensors' age, so a fresh one, younger than the optimizer's state, made a
        second call's step a new graph to compile; a new optimizer (the next fold) gets a
        fresh one, younger than its state-to-be, as the first call had."""
        kept = self._running_losses.get(opt)
        if kept is None or not kept[1]:
            kept = self._running_losses[opt] = [self.engine.zeros(()), True]
        return kept[0]

    def running_loss_in_use(self, opt) -> None:
        """An epoch starts adding into it: not zero until the epoch's end says so."""
        self._running_losses[opt][1] = False

    def running_loss_zeroed(self, opt) -> None:
        self._running_losses[opt][1] = True

    # -- the optimizer step and weights made identical -----------------------------------------

    def optimizer_step(self, opt, closure: Optional[Callable] = None, **step_kwargs) -> Any:
        """`opt.step()` with the gradients averaged over replicas (`sync_gradients`).

        With a `closure` (LBFGS calls it several times a step) each call's gradients are
        averaged, and its loss too: LBFGS branches on `float(loss)`, and replicas that
        branched apart would call the closure, and so the collectives, a different number
        of times, and wait on each other for ever.
        """
        if not callable(getattr(opt, "step", None)) or not hasattr(opt, "param_groups"):
            raise TypeError(f"optimizer_step(opt): pass the torch optimizer, got "
                            f"{type(opt).__name__}")
        if closure is not None and not callable(closure):
            raise TypeError(f"optimizer_step(opt, closure): the closure must be a function that "
                            f"computes the loss and calls backward, got {type(closure).__name__}"
                            f" (for a plain step, call optimizer_step(opt))")
        masters = self._masters.get(opt)
        if closure is None:
            if masters:
                _gradients_to_masters(masters)
            self.sync_gradients(opt)
            if len(self._splits):
                self._split_like_parameters([p.grad for p in _params(opt)], _params(opt))
            device = self.engine.device()
            # A weight listed twice: torch's own in-place step updates it twice, as on CPU;
            # the fused step and the copies (as_copies) would write the same value twice.
            twice = _listed_twice(opt)
            if twice or step_kwargs or not fused_step.step(opt, device):
                with contextlib.nullcontext() if twice else as_copies(device):
                    out = opt.step(**step_kwargs)
            else:
                out = None  # what opt.step() returns without a closure
            self._measure(opt, device)
            if masters:
                _masters_to_weights(masters)
        else:
            if masters:
                raise TypeError("optimizer_step(opt, closure): an optimizer given to tu.bf16_weights "
                                "steps without a closure; step LBFGS-like optimizers in float32")
            if self.engine.replicas > 1:
                self._first_step(opt)
                closure = self._averaging(opt, closure)
            out = opt.step(self._cut_after(closure, opt), **step_kwargs)
        self.beat()
        self.reads.after_step()
        if self.stop_after is not None:
            self._count_step(opt)
        return out

    def shard_like(self, entries: Iterable[tuple]) -> None:
        """Keep the gradient and optimizer state of each (parameter, split) split as the
        parameter is (tu.fsdp's parameters), and its float32 copy, if it has one."""
        from .compat import mark_sharding
        copies = {id(w): m for pairs in self._masters.values() for m, w in pairs}
        for p, op in entries:
            self._splits[id(p)], self._split_ops[id(p)] = p, op
            master = copies.get(id(p))
            if master is not None:
                mark_sharding(master, op)
                self._splits[id(master)], self._split_ops[id(master)] = master, op

    def masters_of(self, opt) -> list:
        """(float32 copy, bfloat16 weight) pairs `opt` steps (tu.bf16_weights); [] if none."""
        return self._masters.get(opt, [])

    def keep_masters(self, opt, pairs: list) -> None:
        """Have `optimizer_step` step `opt`'s float32 copies of the model's bfloat16 weights:
        gradients moved to the copies before, the copies rounded into the weights after.
        A weight split by tu.fsdp before keeps its split, and its copy is split alike."""
        from .compat import mark_sharding, sharded
        self._masters[opt] = pairs
        for master, weight in pairs:
            if self._splits.get(id(weight)) is weight:
                op = self._split_ops[id(weight)]
                if not sharded(weight):  # model.to(bfloat16) gave it new, unannotated data
                    mark_sharding(weight, op)
                self.shard_like([(master, op)])

    def _split_like_parameters(self, tensors: list, params: list) -> None:
        """Annotate each tensor (a gradient, a state) shaped as its split parameter with
        the parameter's split; others (None, a step count) are left alone."""
        from .compat import mark_sharding
        for t, p in zip(tensors, params):
            if self._splits.get(id(p)) is p and getattr(t, "shape", None) == p.shape \
                    and t.device == p.device:
                mark_sharding(t, self._split_ops[id(p)])

    def _measure(self, opt, device) -> None:
        """After `opt`'s first step is traced and before it runs: its state split as its
        parameters are, the memory per device measured, and a run whose parameters,
        gradients and state alone exceed the device refused (`memory.check`)."""
        if opt in self._measured:
            return
        self._measured.add(opt)
        if len(self._splits):
            params = [p for p in _params(opt) if p in opt.state]
            for key in {k for p in params for k in opt.state[p]}:
                self._split_like_parameters([opt.state[p].get(key) for p in params], params)
        # the loops' models too: weights the optimizer does not hold (a head trained alone)
        # are on the device all the same, with their gradients
        # (a model the optimizer shares no weight with, an earlier fold's, is not this run's)
        mine = {id(p) for p in _params(opt)} | {id(w) for _, w in self._masters.get(opt, ())}
        models = [list(m.parameters()) for m in list(self._models)]
        others = [p for ps in models if any(id(p) in mine for p in ps) for p in ps
                  if p.device.type == device.type]
        measured = memory.measure(opt, device, masters=self._masters.get(opt, ()), others=others)
        if self.memory is None:
            self.memory = measured
            memory.note(measured)
        memory.check(measured)

    def _count_step(self, opt) -> None:
        self.steps += 1
        self._last_opt = opt
        if self._span is not None:  # from the last step's end to this one's
            host, _ = self._span.stop()
            if host is not None:  # None: a compile (an epoch's first end, a new shape)
                self._timed[0] += host
                self._timed[1] += 1
        if self.steps >= WARM_STEPS:  # the first steps' graphs compile: not timed
            self._span = Span()
        if self.steps >= self.stop_after:
            raise StepLimit(self.steps)

    def check_record(self) -> Dict[str, Any]:
        """For check_functionalization: the optimizer steps taken, the parameters of the
        last optimizer stepped (device tensors), and the host's tracing CPU per step over
        the steps after the first WARM_STEPS that compiled nothing (None if none)."""
        host, n = self._timed
        params = _params(self._last_opt) if self._last_opt is not None else []
        return {"steps": self.steps, "params": [p.detach() for p in params],
                "host_ms": 1e3 * host / n if n else None}

    def sync_gradients(self, opt) -> None:
        """What must happen before a step of `opt`: its gradients averaged over replicas.

        Before an optimizer's first step the master's values of its parameters are
        broadcast, so replicas that drew different initial weights (threads sharing one
        RNG, a seed per rank) train one model from then on. Before that, once per optimizer,
        its parameters must be on this replica's device (`checks.check_optimizer_device`).
        """
        self._check_device(opt)
        if self.engine.replicas > 1:
            self._first_step(opt)
            self._average(_params(opt), "optimizer_step")

    def average_gradients(self, params: Iterable["torch.Tensor"]) -> None:
        """`.grad` of `params` averaged over replicas, for an update written by hand; the
        first time a tensor comes by, every replica takes the master's value of it."""
        params = check_parameters(params, "average_gradients(params)")
        device = self.engine.device()
        if device.type != "cpu":  # checked each call: `params` is new each time
            check_optimizer_device(params, device, gradless_only=True)
        if self.engine.replicas > 1:
            self._make_identical(params)
            self._average(params, "average_gradients")
        self.beat()  # a hand-written step's gradients are ready: progress for the stall watch

    def sync_module(self, model) -> None:
        """Make `model`'s parameters and buffers the master's, on every replica (and then
        move the replicas' random streams apart, `offset_rng`). Its weights count in the
        memory measured at an optimizer's first step, held by the optimizer or not."""
        self._models.add(model)
        if self.engine.replicas > 1:
            tensors = list(model.parameters()) + list(model.buffers())
            self.engine.broadcast(tensors)
            self._synced_tensors.update((id(t), t) for t in tensors)
            self.offset_rng()

    def steps_per_parameter(self) -> bool:
        """Whether an optimizer may step parameter by parameter here: one this replica
        stepped has a group without foreach (foreach=False, or an optimizer with no foreach
        kernels), or it stepped none through tu (so it cannot tell)."""
        opts = list(self._checked_opts)
        return not opts or any(not g.get("foreach") for o in opts for g in o.param_groups)

    def _average(self, params: list, who: str) -> None:
        """The gradients of `params` averaged over replicas, in place.

        Every replica must reduce the same gradients: a parameter with a gradient on one
        replica and none on another (a branch taken on one replica only, `p.grad = None`)
        made gloo abort the process ("data size doesn't match"), or, where the sizes
        happened to agree, averaged one parameter's gradient into another's. Where the
        gradients are in host memory (gloo), each parameter that takes gradients is reduced
        (zeros where this replica has none) with a 0/1 flag of whether it had one, in the
        same collective as the gradients, so the check costs no extra exchange; the flags
        are then read for free. Elsewhere (NCCL, XLA) reading them would wait for the
        device each step, so there the gradients that exist are reduced as before.
        """
        engine = self.engine
        if engine.device().type != "cpu":
            engine.average_in_place(_grads(params))
            return
        import torch
        taking = [p for p in params if p.grad is not None or p.requires_grad]
        if not taking:
            return
        grads = [p.grad for p in taking]
        had = [g is not None for g in grads]
        if all(had):  # the common case; the flags ride in the last gradient's bucket
            flags = torch.ones(len(grads), dtype=grads[-1].dtype)
        else:
            grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, taking)]
            flags = torch.tensor(had, dtype=grads[-1].dtype)
        engine.average_in_place(grads + [flags])
        values = flags.tolist()
        if all(f == 1 for f in values):  # 1.0 exactly: every replica's flag was 1
            return
        # Else 0 where no replica had one (the zeros are dropped: it keeps no gradient, as
        # before), and between 0 and 1 where some had one and others not.
        mixed = [i for i, f in enumerate(values) if 0 < f < 1]
        if mixed:
            raise RuntimeError(_mixed_gradients(who, params, taking, mixed, had, engine.replicas))

    def _check_device(self, opt) -> None:
        """Once per optimizer, after a backward and before its first step: refuse one
        whose parameters are elsewhere than this device and got no gradient (it was made
        before `model.to(device)`); parameters with gradients elsewhere are trained there
        on purpose. On XLA, have it step with torch's foreach implementation where the
        user left `foreach` unset (`prefer_foreach`), its groups added later too."""
        device = self.engine.device()
        if opt not in self._checked_opts:
            if device.type != "cpu":
                check_optimizer_device(_params(opt), device, gradless_only=True)
            self._checked_opts.add(opt)
        if device.type == "xla":  # each step: a group added by add_param_group comes unset
            prefer_foreach(opt)

    def _first_step(self, opt) -> None:
        """Before `opt`'s first step: its parameters made the master's on every replica."""
        if opt not in self._synced_opts:
            _refuse_sparse(_params(opt), self.engine.replicas)
            self._make_identical(_params(opt))
            self._synced_opts.add(opt)

    def _make_identical(self, params) -> None:
        """The master's values broadcast into those of `params` not yet made identical."""
        tensors = self._synced_tensors
        self.engine.broadcast([p for p in params if tensors.get(id(p)) is not p])
        tensors.update((id(p), p) for p in params)
        self.offset_rng()

    def _cut_after(self, closure: Callable, opt) -> Callable:
        """`closure` followed by the step's cut: LBFGS evaluates it several times a step and
        reads each loss; uncut, each read runs a graph that holds every evaluation so far.
        The first call's backward is what `_check_device` needs."""
        def cut():
            loss = closure()
            # Without a backward the step changes nothing (LBFGS returns at once), silently.
            if all(p.grad is None for p in _params(opt)):
                raise RuntimeError("optimizer_step(opt, closure): the closure left no gradients: "
                                   "call loss.backward() inside it, after opt.zero_grad()")
            if loss is None and "LBFGS" in type(opt).__name__:
                raise TypeError("optimizer_step(opt, closure): LBFGS reads the loss the closure "
                                "returns, and it returned None: return the loss")
            self._check_device(opt)
            self.engine.sync()
            return loss
        return cut

    def _averaging(self, opt, closure: Callable) -> Callable:
        """`closure` whose gradients and loss come out averaged over replicas."""
        import torch
        engine = self.engine

        def averaged():
            loss = closure()
            self._average(_params(opt), "optimizer_step")
            if loss is None:
                return None
            value = (loss.detach() if torch.is_tensor(loss)
                     else torch.tensor(float(loss), device=engine.device()))
            (total,) = engine.all_reduce_sum([value])
            return total / engine.replicas if torch.is_tensor(loss) else float(total) / engine.replicas
        return averaged

    def __repr__(self) -> str:
        return f"<replica of {self.engine!r}>"


def prefer_foreach(opt) -> None:
    """Set `foreach=True` in the param groups of `opt` that left it unset (None), for
    optimizers that take it. torch picks its foreach kernels only on CUDA and CPU; on XLA
    the default steps parameter by parameter, and tracing that is most of a small model's
    host time per step (Adam about 0.5 ms per parameter tensor). With foreach the whole
    step took 0.72-0.79x of the host CPU inside train_one_cycle, with bit-equal results
    (XLA_NOTES.md). Groups with `fused`, `capturable` or `differentiable` set are left
    alone (torch refuses foreach with them on XLA), as is an explicit `foreach=False`, and
    groups with a tensor among their numbers (`lr=torch.tensor(0.01)`: torch's foreach
    step refuses a tensor lr without `capturable`). An optimizer that lists a weight twice
    is left as it is: torch's foreach and per-parameter steps update such a weight
    differently, and the CPU takes the per-parameter one."""
    if "foreach" not in getattr(opt, "defaults", {}) or _listed_twice(opt):
        return  # LBFGS, SparseAdam, an optimizer of the user's own
    for group in opt.param_groups:
        if group.get("foreach", False) is None and not any(
                group.get(k) for k in ("fused", "capturable", "differentiable")) and not any(
                _holds_tensor(v) for k, v in group.items() if k != "params"):
            group["foreach"] = True


def _refuse_sparse(params: list, replicas: int) -> None:
    sparse = next((i for i, p in enumerate(params) if p.grad is not None and p.grad.is_sparse), None)
    if sparse is not None:
        raise ValueError(f"optimizer_step: parameter {sparse} (shape {list(params[sparse].shape)}) "
                         f"has a sparse gradient (nn.Embedding(sparse=True)), which cannot be "
                         f"averaged over the {replicas} replicas: make the embedding with "
                         f"sparse=False (and Adam in place of SparseAdam), or run on one core")


def _holds_tensor(value) -> bool:
    import torch
    return isinstance(value, torch.Tensor) or (
        isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value))


def _listed_twice(opt) -> bool:
    """Whether a parameter appears more than once in `opt`'s groups (a tied weight listed
    twice): torch then updates it once per listing."""
    n = sum(len(g["params"]) for g in opt.param_groups)
    return n > 1 and len({id(p) for g in opt.param_groups for p in g["params"]}) < n


def _gradients_to_masters(pairs: list) -> None:
    """Each bfloat16 weight's gradient, in float32, as its copy's; the weight's dropped (a
    temporary of the step, not kept beside the copy's)."""
    for master, weight in pairs:
        if weight.grad is not None:
            master.grad = weight.grad.to(master.dtype)
            weight.grad = None


def _masters_to_weights(pairs: list) -> None:
    """The stepped copies rounded into the weights; the copies' gradients dropped."""
    import torch
    with torch.no_grad():
        for master, weight in pairs:
            weight.copy_(master)
            master.grad = None


def _params(opt) -> list:
    """`opt`'s parameters, each once (a parameter listed twice is averaged once)."""
    every = [p for g in opt.param_groups for p in g["params"]]
    return list({id(p): p for p in every}.values()) if _listed_twice(opt) else every


def _grads(params) -> list:
    return [p.grad for p in params if p.grad is not None]


def _mixed_gradients(who: str, params: list, taking: list, mixed: list, had: list,
                     replicas: int) -> str:
    """The sentence for parameters with a gradient on some replicas and not on others."""
    place = {id(p): i for i, p in enumerate(params)}
    named = ", ".join(
        f"parameter {place[id(taking[i])]} (shape {list(taking[i].shape)}, "
        f"{'a gradient' if had[i] else 'no gradient'} on this replica)" for i in mixed[:5])
    more = f" and {len(mixed) - 5} more" if len(mixed) > 5 else ""
    return (f"{who}: {named}{more} got a gradient on some of the {replicas} replicas and not on "
            f"the others, so their gradients cannot be averaged: use every parameter in the "
            f"forward pass of every replica, or give an unused one zeros "
            f"(p.grad = torch.zeros_like(p)) before averaging")


@contextlib.contextmanager
def activate(replica: Replica) -> Iterator[Replica]:
    """Make `replica` the calling one (this thread, this context) inside the block: what
    `run` does for each replica it starts.

    Example:
        >>> from tpu_utility import replica
        >>> from tpu_utility.engines.local import Local
        >>> with replica.activate(replica.Replica(Local())) as r:
        ...     replica.current() is r, replica.in_run()
        (True, True)
        >>> replica.in_run()
        False

    Args:
        replica: the record to make current.
    """
    token = _CURRENT.set(replica)
    try:
        yield replica
    finally:
        replica.reads.close()  # train_fn may have ended inside the watched step
        _CURRENT.reset(token)


def current() -> Replica:
    """The calling replica; outside `run`, this process's one replica on one device
    (the same record at every call, so a loader iterated at the top level keeps its epoch).

    Example:
        >>> from tpu_utility import replica
        >>> replica.current() is replica.current()
        True
    """
    replica = _CURRENT.get()
    return replica if replica is not None else _outside_run()


def in_run() -> bool:
    """Whether the caller is a replica inside `run` (see `activate` for an example)."""
    return _CURRENT.get() is not None


@functools.lru_cache(maxsize=None)
def _outside_run() -> Replica:
    # One per process, so a loader iterated at the top level keeps its epoch.
    return Replica(outside_run())
