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


# methods only a model has among the things scripts call save_pretrained on (a tokenizer,
# a config and a processor have save_pretrained too)
_MODEL_METHODS = ("parameters", "named_parameters", "state_dict", "train", "eval", "to", "cuda")


def _model_like(ctx: Context, name: str) -> bool:
    """Whether the script uses `name` as a model, or binds it to one unwrapped."""
    for node in ast.walk(ctx.facts.tree):
        if isinstance(node, ast.Call) and method(node) in _MODEL_METHODS and \
                dotted(node.func.value) == name:
            return True
        if isinstance(node, ast.Assign) and any(dotted(t) == name for t in node.targets) and \
                isinstance(node.value, ast.Call) and method(node.value) == "unwrap_model":
            return True
    return False


def _save_pretrained(ctx: Context, node) -> None:
    model = ctx.edits.source(node.func.value)
    ctx.edits.rewrite_call(node, ctx.edits.source(node.func), [],
                           f"state_dict=tu.to_cpu({model}.state_dict())")
    ctx.edits.swap(node.lineno, f"{model}.save_pretrained(...) -> with state_dict=tu.to_cpu(...): "
                                f"safetensors cannot read XLA tensors")


RULES = [
    Rule("io.save-pretrained", "a model's `save_pretrained(dir)` gets `state_dict=tu.to_cpu("
         "model.state_dict())`: safetensors cannot read XLA tensors", ast.Call,
         lambda ctx, node: method(node) == "save_pretrained" and
         not any(k.arg == "state_dict" for k in node.keywords) and
         _model_like(ctx, dotted(node.func.value)), _save_pretrained),
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
