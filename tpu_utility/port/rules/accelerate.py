"""Hugging Face Accelerate rules: an `accelerator = Accelerator()` script (the transformers
`no_trainer` examples) becomes a tu script. tu.run starts the replicas, make_loader shards
and feeds the data, tu.optimizer_step averages the gradients: `accelerator.prepare` leaves
only the model's move to the device, and each other call has tu's or torch's equivalent.

An accelerator with a use outside the tables below (`accelerator.accumulate`,
`save_state`, passing the accelerator on, a setting such as `mixed_precision=`) is left
alone, every line of it, with one note at its line naming the first such use and what
keeping it means on XLA: half a port would fail at run time.
"""
from __future__ import annotations

import ast
from typing import Dict, List, Optional

from ..facts import dotted, method
from .order import ORDER_FIX
from .rule import DEVICE, Context, Rule

# accelerator.<method>(...) -> the callee that replaces it, arguments kept; None: the call
# becomes its first argument (under SPMD, gather's rows are every device's already)
_CALLS = {
    "print": "tu.master_print",
    "save": "tu.save",
    "clip_grad_norm_": "torch.nn.utils.clip_grad_norm_",
    "clip_grad_value_": "torch.nn.utils.clip_grad_value_",
    "backward": None,
    "unwrap_model": None,
    "gather": None,
    "gather_for_metrics": None,
    "autocast": None,
    # each replica prepares its data itself (tu.run's SPMD is one process)
    "main_process_first": "contextlib.nullcontext",
}
# accelerator.<method>(...) statements that go: tu.run and make_loader do their work
_GONE = ("wait_for_everyone", "free_memory", "end_training", "init_trackers", "log")
# accelerator.<attribute> read as a value
_ATTRIBUTES = {
    "device": DEVICE,
    "is_main_process": "tu.is_master()",
    "is_local_main_process": "tu.is_master()",
    "num_processes": "tu.world_size()",
    "process_index": "tu.rank()",
    "local_process_index": "tu.rank()",
    "sync_gradients": "True",
    "save": "tu.save",
}
# Accelerator(...) settings whose loss changes nothing port keeps: the trackers go
_SETTINGS = ("log_with", "project_dir", "project_config")
_GATHER_NOTE = ("under SPMD (one TPU host's default) each batch already holds every device's "
                "rows; with engine='launch' or on a pod each replica has its share: collect "
                "the outputs and use tu.gather(torch.cat(outputs), loader)")


def accelerators(ctx: Context) -> Dict[str, Optional[ast.AST]]:
    """The names bound to `Accelerator(...)`, each with its first use port cannot map
    (None: every use maps), found once per module."""
    found = ctx.memo.get("accelerators")
    if found is None:
        tree = ctx.facts.tree
        names = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and _made(n.value)
                 for t in n.targets if isinstance(t, ast.Name)}
        found = ctx.memo["accelerators"] = {name: _unmapped(ctx, name) for name in names}
    return found


def _made(value) -> bool:
    """`Accelerator(...)`, or one of two made either way: `Accelerator(log_with=...) if
    args.with_tracking else Accelerator()` (transformers' no_trainer scripts)."""
    if isinstance(value, ast.IfExp):
        return _made(value.body) and _made(value.orelse)
    return isinstance(value, ast.Call) and dotted(value.func).split(".")[-1] == "Accelerator"


def _unmapped(ctx: Context, name: str) -> Optional[ast.AST]:
    """The first use of accelerator `name` that port cannot map, in the file's order."""
    return min(_unmapped_uses(ctx, name), key=lambda n: (n.lineno, n.col_offset), default=None)


def _unmapped_uses(ctx: Context, name: str):
    for node in ast.walk(ctx.facts.tree):
        if not (isinstance(node, ast.Name) and node.id == name):
            continue
        parent, _ = ctx.facts.parents.get(id(node), (None, ""))
        if isinstance(node.ctx, ast.Store) and isinstance(parent, ast.Assign) and _made(parent.value):
            # the assignment itself; a setting that tu.run would lose (mixed_precision=,
            # gradient_accumulation_steps=) is a use port cannot map
            yield from (k for n in ast.walk(parent.value) if isinstance(n, ast.Call)
                        for k in n.keywords if k.arg not in _SETTINGS)
            continue
        if not isinstance(parent, ast.Attribute):
            yield node  # passed on, returned, ...
            continue
        grand, field = ctx.facts.parents.get(id(parent), (None, ""))
        is_call = isinstance(grand, ast.Call) and field == "func"
        attr = parent.attr
        if attr == "prepare" and is_call and _prepared(ctx, grand) is None:
            yield grand
            continue
        if is_call and attr not in _CALLS and attr not in _GONE and attr != "prepare":
            yield grand
            continue
        if is_call and attr in _CALLS and _CALLS[attr] is None and attr != "autocast" and \
                (len(grand.args) != 1 or grand.keywords):  # backward(loss, retain_graph=True)
            yield grand
            continue
        if not is_call and _attribute(ctx, attr) is None:
            yield parent
            continue
        if attr in _GONE and not isinstance(ctx.facts.parents.get(id(grand), (None,))[0], ast.Expr):
            yield grand


def _attribute(ctx: Context, attr: str) -> Optional[str]:
    """What `accelerator.<attr>` read as a value becomes; None where port cannot tell."""
    if attr in _ATTRIBUTES:
        return _ATTRIBUTES[attr]
    if attr == "mixed_precision":  # an Accelerator(mixed_precision=...) stays (_SETTINGS)
        return '"no"'  # port's script runs under tu.run, not `accelerate launch`
    if attr == "distributed_type" and _imported_name(ctx, "DistributedType"):
        return "DistributedType.XLA"
    return None


def _imported_name(ctx: Context, name: str) -> bool:
    """Whether `from accelerate[...] import name` binds `name` in the module."""
    return any(isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "accelerate"
               and any((a.asname or a.name) == name for a in n.names) for n in ast.walk(ctx.facts.tree))


def _prepared(ctx: Context, call: ast.Call) -> Optional[List[tuple]]:
    """`a, b = accelerator.prepare(x, y)`: [(a, x), (b, y)] as sources; None for another form."""
    assign, _ = ctx.facts.parents.get(id(call), (None, ""))
    if not isinstance(assign, ast.Assign) or len(assign.targets) != 1 or call.keywords:
        return None
    target = assign.targets[0]
    targets = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
    if len(targets) != len(call.args) or not all(dotted(t) for t in targets):
        return None
    return [(dotted(t), a) for t, a in zip(targets, call.args)]


def _mapped(ctx: Context, node) -> bool:
    """Whether `node` is an attribute of an accelerator whose every use maps."""
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
        node.value.id in accelerators(ctx) and accelerators(ctx)[node.value.id] is None


def _is_model(ctx: Context, name: str) -> bool:
    """A name the script calls (`model(**batch)`) or takes the parameters of."""
    for node in ast.walk(ctx.facts.tree):
        if isinstance(node, ast.Call) and (dotted(node.func) == name or method(node) in (
                "parameters", "named_parameters") and dotted(node.func.value) == name):
            return True
    return False


def _bindings(ctx: Context, name: str, before: ast.stmt) -> List[ast.stmt]:
    """The `name = ...` statements before `before` in its function (each branch's, where an
    `if` makes it one way or another)."""
    scope = next((p for p, _ in ctx.facts.ancestors(before)
                  if isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module))), None)
    return sorted((node for node in (ast.walk(scope) if scope is not None else ())
                   if isinstance(node, ast.Assign) and node.lineno < before.lineno and
                   any(dotted(t) == name for t in node.targets)), key=lambda n: n.lineno)


def _prepare(ctx: Context, node: ast.Assign) -> None:
    """The model moves to the device where it is made, before any optimizer takes its
    parameters (on XLA .to() makes new parameters); the other names stay as they are."""
    lines = []
    for target, arg in _prepared(ctx, node.value):
        source = ctx.edits.source(arg)
        if isinstance(arg, ast.Name) and _is_model(ctx, arg.id):
            made = _bindings(ctx, arg.id, node)
            if not made or not all([ctx.edits.insert_line(m, f"{source}.to({DEVICE})", before=False)
                                    for m in made]):
                lines.append(f"{source}.to({DEVICE})")
                ctx.notes.add(node.lineno, f"`{source}` moves to the device at "
                              f"accelerator.prepare's line: {ORDER_FIX}")
            if target != source:
                lines.append(f"{target} = {source}")
        elif target != source:
            lines.append(f"{target} = {source}")
    what = ("accelerator.prepare(...) -> removed: the model moves to the device where it is "
            "made (make_loader shards the data, tu.optimizer_step averages the gradients)")
    if lines:
        ctx.edits.replace(node, f"\n{' ' * node.col_offset}".join(lines), what)
    else:
        ctx.remove(node, what)


def _call(ctx: Context, node: ast.Call) -> None:
    """Small edits around the arguments, which other rules (a nested accelerator call) may
    still edit."""
    attr = node.func.attr
    callee = _CALLS[attr]
    if callee is not None:
        if ctx.edits.replace(node.func, callee, f"accelerator.{attr} -> {callee}") and \
                callee.startswith("contextlib."):
            ctx.memo["contextlib"] = True  # runtime.import-contextlib adds the import
    elif attr == "autocast":
        ctx.edits.replace(node, "tu.autocast()", "accelerator.autocast() -> tu.autocast()")
    else:  # one argument (accelerators() saw to it)
        arg = node.args[0]
        bare = isinstance(arg, (ast.Name, ast.Attribute, ast.Call, ast.Subscript))
        before, after = ("", ".backward()") if bare else ("(", ").backward()")
        if attr != "backward":
            before, after = "", ""
        start = (node.lineno, node.col_offset, arg.lineno, arg.col_offset)
        if ctx.edits.replace(node, before, f"accelerator.{attr}(x) -> "
                             f"{'x.backward()' if attr == 'backward' else 'x'}", where=start):
            end = (arg.end_lineno, arg.end_col_offset, node.end_lineno, node.end_col_offset)
            ctx.edits.replaced.add(end)
            ctx.edits.add((*end, after))
        if attr in ("gather", "gather_for_metrics"):
            ctx.notes.add(node.lineno, f"`{ctx.edits.source(node).splitlines()[0]}` became its "
                          f"argument: {_GATHER_NOTE}")


def _import(ctx: Context, node: ast.ImportFrom) -> bool:
    names = [a.asname or a.name for a in node.names]
    return (node.module or "").split(".")[0] == "accelerate" and names == ["Accelerator"] and \
        bool(accelerators(ctx)) and all(u is None for u in accelerators(ctx).values())


RULES = [
    Rule("accelerate.import", "`from accelerate import Accelerator` goes when every "
         "accelerator use is mapped", ast.ImportFrom, _import,
         lambda ctx, node: ctx.remove(node, "from accelerate import Accelerator -> removed"),
         inside=False),
    Rule("accelerate.accelerator", "`accelerator = Accelerator(...)` goes: tu.run starts the "
         "replicas (an accelerator with a use port cannot map stays, and is listed)", ast.Assign,
         lambda ctx, node: _made(node.value) and len(node.targets) == 1 and
         dotted(node.targets[0]) in accelerators(ctx),
         lambda ctx, node: _accelerator(ctx, node), inside=False),
    Rule("accelerate.prepare", "`model, opt, dl = accelerator.prepare(model, opt, dl)` "
         "becomes `model = model.to(tu.get_device())`", ast.Assign,
         lambda ctx, node: isinstance(node.value, ast.Call) and _mapped(ctx, node.value.func) and
         node.value.func.attr == "prepare", _prepare, inside=False),
    Rule("accelerate.gone", "accelerator.wait_for_everyone(), .log(), .init_trackers(), "
         ".end_training(), .free_memory() lines go", ast.Expr,
         lambda ctx, node: isinstance(node.value, ast.Call) and _mapped(ctx, node.value.func)
         and node.value.func.attr in _GONE,
         lambda ctx, node: ctx.remove(node, f"accelerator.{node.value.func.attr}() -> removed"),
         inside=False),
    Rule("accelerate.call", "accelerator.backward(loss) becomes loss.backward(); .print, "
         ".save, .unwrap_model(m), .clip_grad_norm_, .autocast() and .gather(x) become tu's "
         "or torch's (gather: x, under SPMD); .main_process_first() contextlib.nullcontext()", ast.Call,
         lambda ctx, node: _mapped(ctx, node.func) and node.func.attr in _CALLS, _call),
    Rule("accelerate.attribute", "accelerator.device, .is_main_process, .num_processes, "
         ".process_index become tu's; .mixed_precision `\"no\"` (unset), "
         ".distributed_type `DistributedType.XLA`", ast.Attribute,
         lambda ctx, node: _mapped(ctx, node) and _attribute(ctx, node.attr) is not None,
         lambda ctx, node: ctx.edits.replace(node, _attribute(ctx, node.attr),
                                             f"accelerator.{node.attr} -> {_attribute(ctx, node.attr)}")),
]


def _accelerator(ctx: Context, node: ast.Assign) -> None:
    name = dotted(node.targets[0])
    unmapped = accelerators(ctx)[name]
    if unmapped is None:
        ctx.remove(node, "Accelerator() -> removed (tu.run starts the replicas)")
        return
    use = ctx.edits.source(unmapped).splitlines()[0]
    more = len({(n.lineno, n.col_offset) for n in _unmapped_uses(ctx, name)}) - 1
    others = f" nor {more} other use{'s' if more > 1 else ''} of it" if more else ""
    ctx.notes.add(node.lineno, f"`{name}` stays, with all its uses, as port cannot map "
                  f"`{use}` (original line {unmapped.lineno}){others}: on XLA its prepare still "
                  f"wraps the optimizer (stepped by torch_xla inside tu.optimizer_step) and a "
                  f"schedule (stepped once per process: 8 times a step with engine='launch' on "
                  f"a v5e-8), and shards a DataLoader given to it again (make_loader's passes "
                  f"through); replace those uses by hand and port again, and port removes "
                  f"the accelerator (tu.run starts the replicas, make_loader shards the data, "
                  f"tu.optimizer_step averages the gradients)")


def _distributed_type(ctx: Context, node) -> bool:
    """`DistributedType.TPU`, a name accelerate 1.x no longer has (XLA since 0.28)."""
    return isinstance(node, ast.Attribute) and node.attr == "TPU" and \
        dotted(node.value).split(".")[-1] == "DistributedType" and _imports_accelerate(ctx)


def _imports_accelerate(ctx: Context) -> bool:
    return any(isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "accelerate"
               or isinstance(n, ast.Import) and any(a.name.split(".")[0] == "accelerate" for a in n.names)
               for n in ast.walk(ctx.facts.tree))


RULES.append(Rule(
    "accelerate.distributed-type", "`DistributedType.TPU` becomes `DistributedType.XLA`: "
    "accelerate 1.x has no TPU (AttributeError), and XLA is its name since 0.28", ast.Attribute,
    _distributed_type,
    lambda ctx, node: ctx.edits.replace(node, f"{ctx.edits.source(node.value)}.XLA",
                                        "DistributedType.TPU -> DistributedType.XLA")))
