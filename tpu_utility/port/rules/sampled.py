"""Sampled-batch rule: a script that draws its own batch rows (`ix = torch.randint(len(data)
- block_size, (batch_size,))`) feeds no make_loader, so nothing splits its batch: under
tu.run every core computes every row of it (engine "spmd": the batch sits whole on each
device; replicas: each samples batch_size rows). The losses are right and the cores do
the same work, so port names the line and the fix, where a training loop reads no loader.
And a shape made from the settings' batch size where no batch tensor is in sight (a loss
building its labels from `self.args.batch_size`) is sized by `tu.rows_per_step`:
make_loader's batch size is per core, so at cores=8 (SPMD) a batch holds 8 times as many
rows."""
from __future__ import annotations

import ast
import re

from ..facts import dotted, method
from .loaders import LOADERS, fed_by_loader
from .rule import Context, Rule, always

_BATCH = re.compile(r"batch|(^|_)bs($|_)", re.I)


def sampled_rows(tree) -> list:
    """The `torch.randint(...)` calls that draw a batch's rows: their size names a batch size."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and dotted(n.func) in ("torch.randint", "randint", "np.random.randint")
            and any(_BATCH.search(dotted(x)) for a in n.args[1:] + [k.value for k in n.keywords
                                                                    if k.arg == "size"]
                    for x in ast.walk(a) if dotted(x))]


def _sampled_batches(ctx: Context, tree) -> None:
    if all(fed_by_loader(loop, ctx.facts) for loop in ctx.facts.step_loops):
        return
    for call in sampled_rows(tree):
        ctx.notes.add(call.lineno, f"`{ctx.edits.source(call)}` samples the batch's rows "
                      f"itself, so no make_loader splits them: at cores=8 every core computes "
                      f"all of them (the losses are right, the work is not shared); make a "
                      f"Dataset whose item i is the row sampled here and read it with "
                      f"tu.make_loader(dataset, batch_size // 8) in the training loop, which "
                      f"gives each core its own rows")


_MAKERS = {"torch.zeros", "torch.ones", "torch.empty", "torch.full", "torch.randn", "torch.rand",
           "torch.randint", "torch.arange", "torch.eye"}
_SHAPES = {"view", "reshape", "expand", "repeat"}


def _shapes_elsewhere(ctx: Context, tree) -> None:
    """A shape read from the settings' batch size (`torch.arange(self.args.batch_size)`) in
    a module that makes no loader: a loss or a helper the loop calls, which sees none of
    the batch's tensors, so port cannot use their rows (loaders.batch-shape does, in a
    loop). The size becomes `tu.rows_per_step(...)`: the same number at cores=1 and in a
    replica of its own, batch_size x the devices under SPMD, whose batch holds them all."""
    if any(isinstance(n, ast.Call) and dotted(n.func) in LOADERS for n in ast.walk(tree)):
        return
    for call in [n for n in ast.walk(tree) if isinstance(n, ast.Call)
                 and (dotted(n.func) in _MAKERS or method(n) in _SHAPES)]:
        for size in {x for a in call.args for x in ast.walk(a)
                     if isinstance(x, ast.Attribute) and x.attr == "batch_size" and dotted(x)}:
            text = ctx.edits.source(size)
            ctx.edits.replace(size, f"tu.rows_per_step({text})",
                              f"{text} -> tu.rows_per_step({text}): make_loader's batch_size is "
                              f"per core, and at cores=8 (SPMD) a batch holds {text} x 8 rows")


PASSES = [
    Rule("loaders.sampled-batch", "a batch whose rows the script samples itself "
         "(`torch.randint(n, (batch_size,))`) where no loader feeds the training loop is "
         "listed: every core computes all its rows; read a Dataset through tu.make_loader",
         ast.Module, always, _sampled_batches),
    Rule("loaders.batch-size-shape", "a shape made from a settings' `.batch_size` in a module "
         "that makes no loader (a loss the loop calls) becomes `tu.rows_per_step(...)`: at "
         "cores=8 (SPMD) a batch holds batch_size x 8 rows", ast.Module, always,
         _shapes_elsewhere),
]
