"""Mixed precision and I/O rules: autocast and GradScaler become tu's (bf16 on a TPU),
torch.save becomes tu.save, torch.cuda.synchronize() tu.sync(); tensors read on the host
inside loops are listed."""
from __future__ import annotations

import ast

from ..facts import GRAD_SCALERS, HOST_READS, dotted, method
from .device import is_cuda_string
from .rule import Context, Rule, called, method_called

AUTOCASTS = ("torch.cuda.amp.autocast", "autocast", "amp.autocast")


def _autocast(ctx: Context, node) -> None:
    if dotted(node.func) != "torch.autocast" or node.args and is_cuda_string(node.args[0]):
        ctx.edits.replace(node, "tu.autocast()", "autocast -> tu.autocast (bf16 on TPU)")


RULES = [
    Rule("io.save", "torch.save becomes tu.save (the master writes, one host transfer)",
         ast.Call, called("torch.save"),
         lambda ctx, node: ctx.edits.replace(node.func, "tu.save", "torch.save -> tu.save "
                                                                   "(master only, one transfer)")),
    Rule("amp.grad-scaler", "GradScaler() becomes tu.GradScaler()", ast.Call,
         called(*GRAD_SCALERS),
         lambda ctx, node: ctx.edits.replace(node, "tu.GradScaler()", "GradScaler -> tu.GradScaler")),
    Rule("amp.autocast", "torch.cuda.amp.autocast() and torch.autocast('cuda') become "
         "tu.autocast()", ast.Call, called(*AUTOCASTS, "torch.autocast"), _autocast),
    Rule("io.synchronize", "torch.cuda.synchronize() becomes tu.sync()", ast.Call,
         called("torch.cuda.synchronize"),
         lambda ctx, node: ctx.edits.replace(node, "tu.sync()", "torch.cuda.synchronize() -> tu.sync()")),
    Rule("io.host-read", "`.item()` every training step, and `.cpu()` / `.numpy()` / "
         "`.tolist()` / `.item()` batch by batch in evaluation, are listed", ast.Call,
         method_called("item", *HOST_READS), lambda ctx, node: ctx.notes.host_read(node, method(node))),
]
