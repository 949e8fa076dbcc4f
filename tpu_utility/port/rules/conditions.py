"""Condition rules: a swap inside a test must keep what the test means on a TPU host.
torchrun's detection (`int(os.environ.get("RANK", -1)) != -1`) stays False under tu.run,
which starts the replicas itself; `torch.cuda.is_bf16_supported()` is True where tu's
autocast computes in bf16; a device the script reads as a string stays a string."""
from __future__ import annotations

import ast

from ..facts import dotted, method
from .device import is_cuda_string
from .distributed import env_rank
from .rule import Context, Rule, called

# str methods a script calls on a device name (`device.startswith("cuda")`)
_STR_METHODS = {"startswith", "endswith", "split", "replace", "lower", "upper", "strip", "format"}


def _launch_check(ctx: Context, node) -> bool:
    """`int(os.environ.get("RANK", -1)) != -1`, `int(os.environ.get("WORLD_SIZE", 1)) > 1`:
    a test of whether torchrun started the script, against the value it reads without it."""
    if len(node.comparators) != 1:
        return False
    sides = [node.left, node.comparators[0]]
    read = next((s for s in sides if isinstance(s, ast.Call) and env_rank(ctx, s)), None)
    other = next((s for s in sides if s is not read), None)
    arg = read.args[0] if read is not None else None
    default = arg.args[1] if isinstance(arg, ast.Call) and len(arg.args) > 1 else None
    return _number(default) is not None and _number(default) == _number(other)


def _number(node):
    """The value of a literal (`-1`, `"0"`), or None."""
    try:
        return int(ast.literal_eval(node)) if isinstance(node, (ast.Constant, ast.UnaryOp)) else None
    except (ValueError, TypeError):
        return None


def _launch_note(ctx: Context, node) -> None:
    ctx.notes.add(node.lineno, f"`{ctx.edits.source(node)}` asks whether torchrun started the "
                  f"script: left as it is, it is False under tu.run (which starts the replicas "
                  f"itself), so the script takes its one-process branch; tu.optimizer_step "
                  f"averages the gradients, tu.rank() names the replica")


def string_names(tree) -> set:
    """The names a script reads as strings: `"cuda" in device`, `device == "cuda"`,
    `device.startswith("cuda")`, and every top-level name where the script reads its
    settings from `globals()` (a config file overriding them by type)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and len(node.comparators) == 1:
            left, right = node.left, node.comparators[0]
            if isinstance(node.ops[0], (ast.In, ast.NotIn)) and isinstance(right, ast.Name) and \
                    isinstance(left, ast.Constant) and isinstance(left.value, str):
                names.add(right.id)
            if isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
                for a, b in ((left, right), (right, left)):
                    if isinstance(a, ast.Name) and isinstance(b, ast.Constant) and isinstance(b.value, str):
                        names.add(a.id)
        if isinstance(node, ast.Call) and method(node) in _STR_METHODS and \
                isinstance(node.func.value, ast.Name):
            names.add(node.func.value.id)
    if any(isinstance(n, ast.Call) and dotted(n.func) == "globals" for n in ast.walk(tree)):
        names |= {t.id for s in getattr(tree, "body", []) if isinstance(s, ast.Assign)
                  for t in s.targets if isinstance(t, ast.Name)}
    return names


def _string_device(ctx: Context, node) -> bool:
    if "strings" not in ctx.memo:
        ctx.memo["strings"] = string_names(ctx.facts.tree)
    return is_cuda_string(node.value) and all(
        isinstance(t, ast.Name) and t.id in ctx.memo["strings"] for t in node.targets)


def _string(ctx: Context, node) -> None:
    names = ", ".join(t.id for t in node.targets)
    ctx.device(node.value, f'"cuda" -> str(tu.get_device()): {names} stays a string',
               "str(tu.get_device())")
    ctx.notes.add(node.lineno, f"{names} stays a string, now the device's name (\"xla:0\" on a "
                  f"TPU): the script's tests of \"cuda\" in it take their non-CUDA branch (no "
                  f"pin_memory, no CUDA autocast); for bf16 use tu.autocast() there")


RULES = [
    Rule("conditions.launch-check", "`int(os.environ.get('RANK', -1)) != -1` (torchrun's "
         "detection) is left, listed: False under tu.run, so the one-process branch runs",
         ast.Compare, _launch_check, _launch_note, inside=False),
    Rule("conditions.string-device", "`device = 'cuda'` where the script reads device as a "
         "string (`'cuda' in device`, a config) becomes `str(tu.get_device())` (listed)",
         ast.Assign, _string_device, _string, inside=False),
    Rule("conditions.bfloat-support", "torch.cuda.is_bf16_supported() becomes `not "
         "torch.cuda.is_available() or torch.cuda.is_bf16_supported()`: True on a TPU",
         ast.Call, called("torch.cuda.is_bf16_supported"),
         lambda ctx, node: ctx.edits.replace(
             node, "(not torch.cuda.is_available() or torch.cuda.is_bf16_supported())",
             "torch.cuda.is_bf16_supported() -> True without CUDA (a TPU computes in bf16)"),
         inside=False),
]
