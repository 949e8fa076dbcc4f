"""Step rules: an optimizer's step becomes tu.optimizer_step (which averages gradients over
replicas); a manual update (`p.data.add_(p.grad, alpha=-lr)`) gets its gradients averaged
first; a step that no make_loader feeds ends with the graph cut its feed would have made
(tu.sync()): without it XLA's graph grows by one step each step."""
from __future__ import annotations

import ast
import re
from typing import List, Tuple

from ..facts import GRAD_SCALERS, ModuleFacts, calls, dotted, method
from .loaders import fed_by_loader
from .rule import Context, Rule, always, method_called


def scheduler(name: str, facts: ModuleFacts) -> bool:
    """Whether `name.step()` steps a learning-rate schedule: the name says so, or it is
    assigned from a call whose name does (lr_scheduler.*, get_linear_schedule_with_warmup)."""
    made = [dotted(n.value.func) for n in ast.walk(facts.tree) if isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Call) and any(dotted(t) == name for t in n.targets)]
    return any(re.search("sched", text, re.I) for text in [name] + made)


def _assigned(name: str, facts: ModuleFacts) -> list:
    """The calls `name` is assigned from in the module: `scaler = GradScaler()`."""
    return [dotted(n.value.func) for n in ast.walk(facts.tree) if isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Call) and any(dotted(t) == name for t in n.targets)]


def _scaler(name: str, facts: ModuleFacts) -> bool:
    """Whether `name.step(opt)` is a GradScaler's: the name says so, or its maker does."""
    return "scaler" in name.lower() or any(m in GRAD_SCALERS for m in _assigned(name, facts))


def _made_here(name: str, facts: ModuleFacts) -> bool:
    return any(m in GRAD_SCALERS for m in _assigned(name, facts))


def blocks(tree):
    """Every statement list of `tree`: bodies, else branches, finally blocks, handlers'."""
    for node in ast.walk(tree):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block


def _root(node) -> Tuple[str, List[str]]:
    """('p', ['data']) for `p.data`: the name an attribute chain starts from, and its attributes."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else ""), attrs[::-1]


def _updated(stmt) -> str:
    """The parameters a manual update statement steps (source of the iterable of
    `for p in model.parameters(): p.data.add_(p.grad, alpha=-lr)`, or the tensor's name
    of `w -= lr * w.grad`), or '' for any other statement."""
    if isinstance(stmt, ast.For) and isinstance(stmt.target, ast.Name):
        p = stmt.target.id
        body = [n for s in stmt.body for n in ast.walk(s)]
        return ast.unparse(stmt.iter) if _reads_grad(body, p) and any(_updates(n, p) for n in body) else ""
    if isinstance(stmt, ast.With):  # with torch.no_grad(): for p in ...
        return ""
    nodes = list(ast.walk(stmt))
    for n in nodes[:1] + [getattr(stmt, "value", None)]:
        name = _root(n.target)[0] if isinstance(n, ast.AugAssign) else \
            _root(n.func.value)[0] if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) else ""
        if name and _updates(n, name) and _reads_grad(nodes, name):
            return name
    return ""


def _reads_grad(nodes, name: str) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "grad" and _root(n)[0] == name for n in nodes)


def _updates(node, name: str) -> bool:
    """Whether `node` changes tensor `name` (or its .data) in place, not its gradient."""
    if isinstance(node, ast.AugAssign):
        root, attrs = _root(node.target)
        return root == name and "grad" not in attrs
    if isinstance(node, ast.Assign):
        return any(_root(t) == (name, ["data"]) for t in node.targets)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
            node.func.attr.endswith("_") and not node.func.attr.startswith("_"):
        root, attrs = _root(node.func.value)
        return root == name and "grad" not in attrs
    return False


def _in_update(ctx: Context, stmt) -> bool:
    """Whether `stmt` is part of a `for p in params:` manual update (one update, not two)."""
    return any(isinstance(parent, ast.For) and _updated(parent)
               for parent, _ in ctx.facts.ancestors(stmt))


def _manual(ctx: Context, block) -> list:
    """(statement, parameters) of each manual update of `block`."""
    return [(stmt, params) for stmt in block for params in [_updated(stmt)]
            if params and not _in_update(ctx, stmt)]


def _insert(ctx: Context, stmt, code: str, before: bool) -> bool:
    if ctx.edits.insert_line(stmt, code, before):
        return True
    ctx.notes.add(stmt.lineno, f"add `{code}` on a line of its own "
                  f"{'before' if before else 'after'} this statement")
    return False


def _average_gradients(ctx: Context, tree) -> None:
    for block in blocks(tree):
        manual = _manual(ctx, block)
        if not manual:
            continue
        first, _ = manual[0]
        params = manual[0][1] if isinstance(first, ast.For) else \
            f"[{', '.join(dict.fromkeys(p for _, p in manual))}]"
        at = block.index(first)
        while at and calls(block[at - 1], "clip_grad_norm_") or at and \
                calls(block[at - 1], "clip_grad_value_"):
            at -= 1  # clipping needs the averaged gradients too, as DDP gives it
        if _insert(ctx, block[at], f"tu.average_gradients({params})", before=True):
            ctx.edits.swap(block[at].lineno, "manual update -> gradients averaged over "
                           "replicas first (tu.average_gradients)")


def _steps(ctx: Context, call) -> bool:
    """An optimizer's step, or one that port could not name (a closure optimizer's)."""
    return isinstance(call, ast.Call) and method(call) == "step" and \
        known_optimizer(ctx, call.func.value)


def _method_of(ctx: Context, node):
    """(the class, the method) whose body holds `node`, the innermost method; or None."""
    for parent, _ in ctx.facts.ancestors(node):
        if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)):
            above = next(iter(ctx.facts.ancestors(parent)), (None, None))[0]
            if isinstance(above, ast.ClassDef):
                return above, parent
    return None


def known_optimizer(ctx: Context, node) -> bool:
    """Whether `node` is an optimizer port knows: a name bound to one, or an attribute of a
    method's instance (`self.opt`) that its class holds one in (classes.py: made there, or
    set from an argument that a call of the class passes an optimizer)."""
    if isinstance(node, ast.Name):
        return node.id in ctx.optimizers
    if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
        return False
    found = _method_of(ctx, node)
    if found is None:
        return False
    cls, fn = found
    return bool(fn.args.args) and fn.args.args[0].arg == node.value.id and \
        node.attr in ctx.class_optimizers.get(cls.name, ())


def _own(ctx: Context, call) -> bool:
    """Whether `self.step(...)` calls a method of the instance of the method around it."""
    found = _method_of(ctx, call)
    return found is not None and isinstance(call.func.value, ast.Name) and \
        bool(found[1].args.args) and found[1].args.args[0].arg == call.func.value.id


def _after_backward(ctx: Context, node) -> bool:
    """Whether `node` runs after a backward(): in a loop that calls it, or after one in
    the function that holds it (a method `def step(self, loss)`)."""
    if ctx.facts.inside_loop(node, ctx.facts.backward_loops):
        return True
    fn = next((p for p, _ in ctx.facts.ancestors(node)
               if isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    return fn is not None and any(isinstance(n, ast.Call) and method(n) == "backward" and
                                  (n.lineno, n.col_offset) < (node.lineno, node.col_offset)
                                  for n in ast.walk(fn))


def _in_body(node, loop, facts: ModuleFacts):
    """The statement of `loop`'s body that holds `node`."""
    for parent, _ in facts.ancestors(node):
        if parent is loop:
            return node
        node = parent
    return node


def _sync(ctx: Context, tree) -> None:
    updates = []  # statements that update the weights, in source order
    for block in blocks(tree):
        updates += [stmt for stmt, _ in _manual(ctx, block)]
        updates += [stmt for stmt in block if isinstance(stmt, ast.Expr) and _steps(ctx, stmt.value)]
    ends = {}  # step loop -> the statement of its body after which the step ends
    for stmt in sorted(updates, key=lambda n: (n.lineno, n.col_offset)):
        loops = ctx.facts.loops_around(stmt)
        if loops:
            ends[loops[0]] = _in_body(stmt, loops[0], ctx.facts)
    for loop, last in ends.items():
        if not fed_by_loader(loop, ctx.facts) and _insert(ctx, last, "tu.sync()", before=False):
            ctx.edits.swap(last.end_lineno, "the step's end -> tu.sync() (no make_loader cuts "
                           "this loop's graph)")
            ctx.notes.add(loop.lineno, "this training loop reads no DataLoader: with cores=8 "
                          "every core computes the same batches (right, but no faster); make a "
                          "Dataset of them and read it with tu.make_loader to split them over "
                          "the cores")


def _optimizer_step(ctx: Context, node) -> None:
    # a name (`opt`) or an attribute chain (`self.opt`): `f().step()` is none of port's
    opt = dotted(node.func.value) or None
    known = known_optimizer(ctx, node.func.value)
    closure = node.args + [k.value for k in node.keywords if k.arg == "closure"]
    if known and len(node.args) + len(node.keywords) == len(closure) <= 1:
        # LBFGS: step(closure) calls the closure, which runs backward(), as often as it needs
        args = "".join(f", {ctx.edits.source(c)}" for c in closure)
        ctx.edits.replace(node, f"tu.optimizer_step({opt}{args})",
                          f"{opt}.step() -> tu.optimizer_step({opt}{args})")
    elif opt is not None and _scaler(opt, ctx.facts) and len(node.args) == 1:
        if not _made_here(opt, ctx.facts):  # made elsewhere: port cannot see it is tu's
            ctx.notes.add(node.lineno, f"`{ctx.edits.source(node)}`: keep it, and make "
                          f"{opt} with tu.GradScaler() where it is made (its step averages "
                          f"the gradients over replicas, as tu.optimizer_step)")
    elif opt is not None and not known and not scheduler(opt, ctx.facts) and not _own(ctx, node) \
            and not any(known_optimizer(ctx, a) for a in node.args) \
            and _after_backward(ctx, node):
        # (scaler.step(optimizer) steps an optimizer port knows)
        ctx.notes.add(node.lineno, f"`{ctx.edits.source(node)}` after backward(): port "
                      f"does not know {opt} as an optimizer; if it is one, make it "
                      f"tu.optimizer_step({opt}), which averages the gradients over "
                      f"replicas; if it updates the weights itself, call "
                      f"tu.average_gradients(params) before it",
                      fix=[(node, f"tu.optimizer_step({opt})")])


CALL_RULES = [
    Rule("steps.optimizer-step", "`opt.step()` (and LBFGS's `opt.step(closure)`) on a name "
         "bound to an optimizer, or `self.opt.step()` where the class holds one, becomes "
         "tu.optimizer_step(opt); an unknown `x.step()` after backward() is listed", ast.Call,
         method_called("step"), _optimizer_step),
]
PASSES = [
    Rule("steps.average-gradients", "a manual update of parameters from their .grad gets "
         "tu.average_gradients(...) before it (before its clipping)", ast.Module, always,
         _average_gradients),
    Rule("steps.sync", "a training loop no make_loader feeds gets tu.sync() after its update "
         "(listed: every core computes the same batches)", ast.Module, always, _sync),
]
