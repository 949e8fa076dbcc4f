"""torch_xla in one place: its private calls, and what differs between 2.8 and 2.9.

Kaggle's TPU image has torch_xla 2.8, Colab's 2.9 (the last release). The rest of
tpu_utility uses torch_xla's public API and these functions, so a new torch_xla means
reading this file. Each function imports torch_xla only when called.
"""
from __future__ import annotations

import collections
import functools
import importlib.util
import os
import re
import sys
import weakref
from typing import Callable, Dict, List, Optional


class _RootLoggingKept:
    """An import hook, once, for torch_xla: its `__init__` calls `logging.basicConfig()` (2.8
    and 2.9), and tpu_utility imports it when the device is first used, inside train_fn,
    so the script's own `logging.basicConfig(filename=..., level=...)` after that would do
    nothing (the root logger has a handler). The handler torch_xla adds to a root that had
    none is taken off again; its warnings still reach stderr (logging's last resort)."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch_xla":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)  # as the other finders find it
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):
            import logging
            root = logging.getLogger()
            before = list(root.handlers)
            try:
                run(module)
            finally:
                added = [h for h in root.handlers if h not in before]
                if not before and len(added) == 1:
                    root.removeHandler(added[0])

        loader.exec_module = exec_module
        return spec


def keep_root_logging() -> None:
    """Install `_RootLoggingKept` where torch_xla is not imported yet (at `import tpu_utility`)."""
    if "torch_xla" not in sys.modules and not any(isinstance(f, _RootLoggingKept) for f in sys.meta_path):
        sys.meta_path.insert(0, _RootLoggingKept())


def runtime_started() -> bool:
    """Whether this process already holds the XLA runtime, checked without starting it."""
    if sys.modules.get("torch_xla") is None:  # never imported (or blocked): not started
        return False
    import torch_xla
    return bool(torch_xla._XLAC._xla_runtime_is_initialized())


def cpu_copies(tensors: List) -> List:
    """CPU copies of XLA tensors, in one batched device-to-host transfer each for the
    sharded and the other tensors, and no compile.

    torch_xla reads a tensor sharded over SPMD devices by compiling a program that
    replicates it, anew on every read (pjrt_computation_client.cc, ReplicateShardedData,
    2.8 and 2.9): a `.cpu()` of a batch costs a compile. Its shards read as they are and
    are put together here instead.
    """
    import torch
    import torch_xla
    torch_xla._XLAC._xla_sync_multi(tensors, devices=[], wait=True, sync_xla_data=False)
    tiled = (3, 5)  # ShardingType.TILED, PARTIAL: split over devices, not replicated
    sharded = [i for i, t in enumerate(tensors)
               if torch_xla._XLAC._get_xla_sharding_type(t) in tiled]
    plain = sorted(set(range(len(tensors))) - set(sharded))
    out = [None] * len(tensors)
    if plain:
        for i, c in zip(plain, torch_xla._XLAC._xla_get_cpu_tensors([tensors[i] for i in plain])):
            out[i] = c
    if sharded:
        picked = [tensors[i] for i in sharded]
        shards = torch_xla._XLAC._get_local_shards(picked)  # already on the CPU
        places = torch_xla._XLAC._get_local_shard_replica_and_indices(picked)
        for i, t, per_shard, per_place in zip(sharded, picked, shards, places):
            whole = torch.empty(t.shape, dtype=t.dtype)
            for (data, _device), (_replica, index) in zip(per_shard, per_place):
                index = tuple(index)
                # A shard of an uneven split is padded: keep the part its slice covers.
                whole[index] = data[tuple(slice(0, s.stop - s.start) for s in index)].to(t.dtype)
            out[i] = whole
    return out


def cut_before_next_batch() -> None:
    """Cut the graph now, in place of the cut MpDeviceLoader makes before its next batch.

    Every cut advances the device's random seed, so an extra one would put a run on
    another random stream; the loader skips its own cut when the profiler's flag says a
    step was just marked (torch_xla 2.8 and 2.9: parallel_loader.PerDeviceLoader.next).
    A cut already made since the last batch is not made again (the loader's rule).
    """
    import torch_xla.debug.profiler as xp
    if not xp.get_tracer_marked_step():
        end_step()


def end_step() -> None:
    """Cut the graph now, and have MpDeviceLoader skip the cut it makes before its next batch.

    `tu.sync()` at the end of a step: the step runs now, the feed adds no cut of its own
    (each cut moves the device's random seed on), so a loop with it runs the same graphs
    on the same random stream as without. Pending work after this and before the next
    batch joins that batch's step.
    """
    import torch_xla
    import torch_xla.debug.profiler as xp
    torch_xla.sync()
    xp.set_tracer_marked_step(True)


def close_feed(batches) -> None:
    """Stop the loading threads behind an MpDeviceLoader iterator (`iter(loader)`).

    An epoch left early would otherwise leave them, and the DataLoader workers they hold,
    blocked on a full queue. torch_xla exposes no public way to reach them from the
    iterator: `PerDeviceLoader` keeps its `ParallelLoader` as `_loader` (2.8 and 2.9), and
    that one's `close()` is public.
    """
    batches._loader.close()


def use_compile_cache(folder: Optional[str]) -> None:
    """Keep this process's compiled graphs in `folder` (torch_xla's persistent cache),
    before the runtime compiles anything; None: leave it off."""
    if folder is not None:
        import torch_xla.runtime as xr
        os.makedirs(folder, mode=0o700, exist_ok=True)
        xr.initialize_cache(folder, readonly=False)


def init_one_device() -> None:
    """Claim one device for this process (one chip of a TPU host, not all of them)."""
    from torch_xla._internal import pjrt
    pjrt.initialize_singleprocess()


def run_thread_per_device(local_rank: int, nprocs: int, fn: Callable[[], None]) -> None:
    """Process `local_rank` of `nprocs`: initialise, then `fn()` in a thread per device."""
    from torch_xla._internal import pjrt
    pjrt._run_thread_per_device(local_rank, nprocs, fn, pjrt.initialize_multiprocess)


def local_tpu_processes() -> int:
    """Processes torch_xla starts on this TPU host: one per chip (4 on a v3-8, 8 on a v5e-8)."""
    from torch_xla._internal import tpu
    return tpu.num_local_processes()


@functools.lru_cache(maxsize=None)
def quiet_jax_probes() -> None:
    """Stop torch_xla's per-batch and per-sharding `import jax` when jax is not installed.

    MpDeviceLoader puts each batch through two profiler traces, and `mark_sharding`
    (SPMD) runs too; each tries to import jax (`mark_sharding` torchax as well, which
    imports jax first). In 2.8 every failed try also logs "You
    are trying to use a feature that requires jax/pallas" through the deprecated
    `logging.warn`, whose DeprecationWarning, where warnings are errors, kills the
    loader thread and ends the epoch early; 2.9 tries silently. Without jax neither has
    anything to do with it, so answer "no jax" once. Idempotent; the first call counts.
    """
    if importlib.util.find_spec("jax") is not None:
        return
    import torch_xla.debug.profiler as xp
    import torch_xla.distributed.spmd.xla_sharding as xsh
    for module in (xp, xsh):
        module.maybe_get_jax = _no_jax
    # torchax (installed with torch_xla) imports jax first: without jax it fails too.
    if hasattr(xsh, "maybe_get_torchax"):
        xsh.maybe_get_torchax = _no_jax


def _no_jax(*args, **kwargs) -> None:
    return None


def quiet_spmd_on_cpu() -> None:
    """Turn down XLA's C++ warnings in an SPMD run on XLA:CPU (unless the user chose a level).

    2.9's XLA warns on every SPMD compile that GSPMD sharding propagation will be
    deprecated (sharding_propagation.cc): nothing a user can act on, once per graph. The
    level is read when XLA logs, so setting it in the replica's process is enough.
    Errors still print. "1" is what `import torch_xla` sets when nothing is set, so it
    is not taken for the user's choice; "0" (everything) is.
    """
    if os.environ.get("PJRT_DEVICE") == "CPU" and os.environ.get("TF_CPP_MIN_LOG_LEVEL") in (None, "1"):
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"


def supports_gpu(torch_xla_version: Optional[str]) -> bool:
    """Whether this torch_xla can run PJRT_DEVICE=CUDA: 2.9 removed GPU support."""
    if not torch_xla_version:
        return False
    try:
        major, minor = (int(p) for p in torch_xla_version.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    return (major, minor) < (2, 9)


def xla_counts() -> dict:
    """Compiles, compile seconds, executions, execution seconds (from each graph's dispatch
    to the device finishing it) and device-to-host transfers so far.

    Zeros when torch_xla is not in use; reading them never starts the runtime.
    """
    if sys.modules.get("torch_xla") is None:  # None: imports of it blocked
        return {"compiles": 0, "compile_s": 0.0, "executions": 0, "execute_s": 0.0,
                "transfers": 0}
    met = importlib.import_module("torch_xla.debug.metrics")

    def count(name):
        data = met.metric_data(name)
        return (data[0], data[1]) if data else (0, 0)

    compiles, compile_ns = count("CompileTime")
    (runs, run_ns), (sharded, sharded_ns) = count("ExecuteTime"), count("ExecuteReplicatedTime")
    return {"compiles": compiles, "compile_s": compile_ns / 1e9, "executions": runs + sharded,
            "execute_s": (run_ns + sharded_ns) / 1e9,  # ExecuteReplicated: SPMD
            "transfers": count("TransferFromDeviceTime")[0]}


def graph_compiles() -> int:
    """Programs compiled from traced graphs so far (not the runtime's own, for reading a
    split tensor); 0 when torch_xla is not in use. About a microsecond: read every step."""
    if sys.modules.get("torch_xla") is None:
        return 0
    return importlib.import_module("torch_xla.debug.metrics").counter_value("UncachedCompile") or 0


def pending_ir(tensors: list):
    """The IR text of the graph that would compute `tensors` (XLA tensors not yet run), or
    None: its device_data lines give the program's inputs and their shapes."""
    import torch
    xla = [t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "xla"]
    if not xla:
        return None
    import torch_xla
    try:
        torch_xla._XLAC._xla_wait_device_ops(devices=[])  # as pending_program: no read in flight
        return torch_xla._XLAC._get_xla_tensors_text(xla)
    except RuntimeError:  # a diagnostic never fails the step it looks at
        return None


FUNCTIONALIZATION_ENV = "XLA_DISABLE_FUNCTIONALIZATION"


def functionalization_on(env=os.environ) -> bool:
    """Whether torch_xla functionalizes XLA tensors: it reads XLA_DISABLE_FUNCTIONALIZATION
    at every tensor it makes (torch_util.cpp, 2.8 and 2.9) as sys_util's GetEnvBool does:
    "true", "false", else an integer, nonzero meaning disabled."""
    value = env.get(FUNCTIONALIZATION_ENV)
    if value is None or value == "false":
        return True
    if value == "true":
        return False
    number = re.match(r"\s*[+-]?(\d+)", value)  # atoi: leading blanks, a sign, digits
    return not (number and int(number.group(1)))


def lower_once(name: str, fn: Callable, inputs: List) -> tuple:
    """`fn(*inputs)` traced once, on placeholders shaped as `inputs`, into an XLA
    computation: (computation, slots) for `call_lowered`. Python numbers in `fn` become
    device data held in `slots` (torch_xla hoists them into parameters), so `fn` must take
    what changes from call to call as tensors.

    The placeholders and the traced outputs die here, before any graph is cut: a placeholder
    has no device buffer, and a sync reaching one fails. torch_xla's own assume_pure_torch
    (2.9) lowers this way; these calls are in 2.8 and 2.9 alike.
    """
    import torch_xla
    import torch_xla.core.xla_builder as xb
    fakes = [xb.create_placeholder_tensor(t.shape, t.dtype) for t in inputs]
    outputs = list(fn(*fakes))
    context = torch_xla._XLAC.lowering.LoweringContext(name)
    context.build(outputs)
    computation = xb.computation_from_module_proto(name, context.hlo())
    hoisted = context.device_parameter_id_tensor_mapping()
    slots: list = [None] * len(hoisted)
    for i, fake in enumerate(fakes):
        position = context.tensor_parameter_id(fake)
        if position != -1:
            slots[position] = i  # an int: take inputs[i] at each call
            del hoisted[position]
    for position, tensor in hoisted.items():
        slots[position] = tensor
    del fakes, outputs, context
    return computation, slots


_LOWERED: "collections.OrderedDict" = collections.OrderedDict()
_LOWERED_KEPT = 1024  # least recently used dropped: a model's BatchNorm shapes, optimizers


def lower_cached(name: str, key: tuple, fn: Callable, inputs: List) -> tuple:
    """`lower_once(name, fn, inputs)`, kept for `key` and the inputs' shapes and dtypes:
    traced on the first call of each, looked up after."""
    key = (name, key, tuple((tuple(t.shape), t.dtype) for t in inputs))
    lowered = _LOWERED.get(key)
    if lowered is None:
        lowered = _LOWERED[key] = lower_once(name, fn, inputs)
        while len(_LOWERED) > _LOWERED_KEPT:
            _LOWERED.popitem(last=False)
    else:
        _LOWERED.move_to_end(key)
    return lowered


def call_lowered(name: str, lowered: tuple, inputs: List) -> List:
    """The outputs of a `lower_once` computation on `inputs` (tensors shaped as the traced
    ones): one node in the graph, whatever it computes."""
    import torch_xla
    computation, slots = lowered
    args = [inputs[s] if isinstance(s, int) else s for s in slots]
    return torch_xla._XLAC._xla_user_computation(name, args, computation)


def sharded(t) -> bool:
    """Whether XLA tensor `t` is split over SPMD devices (not whole on each)."""
    import torch_xla
    kept = _kept(t)
    if kept is not None:
        return kept[1].startswith("{devices=")
    return torch_xla._XLAC._get_xla_sharding_type(t) in (3, 5)  # TILED, PARTIAL


def sharding_spec(t) -> str:
    """XLA tensor `t`'s sharding as HLO writes it ("" where it has none); a plan's
    placeholder's is the one kept for it (`settle`), and stays its own when it is updated
    (torch_xla's functionalization gives an updated tensor a new id, unsharded here)."""
    import torch_xla
    kept = _kept(t)
    return kept[1] if kept is not None else torch_xla._XLAC._get_xla_sharding_spec(t)


def device_shape(t) -> tuple:
    """The shape of the piece of `t` each device holds: its own for a tensor split over
    SPMD devices (its sharding's tile counts, rounded up as XLA pads), else its shape."""
    if t.device.type != "xla":
        return tuple(t.shape)
    tiles = re.match(r"\{devices=\[([\d,]+)\]", sharding_spec(t))
    if not tiles:
        return tuple(t.shape)
    counts = [int(n) for n in tiles.group(1).split(",")]
    return tuple(-(-d // n) for d, n in zip(t.shape, counts))


def mark_sharding(t, op_sharding) -> None:
    """Annotate `t` (data or a pending result) with `op_sharding` (`Mesh.get_op_sharding`):
    the call `xs.mark_sharding` ends in, without rebuilding the sharding each time. A
    plan's placeholder (no buffer to split) has the sharding kept for it instead."""
    import torch
    import torch_xla
    kept = _kept(t)
    if kept is not None and not pending([t]):
        # the sharding as torch_xla writes it, read off a pending tensor of t's shape, never run
        probe = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
        torch_xla._XLAC._xla_mark_sharding(probe, op_sharding)
        kept[1] = torch_xla._XLAC._get_xla_sharding_spec(probe)
        return
    if kept is not None:  # a pending value carries its own sharding from here
        _PLACEHOLDERS.pop(id(t), None)
    torch_xla._XLAC._xla_mark_sharding(t, op_sharding)


def device_memory_limit(device) -> Optional[int]:
    """The runtime's memory limit of `device` in bytes (a TPU's HBM), None where it gives
    none (XLA:CPU raises)."""
    import torch_xla.core.xla_model as xm
    try:
        info = xm.get_memory_info(device)
    except Exception:  # XLA:CPU: "not implemented"
        return None
    limit = info.get("bytes_limit") if isinstance(info, dict) else None
    return int(limit) if limit else None


def functional_tensor_check() -> Callable:
    """torch's private test for a functionalization wrapper (`torch._is_functional_tensor`,
    the same in torch 2.8 and 2.9): returned, not wrapped, as in_place.py calls it on every
    op it sees."""
    import torch
    return torch._is_functional_tensor


def register_device_module(name: str, module) -> None:
    """`torch.<name>` as `module` (torch's private `_register_device_module`), for code that
    asks `torch.xla` where torch_xla did not register it."""
    import torch
    torch._register_device_module(name, module)


def pending(tensors: List) -> List:
    """Those of the XLA `tensors` whose value is a computation not yet run (not data)."""
    import torch_xla
    if not tensors:
        return []
    need = torch_xla._XLAC._check_tensor_need_materialization(tensors)
    return [t for t, n in zip(tensors, need) if n]


# What a plan made placeholders of, by the tensor's Python id: [a weak reference to it,
# the sharding its data would have ("" for none), torch_xla's id of the placeholder's
# data, as a program's inputs name it]. Only `settle`, `mark_sharding` and
# `forget_placeholders` change it.
_PLACEHOLDERS: Dict[int, list] = {}
PLACEHOLDER_BYTES = 2 ** 20  # smaller tensors are settled as zeros a loop can read


def _kept(t) -> Optional[list]:
    if not _PLACEHOLDERS:
        return None
    kept = _PLACEHOLDERS.get(id(t))
    return kept if kept is not None and kept[0]() is t else None


def settle(tensors: List) -> None:
    """Make each pending tensor data without running what it was pending on, its sharding
    kept: a plan's next step then starts from data, as a trained one would, and nothing of
    this step runs on this host, however large.

    A tensor of PLACEHOLDER_BYTES or more becomes a placeholder: data with no buffer, so
    this host holds none of a large model's weights or optimizer state (reading one aborts
    the process, as torch_xla's placeholders do); its sharding is kept here for the
    program's parameters (`pending_program`). Smaller ones become zeros (`fill` depends on
    no earlier value): a loop's `loss.item()` reads 0.0."""
    import torch
    import torch_xla
    from torch_xla.core.xla_builder import Op, mkshape
    small = []
    for t in tensors:
        if t.numel() * t.element_size() < PLACEHOLDER_BYTES or t._is_view():
            small.append(t)
            continue
        spec = sharding_spec(t)
        shape = mkshape(Op.from_torch_type(t.dtype), tuple(t.shape))
        with torch.no_grad():
            t.data = torch_xla._XLAC._xla_create_placeholder_tensor(shape.shape)
        _PLACEHOLDERS[id(t)] = [weakref.ref(t), spec, torch_xla._XLAC._xla_get_tensor_id(t)]
    with torch.no_grad():
        for t in small:
            t.zero_()
    if small:
        torch_xla._XLAC._xla_sync_multi(small, devices=[], wait=True, sync_xla_data=False)


def forget_placeholders() -> None:
    """End a plan: the shardings kept for its placeholders are dropped."""
    _PLACEHOLDERS.clear()


def pending_program(outputs: List) -> tuple:
    """The program that computes `outputs` (pending XLA tensors), as the step's cut would
    compile it, without compiling or running it: (HLO text with its `sharding=`
    annotations, the numbers of its parameters whose buffers the cut would donate, the
    parameters' tensors in parameter order). torch_xla donates an input that is the data
    of a tensor the program overwrites (xla_graph_executor.cpp,
    GetBufferDonorIndexForStepMarker); its HLO dump leaves that out."""
    import torch_xla
    # Lowering while an earlier sync's program still runs can read an output not yet
    # assigned (a segfault, seen on 2.8 and 2.9): wait for it.
    torch_xla._XLAC._xla_wait_device_ops(devices=[])
    text = torch_xla._XLAC._get_xla_tensors_hlo(outputs)
    ids, inputs = torch_xla._XLAC._get_tensors_xla_device_data_node(outputs, [])
    overwritten = {int(re.search(r"AliasID: (\d+)", torch_xla._XLAC._get_xla_tensor_debug_info(t)).group(1))
                   for t in outputs}
    entry = text[text.index("\nENTRY"):] if "\nENTRY" in text else text
    shapes = {int(n): tuple(int(d) for d in dims.split(",") if d)
              for dims, n in re.findall(r"= \w+\[([\d,]*)\]\S* parameter\((\d+)\)", entry)}
    # Both number the graph's data in the order a post-order walk of the outputs meets it;
    # should a torch_xla change that, donate nothing (the peak then reads high) rather
    # than a wrong buffer.
    same = shapes == {i: tuple(t.shape) for i, t in enumerate(inputs)}
    donors = [i for i, tid in enumerate(ids) if tid in overwritten] if same else []
    # a placeholder's data has no sharding: its parameter is annotated with the one kept
    kept = {data: spec for ref, spec, data in _PLACEHOLDERS.values() if ref() is not None}
    for i, tid in enumerate(ids):
        if tid in kept:
            text = _annotate_parameter(text, i, kept[tid] or "{replicated}")
    return text, donors, list(zip(ids, inputs))


def _annotate_parameter(text: str, number: int, spec: str) -> str:
    """HLO `text` with its entry's parameter `number` annotated `sharding=spec`."""
    line = re.compile(r"^(\s*%\S+ = \S+ parameter\(" + str(number) + r"\))(, sharding=\{[^}]*\})?",
                      re.MULTILINE)
    start = text.index("\nENTRY") if "\nENTRY" in text else 0
    entry, count = line.subn(lambda m: f"{m.group(1)}, sharding={spec}", text[start:], count=1)
    return text[:start] + entry if count else text


def tensor_ids(tensors: List) -> List[int]:
    """torch_xla's ids of XLA `tensors`, as `pending_program` names a program's inputs."""
    import torch_xla
    return [torch_xla._XLAC._xla_get_tensor_id(t) for t in tensors]
