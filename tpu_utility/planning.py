"""Plan a run for the TPU it will run on, from any host: the user's step, compiled by that
TPU's own compiler, tells whether it fits and how fast it could go.

`TPU_UTILITY_TARGET=v5e-8` (or `tu.plan(train_fn, target="v5e-8")`) runs train_fn as `run`
would, with the engine's shardings, and traces its optimizer steps without running them:
- the first step is traced, then every tensor it left pending is made data without
  running it (`compat.settle`): a large one a placeholder with no buffer, so this host
  holds no copy of a large model's weights or optimizer state, a small one zeros (a
  `loss.item()` after the step reads 0.0);
- the second step, the steady state with the optimizer's state in place, is the program
  planned: everything its cut would compute, with the buffers it would donate, handed to
  libtpu's compiler for the target's chips (tpu_compile.py, in a child process);
- a step ends at the first optimizer's step, or, in a loop of several optimizers, where
  the run cuts its graph (`_Capture`);
- where it does not fit, the fixes are applied to the running step one by one, each
  traced in the next step and compiled in turn: `tu.fsdp` on the model (more than one
  chip), then gradient checkpointing (a model that has `gradient_checkpointing_enable`).

What comes back (`Plan`) is the compiler's per-chip memory (its buffer assignment; the
error in its own words where it refuses) and its FLOPs and bytes, with the roofline's
bound on step time at the chip's published peaks: compiled estimates, not measurements.
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, List, Mapping, Optional, Tuple

TARGET_VAR = "TPU_UTILITY_TARGET"
GiB = 2 ** 30


@dataclass(frozen=True)
class Target:
    """A TPU to plan for: its topology as the compiler names it, its chips (one device
    each), and a chip's HBM and published bf16 and HBM-bandwidth peaks (Cloud TPU's
    system-architecture pages: v5e 197 TFLOP/s, 819 GB/s, 16 GiB; v6e 918 TFLOP/s,
    1,640 GB/s, 32 GiB; v4 275 TFLOP/s, 1,200 GB/s, 32 GiB).

    Example:
        >>> TARGETS["v5e-8"].chips, TARGETS["v5e-8"].topology(1)
        (8, 'v5e:1x1')
    """

    name: str
    generation: str  # as the topology names it: "v5e", "v6e", "v4"
    layout: str  # the whole slice's chips: "2x4"
    chips: int
    hbm: int  # bytes a chip
    bf16_flops: float  # a chip's peak, FLOP/s
    hbm_bandwidth: float  # a chip's, bytes/s
    capped: bool = False  # `hbm` is a limit the user set, below the chip's

    def with_hbm(self, limit: Optional[int]) -> "Target":
        """This target with at most `limit` bytes of HBM a chip for the compiler (headroom
        for what the runtime holds besides the step); None: the chip's own."""
        if limit is None:
            return self
        return replace(self, hbm=int(limit), capped=True)

    def topology(self, devices: int) -> str:
        """The compiler's name for `devices` chips of this kind: the slice, or one chip."""
        if devices == self.chips:
            return f"{self.generation}:{self.layout}"
        return f"{self.generation}:" + ("1x1x1" if self.generation == "v4" else "1x1")

    @property
    def megacore(self) -> bool:
        """A v4 chip is one device of two cores (jax and torch_xla alike)."""
        return self.generation == "v4"


def _t(name, gen, layout, chips, hbm_gib, tflops, gbs) -> Target:
    return Target(name, gen, layout, chips, hbm_gib * GiB, tflops * 1e12, gbs * 1e9)


TARGETS = {t.name: t for t in (
    _t("v5e-1", "v5e", "1x1", 1, 16, 197, 819), _t("v5e-4", "v5e", "2x2", 4, 16, 197, 819),
    _t("v5e-8", "v5e", "2x4", 8, 16, 197, 819), _t("v6e-1", "v6e", "1x1", 1, 32, 918, 1640),
    _t("v6e-4", "v6e", "2x2", 4, 32, 918, 1640), _t("v6e-8", "v6e", "2x4", 8, 32, 918, 1640),
    _t("v4-8", "v4", "2x2x1", 4, 32, 275, 1200))}


def target(name: str, named: str = "target") -> Target:
    """The Target called `name` ("v5e-8"); a ValueError names the ones there are."""
    found = TARGETS.get(str(name).strip().lower())
    if found is None:
        raise ValueError(f"{named}={name!r} is not a TPU tpu_utility plans for: name one of "
                         f"{', '.join(TARGETS)}")
    return found


def from_env(env: Mapping[str, str] = os.environ) -> Optional[Target]:
    """The Target TPU_UTILITY_TARGET names, or None where it is unset or empty."""
    value = env.get(TARGET_VAR, "").strip()
    return target(value, TARGET_VAR) if value else None


def devices_for(tgt: Target, cores: int, named: str = "target") -> int:
    """The chips a run of `cores` plans over: 1, or every chip of the target."""
    if cores == 1:
        return 1
    if cores in (tgt.chips, 8):  # run(cores=8), as a Kaggle script says, plans all its chips
        return tgt.chips
    raise ValueError(f"{named}={tgt.name} has {tgt.chips} chip(s), and run(cores={cores}) "
                     f"asks for {cores}: plan cores=1 or cores={tgt.chips}")


def _size(n: Optional[float]) -> str:
    from .memory import size_text
    return size_text(int(n)) if n is not None else "?"


def _hbm(n: int) -> str:
    """HBM as chips are sold: in GiB (MiB below one)."""
    return f"{n / GiB:.3g} GiB" if n >= GiB else f"{n / 2 ** 20:.3g} MiB"


@dataclass(frozen=True)
class Compiled:
    """One configuration of the step, as the TPU compiler laid it out on each chip.

    Bytes are per chip: `parameters`, `gradients` and `optimizer` counted from the
    tensors' shapes and splits; the rest are the compiler's (`peak` its buffer
    assignment's, with arguments, outputs less those sharing an input's buffer, and
    temporaries; `code` the program itself, outside the peak). `error`: the compiler's
    refusal, in its words (None: it fits). `rows`: the global batch a step reads."""

    config: str
    parameters: int
    gradients: int
    optimizer: int
    rows: Optional[int] = None
    peak: Optional[int] = None
    argument: Optional[int] = None
    output: Optional[int] = None
    alias: Optional[int] = None
    temp: Optional[int] = None
    code: Optional[int] = None
    flops: Optional[float] = None
    bytes_accessed: Optional[float] = None
    error: Optional[str] = None

    @property
    def fits(self) -> bool:
        return self.error is None

    def step_seconds(self, tgt: Target) -> Optional[float]:
        """The roofline's bound: no step is faster than its FLOPs at the bf16 peak or its
        bytes at the HBM bandwidth (float32 matmuls run well below the bf16 peak)."""
        if self.flops is None or self.bytes_accessed is None:
            return None
        return max(self.flops / tgt.bf16_flops, self.bytes_accessed / tgt.hbm_bandwidth)


@dataclass(frozen=True, repr=False)
class Plan:
    """What the target's compiler says of a run's steady-state step: `steps[0]` as
    written, then each fix tried (cumulative) where that did not fit.

    Example:
        >>> p = Plan(TARGETS["v5e-8"], 8, (Compiled("as written", 4, 4, 8, rows=16,
        ...          peak=10 ** 6, flops=2e9, bytes_accessed=1e6),))
        >>> p.fits, p.fix is None, round(p.steps[0].step_seconds(p.target) * 1e6, 2)
        (True, True, 10.15)
    """

    target: Target
    devices: int
    steps: Tuple[Compiled, ...]
    notes: Tuple[str, ...] = field(default=())

    @property
    def fits(self) -> bool:
        return bool(self.steps) and self.steps[0].fits

    @property
    def fix(self) -> Optional[Compiled]:
        """The first fix that compiled within HBM where the step as written did not."""
        if self.fits:
            return None
        return next((s for s in self.steps[1:] if s.fits), None)

    def __str__(self) -> str:
        from . import memory
        t = self.target
        where = f"{self.devices} of its {t.chips} chips" if self.devices != t.chips else \
            f"{t.chips} chip{'s' if t.chips > 1 else ''}"
        hbm = f"{_hbm(t.hbm)} HBM each" + (f" at most, {memory.LIMIT_ENV}" if t.capped else "")
        lines = [f"tpu_utility plan for TPU {t.name} ({where}, {hbm}): "
                 f"the TPU compiler's figures per chip (libtpu, compiled here; times are "
                 f"roofline bounds, not measurements)"]
        for s in self.steps:
            lines.append(f"  {s.config}: " + ("fits" if s.fits else "does not fit") +
                         f"; parameters {_size(s.parameters)}, gradients {_size(s.gradients)}, "
                         f"optimizer state {_size(s.optimizer)}")
            if not s.fits:
                lines.append(f"    the compiler: {s.error}")
                continue
            lines.append(f"    compiled peak {_size(s.peak)} of {_hbm(t.hbm)} "
                         f"({100 * (s.peak or 0) / t.hbm:.1f}%): arguments {_size(s.argument)}, "
                         f"outputs {_size((s.output or 0) - (s.alias or 0))} beyond them, "
                         f"temporaries {_size(s.temp)}; program {_size(s.code)}")
            seconds = s.step_seconds(t)
            if seconds is not None:
                bound = "compute" if s.flops / t.bf16_flops >= s.bytes_accessed / t.hbm_bandwidth \
                    else "HBM bandwidth"
                rate = f", at most {s.rows / seconds:,.0f} samples/s" if s.rows else ""
                lines.append(f"    {s.flops:.3g} FLOPs and {_size(s.bytes_accessed)} moved a "
                             f"step per chip: at least {seconds * 1e3:.3g} ms a step ({bound}-"
                             f"bound at {t.bf16_flops / 1e12:.0f} bf16 TFLOP/s and "
                             f"{t.hbm_bandwidth / 1e9:,.0f} GB/s){rate}")
        if not self.fits:
            fix = self.fix
            lines.append(f"  fix: {fix.config[2:].replace(' + ', ' and ')}" if fix else
                         "  no fix tried fits: use a smaller batch or sequence, or a larger TPU")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    __repr__ = __str__  # a notebook shows the plan, not its fields


class _Done(BaseException):
    """Planning is over: unwinds train_fn (a BaseException, so that a user's
    `except Exception` around the loop does not swallow it)."""


class Planned:
    """`train_fn` traced for a plan instead of trained; returns the `Plan`. A class, not a
    closure, so that spawned replicas can unpickle it.

    Args:
        train_fn: the user's function.
        target: the TPU planned for.
        devices: its chips this run plans over (1, or all).
        fixes: try the fixes where the step does not fit.
    """

    def __init__(self, train_fn: Callable[..., Any], tgt: Target, devices: int, fixes: bool = True):
        self.train_fn, self.target, self.devices, self.fixes = train_fn, tgt, devices, fixes

    def __call__(self, *args) -> Plan:
        from .memory import LIMIT_ENV
        from .replica import current
        # In this replica's process: the compiler judges the memory against the target's
        # HBM (capped by this variable in the caller), not XLA:CPU's check of the tensors.
        os.environ.pop(LIMIT_ENV, None)
        me = current()
        capture = _Capture(self.target, self.devices, me)
        if not self.fixes:
            capture.fixes = []
        me.on_step, me.on_cut = capture.stepped, capture.cut
        try:
            self.train_fn(*args)
        except _Done:
            pass
        finally:
            me.on_step = me.on_cut = None
            from .compat import forget_placeholders
            forget_placeholders()
        return capture.plan()


class _Capture:
    """At each step's end: settles the first, compiles the later ones, applies the next fix
    while the step does not fit.

    A step ends at each step of the loop's first optimizer, so that what the loop reads
    after it (`loss.item()`) is settled data, not a program run here. A loop of several
    optimizers (a GAN's) is seen at the first step of another: from then on a step ends
    where the run cuts its graph, before each batch of a make_loader feed
    (`Replica.on_cut`), or else at the first optimizer's next step, so that the program
    planned holds every optimizer's step, as the run's does."""

    def __init__(self, tgt: Target, devices: int, me):
        self.target, self.devices, self.me = tgt, devices, me
        self.steps = 0
        self.first = None  # the first optimizer stepped
        self.several = False  # another optimizer steps in the same loop
        self.fed = False  # a make_loader feed cuts this loop's steps
        self.since_cut = False  # an optimizer stepped since the last step's end
        self.compiled: List[Compiled] = []
        self.fixes: Optional[List[Tuple[str, Callable]]] = None
        self.notes: List[str] = []
        self.config = "as written"
        self.held: set = set()  # torch_xla's ids of what the step kept, as the next step starts
        # Whether gradients outlive the run's cut (a loop that zeroes them before backward,
        # or not to None): None until a cut after a step shows it.
        self.grads_kept: Optional[bool] = None

    def stepped(self, opt) -> None:
        if self.first is None:
            self.first = opt
        self.since_cut = True
        if opt is not self.first:
            if not self.several:  # what was counted held one optimizer's step: count anew
                self.several, self.steps = True, 0
            return
        if not (self.several and self.fed):
            self._end_step(opt)

    def cut(self) -> None:
        from .compat import settle
        self.fed = True
        if self.steps and self.grads_kept is None:
            self.grads_kept = any(p.grad is not None for g in self.first.param_groups
                                  for p in g["params"])
        if self.several and self.since_cut:
            self._end_step(self.first)
        # What the loop left pending between steps (a model made on the device, a running
        # sum) is settled, not run by the cut: nothing of it would be planned.
        settle(_pending_tensors())

    def _end_step(self, opt) -> None:
        self.since_cut = False
        self.steps += 1
        if self.steps > 1 and not _pending_tensors():
            self.notes.append("the step had already run when it ended (a tu.sync() or "
                              "torch_xla.sync() inside it): nothing was left to plan")
            raise _Done
        if self.steps > 1:
            self.compiled.append(self._compile(opt))
            if self.fixes is None:
                self.fixes = _fixes(opt, self.me)
            if self.compiled[-1].fits or not self.fixes:
                raise _Done
        from .compat import settle
        settle(_pending_tensors())
        try:
            self._next_fix()
        finally:
            # A tensor's id moves with each update (functionalization): the next step's
            # program names the ids its weights and state hold now.
            self.held = _held_ids(opt, self.me)

    def _next_fix(self) -> None:
        while self.steps > 1 and self.fixes:
            label, apply = self.fixes.pop(0)
            try:
                apply()
            except Exception as e:  # the plan so far is kept; the fix is named as not applied
                self.notes.append(f"{label} could not be applied here ({type(e).__name__}: {e})")
                continue
            # cumulative: each fix is tried on top of the ones before it
            self.config = (f"{self.config} + " if self.config != "as written" else "+ ") + label
            return
        if self.steps > 1:
            raise _Done

    def _compile(self, opt) -> Compiled:
        from . import step, tpu_compile
        from .compat import pending_program
        outputs = _pending_tensors()
        if self.grads_kept is False:
            # The run's cut comes after the loop's zero_grad(), so a step's gradients are
            # the program's temporaries, not outputs it keeps (planning ends the step
            # earlier, at the optimizer's step, where they are still alive).
            grads = {id(p.grad) for m in _models(opt) for p in m.parameters() if p.grad is not None}
            grads |= {id(p.grad) for g in opt.param_groups for p in g["params"] if p.grad is not None}
            outputs = [t for t in outputs if id(t) not in grads]
        text, donors, inputs = pending_program(outputs)
        held = self.held | _held_ids(opt, self.me)
        batch = [t for tid, t in inputs if tid not in held and t.dim() > 0]
        mem = step.of(self.me).measured(opt, self.me.engine.device())
        self.me.beat()
        out = tpu_compile.compile_in_child(text, self.target.topology(self.devices), donors,
                                           megacore=self.target.megacore,
                                           one_chip=self.devices == 1,
                                           hbm_mib=self.target.hbm // 2 ** 20 if self.target.capped else None)
        self.me.beat()
        fields = ("peak", "argument", "output", "alias", "temp", "code", "flops",
                  "bytes_accessed", "error")
        return Compiled(self.config, mem.parameters, _gradient_bytes(opt, self.me), mem.optimizer,
                        rows=_rows(batch),
                        **{k: out[k] for k in fields if k in out})

    def plan(self) -> Plan:
        notes = list(self.notes)
        if not self.compiled and not notes:
            notes.append(f"train_fn took {self.steps} optimizer step(s) through "
                         f"tu.optimizer_step and a plan needs 2 (the second is the steady "
                         f"state): let it run at least 2")
        elif not self.compiled[-1].fits and len(self.compiled) > 1 and self.fixes:
            notes.append(f"train_fn ended before the remaining fixes were tried: "
                         f"{', '.join(label for label, _ in self.fixes)}")
        return Plan(self.target, self.devices, tuple(self.compiled), tuple(notes))


def _gradient_bytes(opt, me) -> int:
    """Bytes per device of `opt`'s gradients while its step runs (at the cut a loop's
    `zero_grad` may have freed them), each a bfloat16 weight's where it has a float32 copy."""
    from . import step
    from .memory import device_bytes
    weight_of = {id(m): w for m, w in step.of(me).masters_of(opt)}
    return device_bytes([weight_of.get(id(p), p) for g in opt.param_groups for p in g["params"]
                         if p.requires_grad])


def _rows(batch: list) -> Optional[int]:
    """The rows of a step's batch: the leading size most of its inputs share (a sequence's
    positions, made on the device, are an input too, of another size)."""
    sizes = [t.shape[0] for t in batch]
    return max(set(sizes), key=lambda n: (sizes.count(n), n)) if sizes else None


def _pending_tensors() -> list:
    """Every live XLA tensor whose value is pending: what the step's cut would compute."""
    import torch
    from .compat import pending
    # type(), not isinstance: the latter asks some objects' __class__, which can warn
    live = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.device.type == "xla"]
    return pending(live)


def _models(opt, me=None) -> list:
    """The outermost live modules that hold `opt`'s parameters (or the bfloat16 weights
    whose float32 copies it steps)."""
    import torch
    from . import step
    from .replica import current
    mine = {id(p) for g in opt.param_groups for p in g["params"]}
    mine |= {id(w) for _, w in step.of(me or current()).masters_of(opt)}
    modules = [m for m in gc.get_objects() if issubclass(type(m), torch.nn.Module)]
    holding = {id(m) for m in modules if any(id(p) in mine for p in m.parameters(recurse=False))}
    owners = [m for m in modules if any(id(c) in holding for c in m.modules())]
    inner = {id(c) for m in owners for c in list(m.modules())[1:]}
    return [m for m in owners if id(m) not in inner]


def _held_ids(opt, me) -> set:
    """torch_xla's ids of the tensors a step keeps: the models' weights and buffers, the optimizer's
    parameters, gradients and state (the rest of a step's inputs are its batch)."""
    import torch
    from . import step
    from .compat import tensor_ids
    params = [p for g in opt.param_groups for p in g["params"]]
    held = params + [p.grad for p in params if p.grad is not None]
    held += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    held += [w for _, w in step.of(me).masters_of(opt)]  # tu.bf16_weights' model weights
    for model in _models(opt):
        held += list(model.parameters()) + list(model.buffers())
    return set(tensor_ids([t for t in held if t.device.type == "xla"]))


def _fixes(opt, me) -> List[Tuple[str, Callable]]:
    """The fixes that apply to this run, in the order tried: (label, apply)."""
    from . import step
    from .compat import sharded
    from .fsdp import MIN_ELEMENTS, fsdp
    models = _models(opt)
    fixes = []
    if me.engine.parameter_mesh() is not None and any(
            p.numel() >= MIN_ELEMENTS and not sharded(p) for m in models for p in m.parameters()):
        def split():
            for m in models:
                fsdp(m)
            step.of(me).split_state(opt)
        fixes.append(("tu.fsdp(model)", split))
    checkpointed = [m for m in models if callable(getattr(m, "gradient_checkpointing_enable", None))
                    and getattr(m, "supports_gradient_checkpointing", False)
                    and not getattr(m, "is_gradient_checkpointing", False)]
    if checkpointed:
        def checkpoint():
            for m in checkpointed:
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        fixes.append(("model.gradient_checkpointing_enable()", checkpoint))
    return fixes
