"""Mixed precision and I/O rules: autocast and GradScaler become tu's (bf16 on a TPU),
torch.save becomes tu.save, torch.cuda.synchronize() tu.sync(); tensors read on the host
inside loops are listed."""
from __future__ import annotations

import ast

from ..facts import GRAD_SCALERS, HOST_READS, dotted, method
from .device import is_cuda_string
from .rule import Context, Rule, called, method_called

AUTOCASTS = ("torch.cuda.amp.autocast", "autocast", "amp.autocast")


# the parameters of each spelling, in order (a positional argument is named by its place)
_AUTOCAST_PARAMS = ("enabled", "dtype", "cache_enabled")
_DEVICE_AUTOCAST_PARAMS = ("device_type", "dtype", "enabled", "cache_enabled")
_SCALER_PARAMS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled")
_HALF = ("torch.bfloat16", "torch.float16", "torch.half")


def arguments(node, params) -> dict:
    """{parameter: argument node} of a call, positional ones named by `params`."""
    named = dict(zip(params, node.args))
    named.update({k.arg: k.value for k in node.keywords if k.arg})
    return named


def _autocast(ctx: Context, node) -> None:
    name = dotted(node.func)
    device_first = name in ("torch.autocast", "torch.amp.autocast")
    args = arguments(node, _DEVICE_AUTOCAST_PARAMS if device_first else _AUTOCAST_PARAMS)
    if device_first and not is_cuda_string(args.get("device_type")):
        return  # torch.autocast("cpu"), or a device port cannot read: left as it is
    enabled = args.get("enabled")
    # enabled= keeps its meaning: autocast(enabled=args.fp16) off stays off (full precision)
    new = f"tu.autocast(enabled={ctx.edits.source(enabled)})" if enabled is not None else "tu.autocast()"
    if ctx.edits.replace(node, new, f"autocast -> {new} (bf16 on TPU)"):
        dtype = args.get("dtype")
        # float16 -> bfloat16 is the swap itself (tu.autocast's documented policy); any
        # other dtype (float32, or a name set elsewhere) may mean something else
        if dtype is not None and dotted(dtype) not in _HALF:
            ctx.notes.add(node.lineno, f"`{ctx.edits.source(node)}` asked for "
                          f"{ctx.edits.source(dtype)}: tu.autocast computes in bfloat16 on a "
                          f"TPU (float16 on a GPU); where that dtype can be float32, pass "
                          f"enabled=False for it (tu.autocast(enabled=...))")


def _grad_scaler(ctx: Context, node) -> None:
    # torch.amp.GradScaler("cuda", ...) names its device first; tu.GradScaler picks it
    params = (("device",) if dotted(node.func) == "torch.amp.GradScaler" else ()) + _SCALER_PARAMS
    kept = [f"{k}={ctx.edits.source(v)}" for k, v in arguments(node, params).items() if k != "device"]
    new = f"tu.GradScaler({', '.join(kept)})"
    # enabled=False stays a scaler that does nothing, as torch's
    ctx.edits.replace(node, new, f"GradScaler -> {new} (its arguments kept)" if kept else
                      "GradScaler -> tu.GradScaler")


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
    Rule("amp.grad-scaler", "GradScaler(...) becomes tu.GradScaler(...), its arguments "
         "(enabled=) kept", ast.Call, called(*GRAD_SCALERS), _grad_scaler),
    Rule("amp.autocast", "torch.cuda.amp.autocast() and torch.autocast('cuda') become "
         "tu.autocast(), enabled= kept; a dtype other than bfloat16 is listed", ast.Call,
         called(*AUTOCASTS, "torch.autocast", "torch.amp.autocast"), _autocast),
    Rule("io.synchronize", "torch.cuda.synchronize() becomes tu.sync()", ast.Call,
         called("torch.cuda.synchronize"),
         lambda ctx, node: ctx.edits.replace(node, "tu.sync()", "torch.cuda.synchronize() -> tu.sync()")),
    Rule("io.host-read", "`.item()` every training step, and `.cpu()` / `.numpy()` / "
         "`.tolist()` / `.item()` batch by batch in evaluation, are listed", ast.Call,
         method_called("item", *HOST_READS), lambda ctx, node: ctx.notes.host_read(node, method(node))),
]
