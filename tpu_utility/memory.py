"""Memory per device: what a run's parameters, gradients and optimizer state hold on each
device, the compiled step's peak, and the device's limit, checked before the first step.

The bytes per device are read from the tensors (a tensor split over SPMD devices counts its
piece). The peak is the compiled program's own: XLA's buffer assignment, which torch_xla
writes after each compile (its "Post Compilation Analysis") when `PT_XLA_DEBUG_LEVEL` is 1
and `PT_XLA_DEBUG_FILE` names a file; `watch_compiles` sets both for the run, to a private
file, unless the user set either. The level-1 analysis runs at compiles only, not at steps.
The limit is the runtime's (a TPU's HBM per device); XLA:CPU has none, and
`TPU_UTILITY_DEVICE_MEMORY=16G` checks a CPU run against a v5e chip.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import List, Optional

LIMIT_ENV = "TPU_UTILITY_DEVICE_MEMORY"
FIX = ("split the weights over the devices with tu.fsdp(model) (all cores), turn on gradient "
        "checkpointing (model.gradient_checkpointing_enable()), keep the weights in bfloat16, "
        "or use a smaller batch")
_FILE: List[Optional[str]] = [None]
# Where watch_compiles writes in a replica process: the run's private folder, which the
# caller removes after the run. (A replica ends with os._exit, which runs no atexit, and
# may be killed: a folder of its own would be left behind in /tmp, one per run.)
_FOLDER: List[Optional[str]] = [None]
_LAST: List[Optional["Memory"]] = [None]  # this process's latest run's, for doctor (`note`)


@dataclass(frozen=True)
class Memory:
    """Bytes on the fullest device: parameters, gradients and optimizer state (measured at
    the first step of the run's first optimizer), the largest compiled program's peak so
    far (None: not known), and the device's limit (None: none known)."""

    parameters: int
    gradients: int
    optimizer: int
    peak: Optional[int] = None
    limit: Optional[int] = None
    compiler: str = ""  # whose compile the peak is: "XLA:CPU" here, "the TPU's" on a TPU


    @property
    def state(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    def __str__(self) -> str:
        line = (f"memory per device: parameters {size_text(self.parameters)}, gradients "
                f"{size_text(self.gradients)}, optimizer state {size_text(self.optimizer)}")
        if self.peak is not None:
            line += f"; the compiled step's peak {size_text(self.peak)}"
            if self.compiler:
                line += f" ({self.compiler} compile)"
        if self.limit is not None:
            line += f" (of {size_text(self.limit)})"
        return line


def size_text(n: int) -> str:
    """Bytes as a reader takes them in (powers of 1000).

    Example:
        >>> size_text(1677200000), size_text(512)
        ('1.68 GB', '512 B')

    Args:
        n: a number of bytes.
    """
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def parse_size(text: str) -> int:
    """Bytes from "16G", "16GB", "512M", "1.5e9" (powers of 1024 for K, M, G, T).

    Example:
        >>> parse_size("16G"), parse_size("1e9")
        (17179869184, 1000000000)

    Args:
        text: a number of bytes, with an optional K, M, G or T.
    """
    m = re.fullmatch(r"\s*((?:\d+\.?\d*|\.\d+)(?:e\+?\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text),
                     re.IGNORECASE)
    if not m:
        raise ValueError(f"{LIMIT_ENV}={text!r}: give bytes, e.g. 16G for a v5e chip, 32G for a v6e")
    size = int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))
    if size <= 0:  # a limit of nothing would refuse every run, naming the run, not the setting
        raise ValueError(f"{LIMIT_ENV}={text!r} gives a device no memory: give its bytes, e.g. "
                         f"16G for a v5e chip, 32G for a v6e, or unset it")
    return size


def compiles_in(folder: str) -> None:
    """In a replica process: `watch_compiles` writes into `folder` (the run's private
    folder, which the caller removes), not into a folder of its own."""
    _FOLDER[0] = folder


def watch_compiles(env=os.environ) -> None:
    """Have torch_xla write each compiled program's memory to a private file, unless the user
    set its debug variables (then `peak` stays unknown). torch_xla reads them at its first
    compile in the process: call this before."""
    if _FILE[0] is not None or any(k in env for k in ("PT_XLA_DEBUG", "PT_XLA_DEBUG_LEVEL",
                                                      "PT_XLA_DEBUG_FILE")):
        return
    folder = _FOLDER[0]
    if folder is None:  # the caller's own process (a run inside it): a folder of its own
        folder = tempfile.mkdtemp(prefix="tpu_utility-compiles-")  # mode 0700
        atexit.register(shutil.rmtree, folder, True)
    _FILE[0] = os.path.join(folder, f"compiles-{os.getpid()}.txt")
    env["PT_XLA_DEBUG_LEVEL"], env["PT_XLA_DEBUG_FILE"] = "1", _FILE[0]


_SIZES = re.compile(r"Post Compilation Analysis: (Graph input|Graph output|Aliased Input|"
                    r"Intermediate tensor) size: ([\d.]+) GB")


def compiled_peaks(path: Optional[str] = None) -> List[int]:
    """Each compiled program's bytes per device so far, in compile order: its inputs and
    outputs (less those that share an input's buffer) and its temporaries, as XLA's buffer
    assignment laid them out."""
    path = path or _FILE[0]
    if not path or not os.path.exists(path):
        return []
    with open(path, errors="replace") as f:
        text = f.read()
    peaks, sizes = [], {}
    for kind, gb in _SIZES.findall(text):
        sizes[kind] = float(gb) * 1024 ** 3  # torch_xla prints bytes / 2**30
        if kind == "Intermediate tensor":
            peaks.append(int(sizes.get("Graph input", 0) + sizes.get("Graph output", 0)
                             - sizes.get("Aliased Input", 0) + sizes[kind]))
            sizes = {}
    return peaks


def device_bytes(tensors) -> int:
    """Bytes the given tensors hold on one device (each split tensor: its piece)."""
    from .compat import device_shape
    total = 0
    for t in tensors:
        n = 1
        for d in device_shape(t):
            n *= d
        total += n * t.element_size()
    return total


def compiler_of(device) -> str:
    """Whose compiler lays out `device`'s programs, as the memory line names it: XLA:CPU's
    figures are not a TPU's (docs/measured.md); `tu.plan` gives the TPU's from any host."""
    if device.type != "xla":
        return ""
    import torch_xla.runtime as xr
    kind = xr.device_type()
    return "XLA:CPU" if kind == "CPU" else f"the {kind}'s"


def limit(device, env=os.environ) -> Optional[int]:
    """The device's memory in bytes: `TPU_UTILITY_DEVICE_MEMORY` where set, else the
    runtime's (None on XLA:CPU)."""
    if env.get(LIMIT_ENV):
        return parse_size(env[LIMIT_ENV])
    if device.type != "xla":
        return None
    from .compat import device_memory_limit
    return device_memory_limit(device)


def measure(opt, device, masters=(), others=(), env=os.environ) -> Memory:
    """`opt`'s parameters, their gradients and its state, in bytes per device. `masters`:
    (float32 copy, bfloat16 weight) pairs (tu.bf16_weights): the weights count as the
    parameters, a gradient of their size each, and the copies as optimizer state.
    `others`: parameters the optimizer does not hold that are on the device too (the rest
    of a model whose head alone trains), counted with their gradients; each tensor once."""
    import torch
    weight_of = {id(m): w for m, w in masters}
    held = {}
    for p in [p for g in opt.param_groups for p in g["params"]] + list(others):
        held.setdefault(id(weight_of.get(id(p), p)), p)  # a copy's weight is counted as the copy
    params = list(held.values())
    grads = [weight_of.get(id(p), p.grad) for p in params if p.grad is not None]
    state = [v for s in opt.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    state += [m for m, _ in masters]
    params = [weight_of.get(id(p), p) for p in params]
    peaks = compiled_peaks()
    return Memory(device_bytes(params), device_bytes(grads), device_bytes(state),
                  peak=max(peaks) if peaks else None, limit=limit(device, env),
                  compiler=compiler_of(device))


def note(memory: Memory) -> None:
    """Keep a run's memory, measured at its first step, for `doctor` after the run (the
    replica's record ends with its run): written by the replica that measured it, and by
    `note_from` in the caller of a run whose replicas were other processes."""
    _LAST[0] = memory


def to_json(memory: Memory) -> bytes:
    """`memory` as `note_from` reads it."""
    return json.dumps(vars(memory)).encode()


def note_from(path: str) -> None:
    """`note` what a run's master replica wrote to `path` (`to_json`), if it wrote it."""
    try:
        with open(path, "rb") as f:
            note(Memory(**json.loads(f.read())))
    except FileNotFoundError:  # no optimizer step, or not measured
        pass


def last() -> Optional[Memory]:
    """The memory this process's latest run measured, in this process or in its replicas'
    (None: no run measured one yet), with the largest compiled program's peak so far."""
    return with_peak(_LAST[0])


def check(memory: Memory) -> None:
    """Raise MemoryError, naming the fixes, where the parameters, gradients and optimizer
    state alone exceed the device's memory."""
    if memory.limit is not None and memory.state > memory.limit:
        raise MemoryError(
            f"this run needs {size_text(memory.state)} per device for parameters, gradients and "
            f"optimizer state ({size_text(memory.parameters)} + {size_text(memory.gradients)} + "
            f"{size_text(memory.optimizer)}) before any activation, and a device has "
            f"{size_text(memory.limit)}: {FIX}")


def with_peak(memory: Optional[Memory]) -> Optional[Memory]:
    """`memory` with the largest compiled program's peak so far."""
    if memory is None:
        return None
    peaks = compiled_peaks()
    if not peaks:
        return memory
    return dataclasses.replace(memory, peak=max(peaks))


def peak_hint(memory: Memory) -> str:
    """The sentence for a compiled step whose peak exceeds the device's memory."""
    return (f"the compiled step needs {size_text(memory.peak or 0)} per device at its peak and a "
            f"device has {size_text(memory.limit or 0)}: {FIX}")
