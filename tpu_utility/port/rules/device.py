"""Device rules: where a CUDA script names its device, the device becomes tu.get_device();
calls with no meaning on a TPU go; `.cuda()` at the top level stays on the CPU."""
from __future__ import annotations

import ast
import re

from ..facts import dotted, method
from .distributed import unwrapped
from .rule import DEVICE, Context, Rule, called

NO_TPU_MEANING = {"empty_cache", "reset_peak_memory_stats", "reset_max_memory_allocated",
                  "ipc_collect", "set_device"}


# What names a GPU by its index in CUDA scripts: `.to(args.gpu)`, `.to(local_rank)`.
GPU_INDEX = re.compile(r"(^|\.)(gpu|gpu_id|local_rank|rank|device_id|cuda_device)$")
# What names a device setting: `torch.device(args.device)`, `.to(cfg.device)`.
DEVICE_SETTING = re.compile(r"(^|\.)(device|device_name|gpu|gpu_id|local_rank|rank|device_id)$")


def is_cuda_string(node) -> bool:
    """"cuda", "cuda:0", and an f-string that starts so (f"cuda:{args.gpu}")."""
    if isinstance(node, ast.JoinedStr) and node.values:
        node = node.values[0]
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and \
            re.fullmatch(r"cuda(:\d*)?", node.value) is not None
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and \
        re.fullmatch(r"cuda(:\d+)?", node.value) is not None


def is_cuda_check(node) -> bool:
    return isinstance(node, ast.Call) and dotted(node.func) == "torch.cuda.is_available"


def moves_to_cuda(node) -> bool:
    """`x.cuda()`, `x.cuda(args.gpu)`, `x.to("cuda")`, `x.to(f"cuda:{i}")`, `x.to(args.gpu)`."""
    attr = method(node)
    return attr == "cuda" and dotted(node.func) != "torch.cuda" or \
        attr == "to" and bool(node.args) and (
            is_cuda_string(node.args[0]) or GPU_INDEX.search(dotted(node.args[0])) is not None)


def no_tpu_meaning(name: str) -> bool:
    # a prefix, not a list of names: torch.cuda.memory.empty_cache is the same call
    return name.startswith("torch.cuda.") and name.split(".")[-1] in NO_TPU_MEANING


def is_cpu(node) -> bool:
    if isinstance(node, ast.Call) and dotted(node.func) == "torch.device" and len(node.args) == 1:
        node = node.args[0]
    return isinstance(node, ast.Constant) and node.value == "cpu"


def cpu_fallback(node) -> bool:
    """`if not torch.cuda.is_available(): device = "cpu"`: with no GPU, a name set to the
    CPU (False on every TPU host, so the run would train on the CPU)."""
    test = node.test
    negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and (
        is_cuda_check(test.operand) or isinstance(test.operand, ast.Call)
        and dotted(test.operand.func) == "torch.accelerator.is_available")
    return negated and not node.orelse and all(
        isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)
        and is_cpu(s.value) for s in node.body)


def _device_value(value) -> str:
    """"gpu" or "other" for a value that names a device (`torch.device("cuda", i)`,
    f"cuda:{i}", "mps", current_accelerator()); '' for anything else."""
    if isinstance(value, ast.Call) and dotted(value.func) == "torch.device" and value.args:
        value = value.args[0]
    if isinstance(value, ast.Call) and dotted(value.func) == "torch.accelerator.current_accelerator" \
            or is_cuda_string(value):
        return "gpu"
    if isinstance(value, ast.Constant) and isinstance(value.value, str) and \
            re.fullmatch(r"(cpu|mps|xpu)(:\d+)?", value.value):
        return "other"
    return ""


def _chain_choice(node) -> tuple:
    """({names set}, whether a branch is a GPU) of an if/elif/else chain in which every
    branch sets one name to a device, or is itself such a chain; (None, False) if not."""
    branches = [node.body]
    while len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
        node = node.orelse[0]
        branches.append(node.body)
    if not node.orelse:
        return None, False
    branches.append(node.orelse)
    names, gpu = set(), False
    for body in branches:
        if len(body) == 1 and isinstance(body[0], ast.If):  # a nested chain
            inner, inner_gpu = _chain_choice(body[0])
            if inner is None:
                return None, False
            names |= inner
            gpu = gpu or inner_gpu
            continue
        if len(body) != 1 or not isinstance(body[0], ast.Assign) or len(body[0].targets) != 1 \
                or not isinstance(body[0].targets[0], ast.Name):
            return None, False
        kind = _device_value(body[0].value)
        if not kind:
            return None, False
        gpu = gpu or kind == "gpu"
        names.add(body[0].targets[0].id)
    return names, gpu


def device_choice(node) -> str:
    """The name an if/elif/else chain (nested ones too) sets to a device in every branch,
    one of them a GPU (`if use_cuda: device = torch.device("cuda") else: device =
    torch.device("cpu")`); '' for any other `if`."""
    names, gpu = _chain_choice(node)
    return names.pop() if names is not None and gpu and len(names) == 1 else ""


def _statement_call(node) -> str:
    return dotted(node.value.func) if isinstance(node.value, ast.Call) else ""


def _remove_no_meaning(ctx: Context, node) -> None:
    ctx.remove(node, f"{_statement_call(node)}() has no meaning on a TPU: removed")


def _top_level_move(ctx: Context, node) -> bool:
    return ctx.depth == 0 and isinstance(node.value, ast.Call) and moves_to_cuda(node.value)


def _remove_top_level_move(ctx: Context, node) -> None:
    # `model.cuda()` on its own line at the top: the model stays on the CPU (see
    # _to_device), so the statement has nothing left to do
    attr = node.value.func.attr
    if ctx.remove(node, f".{attr}() at the top level -> stays on the CPU"):
        ctx.notes.top_level_move(node.lineno, attr)


def _if_choice(ctx: Context, node) -> None:
    ctx.device(node, "if/else device choice -> tu.get_device()", f"{device_choice(node)} = {DEVICE}")


def _cuda_name(ctx: Context, node) -> bool:
    return is_cuda_string(node.value) and all(isinstance(t, ast.Name) for t in node.targets)


def _cuda_expression(ctx: Context, node) -> bool:
    return is_cuda_check(node.test) and is_cuda_string(node.body)


def _torch_device(ctx: Context, node) -> None:
    arg = node.args[0] if node.args else None
    if is_cuda_string(arg) or isinstance(arg, ast.IfExp) and (
            is_cuda_check(arg.test) or is_cuda_string(arg.body)):
        ctx.device(node, "torch.device('cuda') -> tu.get_device()")
    elif arg is not None and DEVICE_SETTING.search(dotted(arg)):
        ctx.device(node, f"torch.device({ctx.edits.source(arg)}) -> tu.get_device() (on a TPU "
                         f"the device is the replica's, whatever the setting says)")
    elif arg is not None and not isinstance(arg, (ast.Constant, ast.IfExp)):
        ctx.notes.device_from_setting(node)


def _is_cudnn_setting(ctx: Context, node) -> bool:
    return all(re.match(r"(torch\.backends\.)?cudnn\.\w+$|torch\.backends\.cuda\.(matmul\.)?\w+$",
                        dotted(t)) for t in node.targets)


def _to_device(ctx: Context, node) -> None:
    attr = node.func.attr
    receiver = unwrapped(ctx, node.func.value)  # DataParallel(model).cuda(): the model
    rest = [ctx.edits.source(a) for a in node.args[1:] + node.keywords if a.arg != "device"] \
        if attr == "to" else [ctx.edits.source(k) for k in node.keywords if k.arg != "device"]
    if ctx.depth > 0:
        ctx.edits.replace(node, f"{receiver}.to({', '.join([DEVICE] + rest)})",
                          f".{attr}() -> .to(tu.get_device())")
    # At the top level it would start the XLA runtime in this process (and put a
    # dataset's tensors where DataLoader workers cannot read them): stay on the CPU.
    elif ctx.edits.replace(node, f"{receiver}.to({', '.join(rest)})" if rest else receiver,
                           f".{attr}() at the top level -> stays on the CPU"):
        ctx.notes.top_level_move(node.lineno, attr)


def _no_meaning(ctx: Context, node) -> None:
    # a statement of its own goes whole (device.no-meaning-line); inside an expression, None
    ctx.edits.replace(node, "None", f"{dotted(node.func)}() has no meaning on a TPU: removed")


RULES = [
    Rule("device.no-meaning-line", "a line calling torch.cuda.empty_cache() (set_device, "
         "ipc_collect, reset_peak_memory_stats) goes", ast.Expr,
         lambda ctx, node: no_tpu_meaning(_statement_call(node)), _remove_no_meaning, inside=False),
    Rule("device.top-level-move-line", "a `model.cuda()` line at the top level goes: data "
         "stays on the CPU, make_loader moves each batch (listed)", ast.Expr, _top_level_move,
         _remove_top_level_move, inside=False),
    Rule("device.cpu-fallback", "`if not torch.cuda.is_available(): device = 'cpu'` goes",
         ast.If, lambda ctx, node: cpu_fallback(node),
         lambda ctx, node: ctx.remove(node, "the fallback to the CPU without a GPU -> removed "
                                            "(the device is tu.get_device())"), inside=False),
    Rule("device.if-choice", "an if/elif/else that sets one name to cuda, mps or cpu becomes "
         "`name = tu.get_device()`", ast.If, lambda ctx, node: bool(device_choice(node)),
         _if_choice, inside=False),
    Rule("device.cuda-name", '`DEVICE = "cuda"` becomes `DEVICE = tu.get_device()`',
         ast.Assign, _cuda_name, lambda ctx, node: ctx.device(node.value, '"cuda" -> tu.get_device()'),
         inside=False),
    Rule("device.cuda-expression", '`"cuda" if torch.cuda.is_available() else "cpu"` becomes '
         "tu.get_device()", ast.IfExp, _cuda_expression,
         lambda ctx, node: ctx.device(node, "device expression -> tu.get_device()"), inside=False),
    Rule("device.torch-device", "`torch.device('cuda')` and `torch.device(<a cuda expression>)` "
         "become tu.get_device(); a device from a setting is listed", ast.Call,
         called("torch.device"), _torch_device),
    Rule("device.current-accelerator", "torch.accelerator.current_accelerator() becomes "
         "tu.get_device()", ast.Call, called("torch.accelerator.current_accelerator"),
         lambda ctx, node: ctx.device(node, "torch.accelerator.current_accelerator() -> "
                                            "tu.get_device()")),
    Rule("device.cudnn", "`torch.backends.cudnn.benchmark = ...` (any cudnn setting, and "
         "torch.backends.cuda.matmul's) goes",
         ast.Assign, _is_cudnn_setting,
         lambda ctx, node: ctx.remove(node, f"{dotted(node.targets[0])} has no meaning on a "
                                            f"TPU: removed"), inside=False),
    Rule("device.cuda-check", "torch.cuda.is_available() (and torch.accelerator's) becomes "
         "tu.has_accelerator(): True on XLA, so the script takes its accelerator branches",
         ast.Call, called("torch.cuda.is_available", "torch.accelerator.is_available"),
         lambda ctx, node: ctx.edits.replace(node, "tu.has_accelerator()", f"{dotted(node.func)}"
                                             f"() -> tu.has_accelerator()")),
    Rule("device.to-cuda", "`.cuda()`, `.cuda(args.gpu)`, `.to('cuda')`, `.to(f'cuda:{i}')` "
         "and `.to(args.gpu)` become `.to(tu.get_device())` in functions; at the top level "
         "they go (listed)", ast.Call,
         lambda ctx, node: moves_to_cuda(node), _to_device),
    Rule("device.no-meaning", "torch.cuda.empty_cache() and the like inside an expression "
         "become None", ast.Call, lambda ctx, node: no_tpu_meaning(dotted(node.func)), _no_meaning),
]
