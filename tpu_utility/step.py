"""The optimizer step over replicas: `tu.optimizer_step`, `tu.average_gradients`, and what
they keep for each replica.

Before an optimizer's first step its parameters are made the master's on every replica
(the replica's record makes them identical); each step averages the gradients over
replicas, then steps with fused_step.py's one computation where it applies, else with
torch's own step, its in-place updates traced as copies (in_place.py). What a replica's
steps keep (the optimizers checked, tu.fsdp's splits, tu.bf16_weights' float32 copies, the
memory measured at the first step) is a `Steps` of that replica's, made here, written here
alone, and asked for with `of(replica)`.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Optional

from . import fused_step, memory
from .checks import check_optimizer_device, check_parameters
from .in_place import as_copies
from .replica import Replica, current

if TYPE_CHECKING:
    import torch

_STEPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Replica: its Steps


def of(me: Optional[Replica] = None) -> "Steps":
    """The steps of replica `me` (the calling one by default), made at its first ask."""
    me = current() if me is None else me
    steps = _STEPS.get(me)
    if steps is None:
        steps = _STEPS[me] = Steps(me)
    return steps


class Steps:
    """One replica's optimizer steps, and what they keep.

    Example (outside `run`, the process's own replica on one device):
        >>> from tpu_utility import replica, step
        >>> step.of() is step.of(replica.current())
        True

    Args:
        me: the replica whose steps these are.
    """

    def __init__(self, me: Replica):
        self.me, self.engine = me, me.engine
        self._checked_opts: "weakref.WeakSet" = weakref.WeakSet()
        # tu.fsdp's parameters by id (weak: a k-fold loop's old models are freed) and splits
        self._splits: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
        self._split_ops: Dict[int, Any] = {}
        self._measured: "weakref.WeakSet" = weakref.WeakSet()
        # optimizer: [(float32 copy it steps, the model's bfloat16 weight)] (tu.bf16_weights)
        self._masters: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.memory: Optional[memory.Memory] = None  # at the first optimizer's first step

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
        self.me.compiles.before_cut(lambda: _params(opt))
        if not self.me.feeding and self.me.on_cut is None:
            # No make_loader feed cuts this loop's steps (batches moved with .to(device),
            # made on the device): the step ends here, or its graph would grow step after
            # step, a new program each. A plan (on_cut) ends its steps itself. (An
            # MpDeviceLoader of the user's then skips its own cut, as after tu.sync().)
            self.engine.sync()
        self.me.beat()
        self.me.reads.after_step()
        self.me.compiles.after_step()
        if self.me.on_step is not None:  # check_functionalization's count
            self.me.on_step(opt)
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
        self._masters[opt] = pairs
        self.split_copies(pairs)

    def split_copies(self, pairs: list) -> None:
        """Each (copy, weight) pair's copy split as tu.fsdp split its weight, if it did."""
        from .compat import mark_sharding, sharded
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

    def split_state(self, opt) -> None:
        """Annotate `opt`'s state tensors with their parameters' tu.fsdp splits: once after
        its first step, and again where a plan splits the weights of a running step."""
        if len(self._splits):
            params = [p for p in _params(opt) if p in opt.state]
            for key in {k for p in params for k in opt.state[p]}:
                self._split_like_parameters([opt.state[p].get(key) for p in params], params)

    def measured(self, opt, device) -> memory.Memory:
        """`opt`'s parameters, gradients and state, in bytes per device, as they are now."""
        # the loops' models too: weights the optimizer does not hold (a head trained alone)
        # are on the device all the same, with their gradients
        # (a model the optimizer shares no weight with, an earlier fold's, is not this run's)
        mine = {id(p) for p in _params(opt)} | {id(w) for _, w in self._masters.get(opt, ())}
        models = [list(m.parameters()) for m in list(self.me.synced_models)]
        others = [p for ps in models if any(id(p) in mine for p in ps) for p in ps
                  if p.device.type == device.type]
        return memory.measure(opt, device, masters=self._masters.get(opt, ()), others=others)

    def _measure(self, opt, device) -> None:
        """After `opt`'s first step is traced and before it runs: its state split as its
        parameters are, the memory per device measured, and a run whose parameters,
        gradients and state alone exceed the device refused (`memory.check`)."""
        if opt in self._measured:
            return
        self._measured.add(opt)
        self.split_state(opt)
        measured = self.measured(opt, device)
        if self.memory is None:
            self.memory = measured
            memory.note(measured)
        memory.check(measured)

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
            self.me.make_identical(params)
            self._average(params, "average_gradients")
        self.me.beat()  # a hand-written step's gradients are ready: progress for the stall watch

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
        if not self.me.synced(opt):
            _refuse_sparse(_params(opt), self.engine.replicas)
            self.me.make_identical(_params(opt), owner=opt)

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
        return f"<steps of {self.me!r}>"


def prefer_foreach(opt) -> None:
    """Set `foreach=True` in the param groups of `opt` that left it unset (None), for
    optimizers that take it. torch picks its foreach kernels only on CUDA and CPU; on XLA
    the default steps parameter by parameter, and tracing that is most of a small model's
    host time per step. With foreach the whole step takes less of the host's CPU, with
    bit-equal results (docs/measured.md#the-optimizer-steps-host-cpu). Groups with `fused`, `capturable` or `differentiable` set are left
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
    temporary of the step, not kept beside the copy's). A weight written since the last
    step (`load_state_dict` after tu.bf16_weights, `p.data.copy_`) gives its copy its new
    value; a weight the last step wrote is its copy rounded, and the copy keeps the bits
    below the rounding (an elementwise test traced into the step: no read, no compile)."""
    import torch
    with torch.no_grad():
        for master, weight in pairs:
            master.copy_(torch.where(weight == master.to(weight.dtype), master,
                                     weight.to(master.dtype)))
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
