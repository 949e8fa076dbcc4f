"""Runtime rules: CUDA's own ways of running code that have no TPU meaning. `with
torch.cuda.device(i):` picks a GPU (tu.run gives each replica its device): the context
becomes `contextlib.nullcontext()`; `torch.compile(model)` is the model (XLA traces and
compiles each step already; inductor cannot compile XLA tensors)."""
from __future__ import annotations

import ast

from ..facts import dotted
from .rule import Context, Rule, always, called

_COMPILE = ("torch.compile",)


def _cuda_device(ctx: Context, node) -> None:
    if ctx.edits.replace(node.context_expr, "contextlib.nullcontext()",
                         f"{ctx.edits.source(node.context_expr)} -> contextlib.nullcontext() "
                         f"(tu.run gives each replica its device)"):
        ctx.memo["contextlib"] = True


def _import_contextlib(ctx: Context, tree) -> None:
    """`import contextlib` where a swap needs it and the script does not import it."""
    if not ctx.memo.get("contextlib") or any(
            isinstance(n, ast.Import) and any(a.name == "contextlib" and not a.asname for a in n.names)
            for n in tree.body):
        return
    imports = [s for s in tree.body if isinstance(s, (ast.Import, ast.ImportFrom))]
    if imports:
        at, before = imports[-1], False
    else:  # after a docstring: `from __future__` and the docstring come first
        at = tree.body[1] if len(tree.body) > 1 and isinstance(tree.body[0], ast.Expr) and \
            isinstance(tree.body[0].value, ast.Constant) else tree.body[0]
        before = True
    if ctx.edits.insert_line(at, "import contextlib", before=before):
        ctx.edits.swap(at.lineno, "import contextlib (for contextlib.nullcontext())")


def _compiled(ctx: Context, node) -> bool:
    return dotted(node.func) in _COMPILE and len(node.args) >= 1


def _compile_line(ctx: Context, node) -> bool:
    """`model = torch.compile(model)`: the line has nothing left to do."""
    return isinstance(node.value, ast.Call) and _compiled(ctx, node.value) and \
        [dotted(t) for t in node.targets] == [dotted(node.value.args[0])] != [""]


def _compile(ctx: Context, node) -> None:
    ctx.edits.replace(node, ctx.edits.source(node.args[0]),
                      f"torch.compile({ctx.edits.source(node.args[0])}) -> "
                      f"{ctx.edits.source(node.args[0])} (XLA compiles each step already)")


def _compile_decorators(ctx: Context, node) -> None:
    """`@torch.compile` and `@torch.compile(...)` lines go."""
    for dec in node.decorator_list:
        call = dec.func if isinstance(dec, ast.Call) else dec
        lines = ctx.edits.lines
        alone = lines[dec.lineno - 1].encode()[:dec.col_offset].strip() == b"@" and \
            not lines[dec.end_lineno - 1].encode()[dec.end_col_offset:].split(b"#")[0].strip()
        if dotted(call) in _COMPILE and alone:
            ctx.edits.replace(dec, "", "@torch.compile -> removed (XLA compiles each step already)",
                              where=(dec.lineno, 0, *ctx.edits.lines_end(dec.end_lineno)))


RULES = [
    Rule("runtime.cuda-device", "`with torch.cuda.device(i):` becomes `with "
         "contextlib.nullcontext():`: tu.run gives each replica its device", ast.withitem,
         lambda ctx, node: isinstance(node.context_expr, ast.Call) and
         dotted(node.context_expr.func) == "torch.cuda.device", _cuda_device),
    Rule("runtime.compile-line", "a `model = torch.compile(model)` line goes: XLA compiles "
         "each step already", ast.Assign, _compile_line,
         lambda ctx, node: ctx.remove(node, "torch.compile(...) -> removed (XLA compiles each "
                                            "step already)"), inside=False),
    Rule("runtime.compile", "torch.compile(model, ...) in an expression becomes model",
         ast.Call, _compiled, _compile, inside=False),
    Rule("runtime.compile-decorator", "an `@torch.compile` decorator line goes", ast.FunctionDef,
         lambda ctx, node: any(dotted(d.func if isinstance(d, ast.Call) else d) in _COMPILE
                               for d in node.decorator_list), _compile_decorators),
]
PASSES = [
    Rule("runtime.import-contextlib", "`import contextlib` is added where a swap needs it",
         ast.Module, always, _import_contextlib),
]
