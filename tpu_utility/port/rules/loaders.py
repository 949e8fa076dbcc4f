"""Loader rules: DataLoader(...) becomes tu.make_loader(...); whether a loader trains
(it shuffles, its sampler shuffles, or a loop that calls backward() reads it) decides
make_loader's `train`."""
from __future__ import annotations

import ast
from typing import Optional

from ..edits import span
from ..facts import ModuleFacts, calls, dotted, method
from .distributed import distributed_sampler
from .rule import Context, Rule, always, called

LOADERS = ("DataLoader", "torch.utils.data.DataLoader", "data.DataLoader")
_WRAPPERS = ("enumerate", "tqdm", "iter", "zip", "progress_bar", "master_bar", "trange")
# DataLoader's parameters that may be passed by position, in order (torch 2.8 and 2.9)
LOADER_ARGS = ("dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "num_workers",
               "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn",
               "multiprocessing_context", "generator")


def is_constant(node, value) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def sampler_kind(node, scope) -> Optional[str]:
    """"train" or "eval" for a sampler make_loader takes (SubsetRandomSampler and
    RandomSampler shuffle, SequentialSampler reads in order), written in the call or
    assigned to a name in `scope`; None for any other."""
    node = _sampler_made(node, scope)
    distributed = distributed_sampler(node)
    if distributed is not None:  # make_loader shards itself; the sampler says if it shuffles
        shuffle = next((k.value for k in distributed.keywords if k.arg == "shuffle"), None)
        return "eval" if is_constant(shuffle, False) else "train"
    if not isinstance(node, ast.Call):
        return None
    kind = dotted(node.func).split(".")[-1]
    if kind == "RandomSampler" and (len(node.args) > 1 or node.keywords):
        return None  # with replacement or num_samples: not a permutation
    return {"SubsetRandomSampler": "train", "RandomSampler": "train",
            "SequentialSampler": "eval"}.get(kind)


def _sampler_made(node, scope):
    """The value a sampler name was assigned, once, in `scope`; the node itself otherwise."""
    if isinstance(node, ast.Name):
        made = [n.value for n in ast.walk(scope) if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == node.id for t in n.targets)]
        return made[-1] if len(made) == 1 else None
    return node


def loader_role(scope, name: str, functions: dict, depth: int = 0) -> Optional[str]:
    """"train" if `name` is read in `scope` by a loop that calls backward(), or is passed
    to a module function whose loop over it does; "eval" if the loops that read it do not;
    None if no loop is seen reading it (a `**kwargs` DataLoader then stays train=False)."""
    roles = set()
    for node in ast.walk(scope):
        if isinstance(node, (ast.For, ast.AsyncFor)) and any(
                isinstance(n, ast.Name) and n.id == name for n in ast.walk(node.iter)):
            roles.add("train" if calls(node, "backward") else "eval")
        elif depth < 3 and isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in functions:
            fn = functions[node.func.id]
            params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
            passed = [params[i] for i, a in enumerate(node.args) if i < len(params)
                      and isinstance(a, ast.Name) and a.id == name]
            passed += [k.arg for k in node.keywords if isinstance(k.value, ast.Name) and k.value.id == name]
            roles.update(loader_role(fn, p, functions, depth + 1) for p in passed)
    return "train" if "train" in roles else "eval" if "eval" in roles else None


def _port_loader(ctx: Context, node) -> None:
    notes, scope = ctx.notes, ctx.scope()
    if any(isinstance(a, ast.Starred) for a in node.args) or len(node.args) > len(LOADER_ARGS):
        notes.add(node.lineno, "DataLoader(*args): port cannot see which argument is "
                  "which; swap it by hand for tu.make_loader(dataset, batch_size, ...)")
        return
    # {DataLoader's parameter: the node that passes it}, positional or keyword
    given = dict(zip(LOADER_ARGS, node.args))
    given.update((k.arg, k) for k in node.keywords if k.arg is not None)
    value = {name: a.value if isinstance(a, ast.keyword) else a for name, a in given.items()}
    for name in ("sampler", "batch_sampler"):  # None: DataLoader's default
        if name in value and is_constant(value[name], None):
            del given[name], value[name]
    if "batch_sampler" in given or "sampler" in given and \
            sampler_kind(value["sampler"], scope) is None:
        notes.add(node.lineno, "DataLoader with its own sampler: make_loader shards the "
                  "data over replicas with its own; it takes a SubsetRandomSampler, "
                  "RandomSampler or SequentialSampler, any other stays a DataLoader: "
                  "port it by hand (tu.make_loader(dataset, batch_size, ...))")
    elif "sampler" in given and distributed_sampler(_sampler_made(value["sampler"], scope)):
        # make_loader's own sharding replaces it, and whether it shuffles says train or not;
        # a shuffle= written for it (`shuffle=(sampler is None)`) goes with it
        dropped = [given[name] for name in ("sampler", "shuffle") if name in given]
        _make_loader(ctx, node, dropped, train_false=sampler_kind(value["sampler"], scope) == "eval")
    elif "sampler" in given:  # a sampler decides the order: shuffled, or in order
        _make_loader(ctx, node, [], train_false=sampler_kind(value["sampler"], scope) == "eval")
    elif any(k.arg is None for k in node.keywords) and not (
            "shuffle" in given and isinstance(value["shuffle"], ast.Constant)):
        _hidden_options(ctx, node, scope)  # DataLoader(ds, **kwargs): its loops tell
    elif "shuffle" in given and not isinstance(value["shuffle"], ast.Constant):
        shuffle = ctx.edits.source(value["shuffle"])
        notes.add(node.lineno, f"DataLoader(shuffle={shuffle}): pass train=True for "
                  f"training, train=False for evaluation",
                  fix=[(node.func, "tu.make_loader"), (given["shuffle"], f"train={shuffle}")])
    else:
        _written_options(ctx, node, given, value)


def _hidden_options(ctx: Context, node, scope) -> None:
    name = ctx.facts.assigned_to.get(id(node))
    use = name and loader_role(scope, name, ctx.facts.functions)
    if use:  # what the loader is for shows in the loops that read it
        _make_loader(ctx, node, [], train_false=use == "eval")
        return
    _make_loader(ctx, node, [], train_false=True)
    ctx.notes.add(node.lineno, "DataLoader(**...): port cannot see whether it is for "
                  "training; it wrote train=False (in order, nothing dropped: right "
                  "for evaluation); make the training loader's train=True")


def _written_options(ctx: Context, node, given, value) -> None:
    shuffles = "shuffle" in value and value["shuffle"].value
    drop = value.get("drop_last")
    if shuffles and drop is not None and is_constant(drop, False):
        ctx.notes.add(node.lineno, "drop_last=False on a training loader: its short last "
                      "batch makes XLA compile the step again; drop it to get make_loader's "
                      "drop_last=True (less than one batch of each epoch left out)")
    # make_loader's train=True already shuffles and drops the short batch
    dropped = [given[name] for name in ("shuffle", "drop_last") if name in given and (
        name == "shuffle" or shuffles and is_constant(value[name], True))]
    _make_loader(ctx, node, dropped, train_false=not shuffles)


def _make_loader(ctx: Context, node, dropped, train_false: bool) -> None:
    edits = ctx.edits
    if edits.taken(node):
        return
    edits.rewrite_call(node, "tu.make_loader", dropped, "train=False" if train_false else "")
    # make_loader's third parameter on is keyword-only: DataLoader(ds, 32, False, ...)
    for name, arg in zip(LOADER_ARGS[2:], node.args[2:]):
        if arg not in dropped:
            edits.add((*span(arg), f"{name}={edits.source(arg)}"))
    edits.swap(node.lineno, "DataLoader -> tu.make_loader" + (" (train=False)" if train_false else ""))


def fed_by_loader(loop, facts: ModuleFacts) -> bool:
    """Whether a loop iterates what is (or may be) a DataLoader, whose make_loader swap
    cuts the graph each step: a name bound to one, a function's parameter, an attribute;
    not a range, a tensor's split, a list, or a `while`."""
    if _next_of_loader(loop, facts):
        return True
    it = getattr(loop, "iter", None)
    while isinstance(it, ast.Call) and dotted(it.func).split(".")[-1] in _WRAPPERS and it.args:
        it = it.args[0]
    if isinstance(it, ast.Attribute):
        return True
    return _loader_value(it, facts, set())


# calls whose result is the loader they are given, or its batches: `active_dataloader =
# accelerator.skip_first_batches(train_dataloader, n)` (transformers' no_trainer scripts)
_PASSING = _WRAPPERS + ("skip_first_batches",)


def _loader_value(value, facts: ModuleFacts, seen: set) -> bool:
    """Whether `value`, iterated, may be a DataLoader: a loader call, a name bound to one
    (or to another name of one: `active_dataloader = train_dataloader`), a parameter, or a
    call that passes a loader on (`skip_first_batches(loader, n)`)."""
    if isinstance(value, ast.Call):
        name = dotted(value.func)
        if name in LOADERS + ("tu.make_loader", "make_loader"):
            return True
        return name.split(".")[-1] in _PASSING and bool(value.args) and \
            _loader_value(value.args[0], facts, seen)
    if not isinstance(value, ast.Name) or value.id in seen:
        return False
    seen.add(value.id)
    made = [n.value for n in ast.walk(facts.tree) if isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == value.id for t in n.targets)]
    if not made:  # a parameter, a global from elsewhere: may well be a loader
        return True
    return any(_loader_value(v, facts, seen) for v in made)


def _next_of_loader(loop, facts: ModuleFacts) -> bool:
    """Whether the loop's body takes its batches with `next(it)` from a loader: `it =
    iter(loader)`, or `it = infiniteloop(loader)`, a generator that loops over it."""
    def loader(name: str) -> bool:
        return any(isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                   and dotted(n.value.func) in LOADERS + ("tu.make_loader", "make_loader")
                   and any(dotted(t) == name for t in n.targets) for n in ast.walk(facts.tree))
    taken = {dotted(n.args[0]) for s in loop.body for n in ast.walk(s) if isinstance(n, ast.Call)
             and dotted(n.func) == "next" and n.args} - {""}
    return any(isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and n.value.args
               and any(dotted(t) in taken for t in n.targets)
               and (dotted(n.value.func) == "iter" or dotted(n.value.func) in facts.functions)
               and loader(dotted(n.value.args[0])) for n in ast.walk(facts.tree))


_SHAPES = {"view", "reshape", "expand", "new_zeros", "new_ones", "new_empty", "new_full"}
_MAKERS = {"torch.zeros", "torch.ones", "torch.empty", "torch.full", "torch.randn", "torch.rand",
           "torch.randint", "torch.arange", "range"}


def _batch_sizes(tree) -> set:
    """The source of every DataLoader's batch-size argument: `args.batch_size`, `bs`."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and dotted(node.func) in LOADERS:
            arg = node.args[1] if len(node.args) > 1 else next(
                (k.value for k in node.keywords if k.arg == "batch_size"), None)
            if arg is not None and not isinstance(arg, ast.Constant):
                out.add(ast.unparse(arg))
    return out


def _batch_tensor(loop) -> str:
    """The name the loop's first batch tensor is bound to: `x` of `for x, y in loader` and
    of `for i, (x, _) in enumerate(loader)`; '' where it is not plain to see."""
    target = loop.target
    if isinstance(loop.iter, ast.Call) and dotted(loop.iter.func) == "enumerate" and \
            isinstance(target, ast.Tuple) and len(target.elts) == 2:
        target = target.elts[1]
    if isinstance(target, ast.Tuple) and target.elts and isinstance(target.elts[0], ast.Name):
        return target.elts[0].id
    return ""


def _batch_shapes(ctx: Context, tree) -> None:
    sizes = _batch_sizes(tree)
    for loop in [n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.AsyncFor))]:
        if not sizes or not fed_by_loader(loop, ctx.facts) or isinstance(loop.iter, ast.Call) \
                and dotted(loop.iter.func) == "range":
            continue
        batch = _batch_tensor(loop)
        for node in [n for s in loop.body for n in ast.walk(s) if isinstance(n, ast.Call)]:
            if method(node) not in _SHAPES and dotted(node.func) not in _MAKERS:
                continue
            for arg in node.args:
                if ast.unparse(arg) not in sizes or ctx.edits.taken(arg):
                    continue
                if batch:
                    ctx.edits.replace(arg, f"{batch}.size(0)", f"{ast.unparse(arg)} as a shape -> "
                                      f"{batch}.size(0), the batch's own rows")
                else:
                    ctx.notes.add(arg.lineno, f"`{ctx.edits.source(node)}` shapes by the batch "
                                  f"size: at cores=8 a batch holds batch_size x 8 rows; use the "
                                  f"batch's own size (x.size(0))")


RULES = [
    Rule("loaders.dataloader", "DataLoader(...) becomes tu.make_loader(...), train=False "
         "where it does not shuffle; a DistributedSampler goes (make_loader shards); another "
         "sampler than Random/SubsetRandom/Sequential, a batch_sampler or *args is listed", ast.Call, called(*LOADERS), _port_loader),
]
PASSES = [
    Rule("loaders.batch-shape", "the loader's batch size used as a shape in a loop over a "
         "loader (view, reshape, torch.zeros, range, ...) becomes the batch's own size, "
         "x.size(0)", ast.Module, always, _batch_shapes),
]
