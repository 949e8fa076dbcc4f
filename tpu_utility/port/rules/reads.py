"""Host-read rules beyond `.item()`: what copies a tensor to the host inside a training loop
(`float(loss)`, `'%.3f' % loss`, `f"{loss}"`, `writer.add_scalar("loss", loss)`,
`if torch.isnan(x).any():`). Each is listed where it sits: every step, or in a logging
round, which gets one note with its reads counted."""
from __future__ import annotations

import ast
import re

from ..facts import dotted, method
from .rule import Context, Rule, always

# methods whose result is a tensor again (`loss.detach()`, `x.grad.norm()`)
_TENSOR_METHODS = {"detach", "mean", "sum", "norm", "max", "min", "std", "var", "clone", "float",
                   "abs", "sqrt", "exp", "log", "square", "argmax", "cpu", "cuda", "to", "any", "all"}
# torch's functions whose result is not a tensor, or reads nothing
_NOT_TENSOR = re.compile(r"torch\.(no_grad|device|save|load|manual_seed|is_\w+|cuda\.\w+|set_\w+)$")


def _tensor_names(ctx: Context) -> set:
    """The names bound to tensors in the step loops: what `.backward()` is called on, and
    what is assigned from a tensor expression of those (`total = total + loss.detach()`)."""
    if "tensors" in ctx.memo:
        return ctx.memo["tensors"]
    names: set = set()
    nodes = [n for loop in ctx.facts.step_loops for n in ast.walk(loop)]
    names |= {dotted(n.func.value) for n in nodes if isinstance(n, ast.Call) and
              method(n) == "backward" and isinstance(n.func.value, ast.Name)}
    for _ in range(3):  # a name from a name from the loss
        for n in nodes:
            if isinstance(n, (ast.Assign, ast.AugAssign)) and tensor_like(n.value, names):
                for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                    if isinstance(t, ast.Name):
                        names.add(t.id)
    ctx.memo["tensors"] = names
    return names


def tensor_like(node, names: set) -> bool:
    """Whether `node` is, as far as its text shows, a tensor: a name in `names`, `x.grad`,
    `x.data`, `loss.detach()`, `torch.isnan(x).sum()`, `a * b` of one of those."""
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, ast.Attribute):
        return node.attr in ("grad", "data") or tensor_like(node.value, names) and node.attr == "T"
    if isinstance(node, ast.Call):
        name = dotted(node.func)
        if method(node) in _TENSOR_METHODS:
            return tensor_like(node.func.value, names) or isinstance(node.func.value, ast.Call) \
                and dotted(node.func.value.func).startswith("torch.")
        return name.startswith("torch.") and not _NOT_TENSOR.match(name)
    if isinstance(node, ast.BinOp):
        return tensor_like(node.left, names) or tensor_like(node.right, names)
    if isinstance(node, ast.UnaryOp):
        return tensor_like(node.operand, names)
    if isinstance(node, ast.Subscript):
        return tensor_like(node.value, names)
    return False


def _in_step_loop(ctx: Context, node) -> bool:
    return ctx.facts.inside_loop(node, ctx.facts.step_loops)


def _converts(ctx: Context, node) -> bool:
    """`float(t)`, `int(t)`, `"{}".format(t)`, `writer.add_scalar(tag, t)`, and `.any()` /
    `.all()` in an `if` or `while` test, in a step loop."""
    if not _in_step_loop(ctx, node):
        return False
    names = _tensor_names(ctx)
    if dotted(node.func) in ("float", "int", "bool") and len(node.args) == 1:
        return tensor_like(node.args[0], names)
    if method(node) == "format" or method(node) == "add_scalar":
        values = node.args[1:2] if method(node) == "add_scalar" else node.args
        return any(tensor_like(a, names) for a in values)
    if method(node) in ("any", "all") and not node.args:
        return any(isinstance(p, (ast.If, ast.While)) and field == "test"
                   for p, field in ctx.facts.ancestors(node))
    return False


def _formats(ctx: Context, node) -> bool:
    """`'%.3f' % loss`, `'%d %f' % (step, loss)`, in a step loop."""
    if not isinstance(node.op, ast.Mod) or not isinstance(node.left, ast.Constant) or \
            not isinstance(node.left.value, str) or not _in_step_loop(ctx, node):
        return False
    values = node.right.elts if isinstance(node.right, ast.Tuple) else [node.right]
    return any(tensor_like(v, _tensor_names(ctx)) for v in values)


def _fstring(ctx: Context, node) -> bool:
    return _in_step_loop(ctx, node) and any(
        isinstance(v, ast.FormattedValue) and tensor_like(v.value, _tensor_names(ctx)) for v in node.values)


def _read(ctx: Context, node) -> None:
    ctx.notes.training_read(node)


RULES = [
    Rule("reads.conversion", "`float(loss)`, `writer.add_scalar(tag, loss)`, `'{}'.format("
         "loss)` and `.any()` in an `if` in a training loop are listed: each reads the device",
         ast.Call, _converts, _read),
    Rule("reads.percent-format", "`'%.3f' % loss` in a training loop is listed: it reads the "
         "device", ast.BinOp, _formats, _read),
    Rule("reads.f-string", "an f-string of a tensor in a training loop is listed: it reads "
         "the device", ast.JoinedStr, _fstring, _read),
]
PASSES = [
    Rule("reads.logging-round", "a logging round (`if step % 100 == 0:` in a training loop) "
         "that reads the device is listed once, its reads counted per run", ast.Module, always,
         lambda ctx, tree: ctx.notes.round_totals()),
]
