"""Distributed rules: torch.distributed's boilerplate becomes tu's engine. tu.run starts the
replicas and their process group, make_loader shards the data, and tu.optimizer_step
averages the gradients; what the script did for each of those goes, or becomes tu's."""
from __future__ import annotations

import ast
import re

from ..facts import dotted
from .rule import Context, Rule

_DIST = r"^(torch\.)?(distributed|dist)\."
_GROUP = re.compile(_DIST + r"(init_process_group|destroy_process_group|barrier)$")
_SPAWN = re.compile(r"^((torch\.)?multiprocessing|mp)\.spawn$")
WRAPPER = re.compile(r"(^|\.)(DistributedDataParallel|DataParallel|DDP)$")
SAMPLER = re.compile(r"(^|\.)DistributedSampler$")
_REDUCE_OPS = {"SUM": "", "AVG": ', op="mean"'}
_ENV = {"RANK": "tu.rank()", "LOCAL_RANK": "tu.rank()", "WORLD_SIZE": "tu.world_size()",
        "LOCAL_WORLD_SIZE": "tu.world_size()"}


def is_wrapper(node) -> bool:
    """`DDP(model, ...)`, `nn.DataParallel(model)`: a wrapper tu's engine makes needless."""
    return isinstance(node, ast.Call) and bool(node.args) and WRAPPER.search(dotted(node.func)) is not None


def unwrapped(ctx: Context, node) -> str:
    """The source of `node`, without a DDP / DataParallel wrapper around it."""
    return ctx.edits.source(node.args[0] if is_wrapper(node) else node)


def distributed_sampler(node) -> ast.Call:
    """The DistributedSampler(...) call of `DistributedSampler(ds)` or `DistributedSampler(ds)
    if distributed else None`, or None."""
    for value in ([node.body, node.orelse] if isinstance(node, ast.IfExp) else [node]):
        if isinstance(value, ast.Call) and SAMPLER.search(dotted(value.func)):
            return value
    return None


def _wrapped_names(tree) -> set:
    """The names bound to a wrapper anywhere (`model = DDP(model)`): their `.module` is the model."""
    return {dotted(t) for n in ast.walk(tree) if isinstance(n, ast.Assign) and is_wrapper(n.value)
            for t in n.targets} - {""}


def _sampler_names(tree) -> set:
    return {dotted(t) for n in ast.walk(tree) if isinstance(n, ast.Assign)
            and distributed_sampler(n.value) is not None for t in n.targets} - {""}


def _statement(pattern):
    return lambda ctx, node: isinstance(node.value, ast.Call) and \
        pattern.search(_qualified(ctx, dotted(node.value.func))) is not None


def _qualified(ctx: Context, name: str) -> str:
    """`dist.init_process_group` for `init_process_group` imported by name from
    torch.distributed (`from torch.distributed import init_process_group`)."""
    if "distributed names" not in ctx.memo:
        ctx.memo["distributed names"] = {
            a.asname or a.name: a.name for n in ast.walk(ctx.facts.tree)
            if isinstance(n, ast.ImportFrom) and n.module == "torch.distributed" for a in n.names}
    known = ctx.memo["distributed names"]
    return f"dist.{known[name]}" if name in known else name


def _spawn(ctx: Context, node) -> None:
    fn = node.args[0]
    passed = next((k.value for k in node.keywords if k.arg == "args"), None)
    if not isinstance(fn, ast.Name) or ctx.depth == 0 or \
            passed is not None and not isinstance(passed, ast.Tuple):
        ctx.notes.add(node.lineno, "mp.spawn: call the worker through tu.run(worker, cores=8, "
                      "args=(...)) from a function, giving it tu.rank() where spawn gave the "
                      "process index")
        return
    args = [ctx.edits.source(a) for a in (passed.elts if passed is not None else [])]
    ctx.edits.replace(node, f"{fn.id}({', '.join(['tu.rank()'] + args)})",
                      f"mp.spawn({fn.id}, ...) -> {fn.id}(tu.rank(), ...): the function that "
                      f"spawns runs in every replica of tu.run")


def _wrapper_line(ctx: Context, node) -> bool:
    return is_wrapper(node.value) and [dotted(t) for t in node.targets] == [dotted(node.value.args[0])]


def _all_reduce(ctx: Context, node) -> None:
    op = next((k.value for k in node.keywords if k.arg == "op"), node.args[1] if len(node.args) > 1 else None)
    name = dotted(op).split(".")[-1] if op is not None else "SUM"
    if name not in _REDUCE_OPS or not node.args:
        ctx.notes.add(node.lineno, f"`{ctx.edits.source(node)}`: tu.all_reduce sums or "
                      f"averages; reduce otherwise by hand (tu.gather collects every replica's)")
        return
    ctx.edits.replace(node, f"tu.all_reduce({ctx.edits.source(node.args[0])}{_REDUCE_OPS[name]})",
                      "dist.all_reduce -> tu.all_reduce")


def env_rank(ctx: Context, node) -> bool:
    """`int(os.environ["LOCAL_RANK"])`, `int(os.environ.get("RANK", 0))`."""
    if dotted(node.func) != "int" or len(node.args) != 1:
        return False
    arg = node.args[0]
    key = arg.slice if isinstance(arg, ast.Subscript) and dotted(arg.value) == "os.environ" else \
        arg.args[0] if isinstance(arg, ast.Call) and dotted(arg.func) == "os.environ.get" and arg.args else None
    return isinstance(key, ast.Constant) and key.value in _ENV


def _env_key(node) -> str:
    arg = node.args[0]
    return (arg.slice if isinstance(arg, ast.Subscript) else arg.args[0]).value


RULES = [
    Rule("distributed.process-group", "dist.init_process_group(), dist.barrier() and "
         "dist.destroy_process_group() lines (imported by name too) go: tu.run sets up the "
         "replicas", ast.Expr,
         _statement(_GROUP), lambda ctx, node: ctx.remove(
             node, f"{dotted(node.value.func)}() -> removed (tu.run sets up the replicas)"),
         inside=False),
    Rule("distributed.set-epoch", "`sampler.set_epoch(epoch)` on a DistributedSampler goes: "
         "make_loader reshuffles every epoch", ast.Expr,
         lambda ctx, node: isinstance(node.value, ast.Call) and dotted(node.value.func).endswith(
             ".set_epoch") and dotted(node.value.func.value) in _sampler_names(ctx.facts.tree),
         lambda ctx, node: ctx.remove(node, "set_epoch -> removed (make_loader reshuffles "
                                            "every epoch)"), inside=False),
    Rule("distributed.sampler", "`s = DistributedSampler(ds)` becomes `s = None`; "
         "make_loader shards the data itself (the loader rule drops `sampler=s`)", ast.Assign,
         lambda ctx, node: distributed_sampler(node.value) is not None,
         lambda ctx, node: ctx.edits.replace(node.value, "None", "DistributedSampler -> None "
                                             "(make_loader shards the data over replicas)"),
         inside=False),
    Rule("distributed.wrapper-line", "`model = DDP(model, ...)` and `model = "
         "nn.DataParallel(model)` lines go; `model.module` becomes `model`", ast.Assign,
         _wrapper_line, lambda ctx, node: ctx.remove(
             node, f"{dotted(node.value.func)}(...) -> removed (tu.optimizer_step averages "
                   f"the gradients)"), inside=False),
    Rule("distributed.wrapper", "a DDP / DataParallel wrapper inside an expression becomes "
         "the model it wraps", ast.Call, lambda ctx, node: is_wrapper(node),
         lambda ctx, node: ctx.edits.replace(node, unwrapped(ctx, node), f"{dotted(node.func)}"
                                             f"(model) -> model")),
    Rule("distributed.module", "`model.module` of a model that was wrapped becomes `model`",
         ast.Attribute, lambda ctx, node: node.attr == "module" and
         dotted(node.value) in _wrapped_names(ctx.facts.tree),
         lambda ctx, node: ctx.edits.replace(node, ctx.edits.source(node.value),
                                             f"{dotted(node)} -> {dotted(node.value)}")),
    Rule("distributed.spawn", "`mp.spawn(worker, nprocs=n, args=(...))` in a function becomes "
         "`worker(tu.rank(), ...)`: the function runs in every replica of tu.run", ast.Call,
         lambda ctx, node: _SPAWN.search(dotted(node.func)) is not None and bool(node.args), _spawn),
    Rule("distributed.rank", "dist.get_rank() and dist.get_world_size() become tu.rank() and "
         "tu.world_size(); int(os.environ['LOCAL_RANK']) and the like too", ast.Call,
         lambda ctx, node: re.search(_DIST + r"get_(rank|world_size)$", dotted(node.func)) is not None
         or env_rank(ctx, node),
         lambda ctx, node: ctx.edits.replace(
             node, _ENV[_env_key(node)] if dotted(node.func) == "int" else
             "tu.rank()" if dotted(node.func).endswith("rank") else "tu.world_size()",
             f"{ctx.edits.source(node)} -> tu's")),
    Rule("distributed.device-count", "torch.cuda.device_count() becomes tu.world_size() (the "
         "devices that share each batch)", ast.Call,
         lambda ctx, node: dotted(node.func) == "torch.cuda.device_count",
         lambda ctx, node: ctx.edits.replace(node, "tu.world_size()",
                                             "torch.cuda.device_count() -> tu.world_size()")),
    Rule("distributed.all-reduce", "dist.all_reduce(t) (SUM or AVG) becomes tu.all_reduce(t); "
         "another op is listed", ast.Call,
         lambda ctx, node: re.search(_DIST + r"all_reduce$", dotted(node.func)) is not None, _all_reduce),
]
