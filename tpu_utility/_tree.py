"""Nested data: the one walker over tensors in dicts, lists, tuples and namedtuples.

Every module that looks inside a batch, a sample or a state dict goes through `flatten`
and `unflatten`, so they all agree on what a container is: moving a batch to the device,
bringing a checkpoint to the host, writing a sample to the cache, splitting a batch to
show it, counting a batch's samples. A leaf is anything else (or what `is_leaf` says).
`tensors_anywhere` and `replace_tensors_anywhere` reach further, wherever pickle does
(inside any object), for what must leave no tensor behind: run()'s result.
"""
from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Tuple


def flatten(data: Any, *, is_leaf: Optional[Callable[[Any], bool]] = None,
            plain: bool = False) -> Tuple[Dict[str, Any], List[Any]]:
    """(structure, leaves): the leaves in order, and a structure that `unflatten` fills.

    The structure is nested dicts: {"t": "leaf", "i": index}, {"t": "dict", "k": keys,
    "c": children}, {"t": "list" | "tuple", "c": children}. A dict subclass or a namedtuple
    keeps its type under "type", unless `plain` (a JSON-able structure, as the cache
    stores it: plain dicts and tuples).

    Example:
        >>> structure, leaves = flatten({"x": (1, 2), "y": [3]})
        >>> leaves
        [1, 2, 3]
        >>> unflatten(structure, [10, 20, 30])
        {'x': (10, 20), 'y': [30]}
    """
    leaves: List[Any] = []

    def walk(x):
        if is_leaf is not None and is_leaf(x):
            pass
        elif isinstance(x, Mapping):  # UserDicts too: transformers' BatchEncoding is one
            node = {"t": "dict", "k": list(x), "c": [walk(v) for v in x.values()]}
            return _typed(node, x, dict, plain)
        elif isinstance(x, (list, tuple)):
            node = {"t": "list" if isinstance(x, list) else "tuple", "c": [walk(v) for v in x]}
            return _typed(node, x, list if isinstance(x, list) else tuple, plain)
        leaves.append(x)
        return {"t": "leaf", "i": len(leaves) - 1}

    return walk(data), leaves


def _typed(node: Dict[str, Any], x: Any, base: type, plain: bool) -> Dict[str, Any]:
    if type(x) is not base and not plain:
        node["type"] = type(x)
    return node


def unflatten(structure: Dict[str, Any], leaves: List[Any]) -> Any:
    """The data `flatten` took apart, with `leaves` in place of its leaves."""
    t = structure["t"]
    if t == "leaf":
        return leaves[structure["i"]]
    items = [unflatten(c, leaves) for c in structure["c"]]
    cls = structure.get("type")
    if t == "dict":
        return (cls or dict)(zip(structure["k"], items))
    if cls is not None and hasattr(cls, "_fields"):  # a namedtuple takes its fields apart
        return cls(*items)
    return (cls or (list if t == "list" else tuple))(items)


def leaf_names(structure: Dict[str, Any], root: str = "sample") -> List[str]:
    """Each leaf's place, in leaf order, as Python would index it: `sample[0]['x']`."""
    if structure["t"] == "leaf":
        return [root]
    keys = structure["k"] if structure["t"] == "dict" else range(len(structure["c"]))
    return [name for k, c in zip(keys, structure["c"]) for name in leaf_names(c, f"{root}[{k!r}]")]


def map_tensors(data: Any, fn: Callable) -> Any:
    """`data` with `fn` applied to every tensor in it."""
    import torch
    if isinstance(data, torch.Tensor):  # the common case, without building a structure
        return fn(data)
    structure, leaves = flatten(data)
    return unflatten(structure, [fn(x) if isinstance(x, torch.Tensor) else x for x in leaves])


def batch_len(data: Any) -> int:
    """The number of samples in a batch: its first tensor's first dimension (1 for a
    0-dim tensor, 0 for a batch without tensors)."""
    import torch
    if not isinstance(data, torch.Tensor):
        data = next((x for x in flatten(data)[1] if isinstance(x, torch.Tensor)), None)
        if data is None:
            return 0
    return data.shape[0] if data.dim() else 1


def unbatch(batch: Any, who: str) -> list:
    """A collated batch as its samples: the i-th row of every tensor and array, put back
    in the batch's structure. A collated list of plain values (PIL images, strings) is a
    column of its own."""
    import numpy as np
    import torch
    arrays = (torch.Tensor, np.ndarray)

    def column(x):  # DataLoader's collate leaves these as a list of per-sample values
        return (isinstance(x, (list, tuple)) and len(x) > 0
                and not any(isinstance(v, arrays + (dict, tuple, list)) for v in x))

    structure, leaves = flatten(batch, is_leaf=column)
    for x in leaves:
        if not isinstance(x, arrays + (list, tuple)):
            raise TypeError(f"{who}: cannot split a batch of type {type(x).__name__}")
    if structure["t"] == "leaf":
        return list(leaves[0])
    n = min(len(x) for x in leaves) if leaves else 0
    return [unflatten(structure, [x[i] for x in leaves]) for i in range(n)]


def tensors_anywhere(data: Any) -> List[Any]:
    """Every tensor `data` holds, each once, wherever pickle would reach it: in dicts and
    lists, and inside any object it can pickle (dataclasses, `__slots__`, modules, a
    user's own classes, however deep). Raises what pickling `data` raises (a lambda, a
    generator, a file inside it). Tensors are not serialized: only the rest of `data` is
    walked, and written nowhere."""
    found: Dict[int, Any] = {}
    _Finder(_Discard(), found).dump(data)
    return list(found.values())


def replace_tensors_anywhere(data: Any, replacements: Dict[int, Any]) -> Any:
    """A copy of `data` (as pickling and unpickling it in this process would make) with
    `replacements[id(t)]` in place of each tensor `t` that `tensors_anywhere` found; other
    tensors stay the same objects. Unpickles only what it pickled from `data` here."""
    buf = io.BytesIO()
    kept: Dict[int, Any] = {}
    _Finder(buf, kept).dump(data)
    buf.seek(0)
    table = {key: replacements.get(key, t) for key, t in kept.items()}
    return _Loader(buf, table).load()


class _Discard:
    def write(self, b) -> int:
        return len(b)


class _Loader(pickle.Unpickler):
    """An unpickler that puts back each tensor `_Finder` wrote as a reference. (A method of
    a subclass: Python 3.13's Unpickler refuses `persistent_load` set on an instance.)"""

    def __init__(self, file, table: Dict[int, Any]):
        super().__init__(file)
        self._table = table

    def persistent_load(self, key):
        return self._table[key]


class _Finder(pickle.Pickler):
    """A pickler that writes each tensor as a reference (its id) and collects it."""

    def __init__(self, file, found: Dict[int, Any]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        import torch
        self._tensor, self._found = torch.Tensor, found

    def persistent_id(self, obj):
        if isinstance(obj, self._tensor):
            self._found.setdefault(id(obj), obj)
            return id(obj)
        return None
