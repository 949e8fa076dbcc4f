"""Random state: one home for the Python, numpy, torch CPU and device generators.

The loader seeds the host generators per batch (`seeded`), and a checkpoint captures and
restores all four (`capture`, `restore`). All take `LOCK`, so a checkpoint never reads
or sets the generators while a batch loads with them seeded for it in another thread.
Replicas start from one state and move apart once their weights agree (`offset_by_rank`).
The replica whose generators these are is the caller's to pass (replica.py): this module
knows the engine only as what reads and sets the device's generator.
"""
from __future__ import annotations

import contextlib
import hashlib
import random
import sys
import threading
from typing import Any, Dict, Iterator

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


def capture(engine: Any) -> Dict[str, Any]:
    """This replica's generators, as plain values (numbers, lists, tensors): the host's
    and `engine`'s device generator."""
    import torch
    np = sys.modules.get("numpy")
    numpy_state = None
    with LOCK:
        if np is not None:
            kind, keys, pos, has_gauss, gauss = np.random.get_state()
            numpy_state = (kind, keys.tolist(), pos, has_gauss, gauss)
        python, cpu = random.getstate(), torch.get_rng_state()
    return {"python": python, "numpy": numpy_state, "torch": cpu, "device": engine.rng_state()}


def restore(saved: Dict[str, Any], engine: Any) -> None:
    """Put back what `capture` returned (here or in an earlier process), `engine`'s
    device generator included.

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
    engine.cut_step()
    engine.set_rng_state(saved["device"])


def offset_by_rank(rank: int, engine: Any, host: bool = True) -> None:
    """Reseed this replica's generators, each from its own state and `rank`: the device's
    (through `engine`) and, with `host`, torch's CPU one,
    Python's and numpy's (if numpy is imported).

    Replicas that share every state draw alike (a GAN's noise, dropout); after this,
    replica `rank` draws its own. The seeds come from a hash of the state bytes, not
    Python's `hash()` (salted per process), so a seeded run draws the same again. Rank 0
    is left alone by the engines, so the master draws what the original script draws.
    """
    import torch
    if host:
        np = sys.modules.get("numpy")
        with LOCK:
            random.seed(_seed(repr(random.getstate()).encode(), rank))
            cpu = torch.default_generator
            cpu.manual_seed(_seed(_bytes(cpu.get_state()), rank))
            if np is not None:
                kind, keys, pos, has_gauss, gauss = np.random.get_state()
                np.random.seed(_seed(keys.tobytes() + repr((kind, pos, has_gauss, gauss)).encode(),
                                     rank) % 2 ** 32)
    state = engine.rng_state()
    if state is not None:
        seed = _seed(_bytes(state), rank)
        if isinstance(state, int):  # XLA's generator state is its seed
            engine.set_rng_state(seed)
        else:  # CUDA's is a state tensor: that of a generator given the seed
            g = torch.Generator(device=engine.device())
            g.manual_seed(seed)
            engine.set_rng_state(g.get_state())


def _seed(state: bytes, rank: int) -> int:
    """A 63-bit seed from a generator's state and a rank, the same in every process."""
    digest = hashlib.sha256(state + b"/rank %d" % rank).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _bytes(state: Any) -> bytes:
    return str(state).encode() if isinstance(state, int) else state.cpu().numpy().tobytes()


def _tuples(o):
    return tuple(_tuples(v) for v in o) if isinstance(o, (list, tuple)) else o
