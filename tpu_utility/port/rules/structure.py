"""Structure rules: where the script trains. Its top-level training becomes a function run
by tu.run (the pipeline does that wrap, wrap.py); a training function called under the
`__main__` guard is called through tu.run; what is left at the top level, and results
indexed by the batch size, are listed."""
from __future__ import annotations

import ast
import re
from typing import List

from ..facts import LOOPS, OPTIMIZER, ModuleFacts, call_name, calls, dotted, method
from ..wrap import is_main_guard
from .device import device_choice, is_cuda_check, is_cuda_string, moves_to_cuda
from .rule import Context, Rule, always

_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def training_functions(functions: dict, known: frozenset = frozenset()) -> set:
    """Of the module's `functions`, those that call .backward(), or call (through others)
    one that does (or one of `known`, from earlier notebook cells)."""
    # by dotted name: `loops.train` of another module is one of `known` (project.py), as
    # are a class's `Loop.train` and `Trainer().train` (classes.py)
    called = {name: {call_name(n) for n in ast.walk(fn) if isinstance(n, ast.Call)} - {""}
              | _spawned(fn) for name, fn in functions.items()}
    found = {name for name, fn in functions.items()
             if calls(fn, "backward") or called[name] & set(known)}
    while True:
        more = {name for name in functions if name not in found and called[name] & found}
        if not more:
            return found
        found |= more


def _spawned(fn) -> set:
    """The functions `fn` starts with mp.spawn(worker, ...): port makes those calls."""
    return {n.args[0].id for n in ast.walk(fn) if isinstance(n, ast.Call) and n.args
            and isinstance(n.args[0], ast.Name) and dotted(n.func).endswith("spawn")}


def trains(stmt, in_guard: bool, facts: ModuleFacts, train_fns: set) -> bool:
    """Whether a top-level statement trains or touches the device: what must run inside
    tu.run. Under the `__main__` guard a lone call of a training function (a plain name) is
    not: that call becomes tu.run(that_function) itself; a call of a method that trains
    (`Trainer(model, opt).train(loader)`, `Loop.train(...)`) is wrapped with the guard."""
    for n in ast.walk(stmt):
        if isinstance(n, ast.Call):
            name = call_name(n)
            if moves_to_cuda(n) or method(n) == "backward" or OPTIMIZER.search(name) or \
                    name == "torch.accelerator.current_accelerator" or name == "torch.device" \
                    and n.args and (is_cuda_string(n.args[0]) or isinstance(n.args[0], ast.IfExp)):
                return True
            if name in train_fns and (not in_guard or facts.inside_loop(n)
                                      or not isinstance(n.func, ast.Name)):
                return True
        elif isinstance(n, ast.IfExp) and is_cuda_check(n.test) and is_cuda_string(n.body) or \
                isinstance(n, ast.Assign) and is_cuda_string(n.value) or \
                isinstance(n, ast.If) and device_choice(n):
            return True
    return False


def _globals_set_here(block, functions: dict) -> List[str]:
    """Names that `block` assigns and that the module's `functions` read without assigning
    them: globals that stop being global once `block` moves into a function."""
    assigned = {t.id for n in ast.walk(block) if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                if isinstance(t, ast.Name)}
    read = set()
    for fn in functions.values():
        local = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)} | {
            n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        read |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)
                 and isinstance(n.ctx, ast.Load) and n.id not in local}
    return sorted(assigned & read)


def _top_level_training(ctx: Context, tree) -> None:
    ctx.train_fns |= training_functions(ctx.facts.functions, ctx.train_fns)
    for stmt in getattr(tree, "body", []):
        if not is_main_guard(stmt) and not isinstance(stmt, _DEFINITIONS) and \
                not calls(stmt, "backward"):
            called = sorted({n.func.id for n in ast.walk(stmt) if isinstance(n, ast.Call)
                             and isinstance(n.func, ast.Name) and n.func.id in ctx.train_fns})
            if called:
                ctx.notes.add(stmt.lineno, f"{called[0]}() trains at the top level: move this "
                              f"code into a function (def train_fn(): ...) and call "
                              f"tu.run(train_fn, cores=8); notebooks too")
        if isinstance(stmt, LOOPS) and calls(stmt, "backward"):
            ctx.notes.add(stmt.lineno, "training at the top level: move it into a function "
                          "(def train_fn(): ...) and call tu.run(train_fn, cores=8); notebooks too")


def _main_guard(ctx: Context, tree) -> None:
    for guard in [s for s in getattr(tree, "body", []) if is_main_guard(s)]:
        for node in ast.walk(guard):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ctx.train_fns):
                continue
            if not ctx.facts.inside_loop(node):
                _run_call(ctx, node)
                continue
            shared = _globals_set_here(guard, ctx.facts.functions)
            ctx.notes.add(node.lineno, f"{node.func.id}() is called in a loop at the top: move "
                          f"the loop into one function and call tu.run(that_function, cores=8) "
                          f"once" + (f"; functions read {', '.join(shared)} as globals set "
                                     f"here: declare them `global` in that function, or pass "
                                     f"them" if shared else ""))


def _run_call(ctx: Context, node) -> None:
    name = node.func.id
    if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
        ctx.notes.add(node.lineno, f"call {name} through tu.run({name}, cores=8, args=(...)): "
                      f"run() passes positional arguments only")
        return
    args = [ctx.edits.source(a) for a in node.args]
    extra = f", args=({', '.join(args)},)" if args else ""
    ctx.edits.replace(node, f"tu.run({name}, cores=8{extra})", f"{name}() -> tu.run({name}, cores=8)")


def _batch_indexing(ctx: Context, tree) -> None:
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
                isinstance(part, ast.Slice) and
                re.search(r"\*\s*\w*(bs|batch)", ctx.edits.source(part) or "", re.I)
                for t in node.targets if isinstance(t, ast.Subscript)
                for part in ast.walk(t.slice)):
            ctx.notes.add(node.lineno, "results indexed by batch size: at cores=8 a batch is "
                          "not batch_size rows of the dataset in order; collect the outputs and "
                          "use tu.gather(outputs, loader), or tu.predict")


WRAP = Rule("structure.wrap", "a script's training at the top level (straight down the file, "
            "inline under the `__main__` guard) becomes `def train_fn()`, run by "
            "`tu.run(train_fn, cores=8)`", None, always, lambda ctx, tree: None)
PASSES = [
    Rule("structure.top-level-training", "training left at the top level (a notebook's "
         "cells) is listed: move it into a function run by tu.run", ast.Module, always,
         _top_level_training),
    Rule("structure.run-call", "a training function called under `if __name__ == "
         "'__main__':` is called through tu.run(fn, cores=8)", ast.Module, always, _main_guard),
    Rule("structure.batch-indexing", "results stored by batch-size slices are listed: use "
         "tu.gather or tu.predict", ast.Module, always, _batch_indexing),
]
