"""Hugging Face models as they come: the loss they compute from `labels`, their logits, and
their attention masks built without asking the device a question every forward.

Nothing here imports transformers: a model is recognised by its output (a mapping with a
"loss"), and transformers' modules are patched only where the user already imported them.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Mapping
from typing import Iterator

# transformers decides per forward whether an attention mask is all ones, so it can drop
# it, with a tensor's truth value: a host read on XLA every step. It skips the question
# while tracing (the mask is then always built; the results are the same). The names it
# asks, per module: 4.x `is_torchdynamo_compiling()`, 5.x `is_tracing(tensor)`.
_ASKED = (
    ("transformers.modeling_attn_mask_utils", "is_torchdynamo_compiling"),  # 4.x BERT & co.
    ("transformers.masking_utils", "is_torchdynamo_compiling"),  # 4.x create_causal_mask
    ("transformers.masking_utils", "is_tracing"),  # 5.x, sdpa and eager alike
)
_lock = threading.Lock()
_saved: dict = {}
_depth = 0


def _as_when_tracing(*args, **kwargs) -> bool:
    return True


def _patch(module) -> None:
    for module_name, attr in _ASKED:
        if module_name == module.__name__ and hasattr(module, attr) and (module_name, attr) not in _saved:
            _saved[(module_name, attr)] = getattr(module, attr)
            setattr(module, attr, _as_when_tracing)


class _PatchOnImport:
    """A meta path finder for a train_fn that imports transformers after the run began:
    the modules that ask are patched as they load."""

    @staticmethod
    def find_spec(name, path, target=None):
        if name not in {m for m, _ in _ASKED}:
            return None
        for finder in sys.meta_path:
            if finder is _PatchOnImport or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                load = spec.loader.exec_module

                def exec_module(module, load=load):
                    load(module)
                    with _lock:
                        if _depth:
                            _patch(module)
                spec.loader.exec_module = exec_module  # this spec's own loader
                return spec
        return None


@contextlib.contextmanager
def masks_without_reads() -> Iterator[None]:
    """Inside the block, transformers builds every attention mask instead of reading the
    device to see whether it could skip one; outside, transformers is as it was. Nested and
    threaded uses share one patch, undone when the last block ends. transformers is never
    imported here: its modules are patched if loaded, or as they load.

    Example:
        >>> with masks_without_reads():
        ...     pass
    """
    global _depth
    with _lock:
        if _depth == 0:
            for module_name in {m for m, _ in _ASKED}:
                if module_name in sys.modules:
                    _patch(sys.modules[module_name])
            sys.meta_path.insert(0, _PatchOnImport)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                if _PatchOnImport in sys.meta_path:
                    sys.meta_path.remove(_PatchOnImport)
                for (module_name, attr), original in _saved.items():
                    setattr(sys.modules[module_name], attr, original)
                _saved.clear()


def model_loss(output, who: str):
    """The loss a model computed itself: `output.loss`, or `output["loss"]`."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None:
        raise ValueError(
            f"{who}: no loss_fn was given, and the model returned {type(output).__name__} "
            f"without a loss: pass loss_fn=, or give the model its labels in the batch "
            f"(a dict batch with 'labels', as Hugging Face models take them)")
    if getattr(loss, "dim", lambda: 0)():  # shapes are the host's: no read of the device
        raise ValueError(
            f"{who}: no loss_fn was given, and the model's own loss has shape "
            f"{list(loss.shape)}, one per row, not one number: have the model return its "
            f"mean (loss.mean()), or pass loss_fn=")
    return loss


def is_model_output(output) -> bool:
    """Whether `output` is a transformers ModelOutput (recognised by class, not imported)."""
    return any(c.__name__ == "ModelOutput" and c.__module__.startswith("transformers.")
               for c in type(output).__mro__)


def logits_and_labels(output, inputs, who: str = "metrics"):
    """What metrics receive for a model that computes its own loss: its logits (or its
    first output that is not the loss) and the labels among its inputs (the dict it was
    called with: the batch, or what batch_fn made of it)."""
    if isinstance(output, Mapping):
        logits = output.get("logits")
        if logits is None:
            logits = next((v for k, v in output.items() if k != "loss"), None)
    else:
        logits = getattr(output, "logits", None)
    if logits is None:
        raise ValueError(f"{who}: the metrics need the model's predictions, and it returned "
                         f"{type(output).__name__} with its loss alone: return its logits too "
                         f"(a dict with 'logits'), or pass loss_fn= and return the logits")
    labels = inputs.get("labels", inputs.get("label")) if isinstance(inputs, Mapping) else None
    return logits, labels


def position_limit():
    """The fewest positions a Hugging Face model alive in this process takes (its config's
    `max_position_embeddings`, GPT-2's `n_positions` by its alias), or None: make_loader
    never pads text past it, where a BERT-like model, numbering every column, would fail
    on a length it never saw in the data. Found once per loader, in the process that
    trains, by looking for the models (about 0.2 s where a model is alive): the loader
    never sees the model a user's own loop calls, and a tokenizer may have no limit.

    Example:
        >>> position_limit() is None  # no transformers model made here
        True
    """
    import gc
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:  # no model class was ever loaded: no model exists
        return None
    classes, todo = set(), [modeling.PreTrainedModel]
    while todo:
        cls = todo.pop()
        if cls not in classes:
            classes.add(cls)
            todo.extend(cls.__subclasses__())
    # type(), not isinstance: some module objects warn when their __class__ is asked
    limits = [getattr(getattr(o, "config", None), "max_position_embeddings", None)
              for o in gc.get_objects() if type(o) in classes]
    limits = [n for n in limits if isinstance(n, int) and not isinstance(n, bool) and n > 0]
    return min(limits, default=None)
