"""Random state: one home for the Python, numpy, torch CPU and device generators.

The loader seeds the host generators per batch (`seeded`), and a checkpoint captures and
restores all four (`capture`, `restore`). Both take `LOCK`, so a checkpoint never reads
or sets the generators while a batch loads with them seeded for it in another thread.
"""
from __future__ import annotations

import contextlib
import random
import sys
import threading
from typing import Any, Dict, Iterator

from .engines import current

# Held while a batch loads outside a worker (num_workers=0: the XLA feed's thread) with the
# global generators seeded for it, and while a checkpoint reads or sets them.
LOCK = threading.RLock()


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Python's, numpy's and torch's CPU generators seeded with `seed` inside the block. In
    a DataLoader worker they are the worker's own; elsewhere (num_workers=0) the caller's
    states come back afterwards, so the training's random stream is untouched."""
    import torch
    from torch.utils.data import get_worker_info
    np = sys.modules.get("numpy")
    restore = get_worker_info() is None
    if restore:
        LOCK.acquire()
        saved = (random.getstate(), torch.default_generator.get_state(),
                 np.random.get_state() if np is not None else None)
    random.seed(seed)
    torch.default_generator.manual_seed(seed)
    if np is not None:
        np.random.seed(seed % 2 ** 32)
    try:
        yield
    finally:
        if restore:
            random.setstate(saved[0])
            torch.default_generator.set_state(saved[1])
            if np is not None:
                np.random.set_state(saved[2])
            LOCK.release()


def capture() -> Dict[str, Any]:
    """This replica's generators, as plain values (numbers, lists, tensors)."""
    import torch
    np = sys.modules.get("numpy")
    numpy_state = None
    with LOCK:
        if np is not None:
            kind, keys, pos, has_gauss, gauss = np.random.get_state()
            numpy_state = (kind, keys.tolist(), pos, has_gauss, gauss)
        python, cpu = random.getstate(), torch.get_rng_state()
    return {"python": python, "numpy": numpy_state, "torch": cpu, "device": current().rng_state()}


def restore(saved: Dict[str, Any]) -> None:
    """Put back what `capture` returned (here or in an earlier process).

    It was captured just after a step cut that the feed then skipped: skip the feed's
    next cut here too, or the first step would run one seed further on."""
    import torch
    with LOCK:
        random.setstate(_tuples(saved["python"]))
        if saved["numpy"] is not None:
            import numpy as np
            kind, keys, pos, has_gauss, gauss = saved["numpy"]
            np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
        torch.set_rng_state(saved["torch"])
    engine = current()
    engine.cut_step()
    engine.set_rng_state(saved["device"])


def _tuples(o):
    return tuple(_tuples(v) for v in o) if isinstance(o, (list, tuple)) else o
