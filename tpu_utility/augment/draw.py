"""The augmentations' random numbers: a counter-based generator, run on the device.

Every random number of an augmentation is a hash of two integers: the sample's key and
the number's stream (which parameter it is). The loader makes each sample's key on the
host, from (make_loader's seed, the epoch, the sample's place in the epoch's global
order), for a whole batch in one vectorised op, and uploads the keys with the batch;
on the device the parameters are hashed from them with 32-bit integer ops that XLA
lowers. Nothing passes through a Python number, and nothing depends on how many graph
cuts came before (torch_xla's own generator moves on at every cut, and starts at the
same seed in every process), so:
- a seeded run draws the same parameters again, on any engine and any number of cores;
- a resumed run draws what the uninterrupted one would have: the loader's place, which
  every checkpoint holds, is the generator's whole state;
- each sample has its own parameters, and replicas, which load different samples, draw
  different ones.

The hash is lowbias32 (Chris Wellons' hash-prospector), on int32 with wrapping
multiplies. torch_xla shifts negative int32 wrongly (`-5 >> 16` gives 0 on XLA:CPU), so
every right shift here is done on a non-negative value.
"""
from __future__ import annotations

import functools
import math
import zlib
from typing import Sequence, Tuple

_M1 = 0x7FEB352D
_M2 = 0x846CA68B - 2 ** 32  # as a signed int32
_GOLDEN = 0x9E3779B9 - 2 ** 32
_MASK = 0xFFFFFFFF


def _shr(h, k: int):
    """Logical right shift of an int32 tensor, correct on XLA for negative values too."""
    import torch
    return ((h & 0x7FFFFFFF) >> k) | ((h < 0).to(torch.int32) << (31 - k))


def mix32(h):
    """lowbias32 of an int32 tensor (any device): a well-mixed 32-bit hash."""
    h = h ^ _shr(h, 16)
    h = h * _M1
    h = h ^ _shr(h, 15)
    h = h * _M2
    return h ^ _shr(h, 16)


def _mix_int(x: int) -> int:
    """mix32 of a Python int, for the per-batch constants made on the host."""
    x &= _MASK
    x ^= x >> 16
    x = (x * _M1) & _MASK
    x ^= x >> 15
    x = (x * (_M2 & _MASK)) & _MASK
    return x ^ (x >> 16)


def sample_keys(seed: int, epoch: int, places: Sequence[int]):
    """The int32 keys of the samples at `places` of epoch `epoch` (host, one op per batch)."""
    import torch
    base = _mix_int(_mix_int(seed) ^ (epoch & _MASK))
    base -= (base >> 31) << 32  # as a signed int32
    return mix32(torch.tensor(places, dtype=torch.int32) ^ base)


def uniforms(keys, n: int):
    """[len(keys), n] floats in [0, 1): streams 1 to n of every sample, on the keys' device."""
    return uniforms_at(keys, tuple(range(1, n + 1)))


def uniforms_at(keys, streams: Tuple[int, ...]):
    """[len(keys), len(streams)] floats in [0, 1): the numbered streams of every sample."""
    import torch
    h = mix32(keys.reshape(-1, 1) ^ _streams(streams).to(keys.device).reshape(1, -1))
    return _shr(h, 8).to(torch.float32) * 2.0 ** -24  # 24 bits: exact in float32


_FIRST_NAMED = 2 ** 20  # numbered streams (1, 2, ...) stay far below the named ones


def named_stream(name: str) -> int:
    """The stream number of an op's parameter `name`: from the name alone (CRC-32), so
    that an op added later draws without moving any other op's streams."""
    return _FIRST_NAMED + zlib.crc32(name.encode()) % (2 ** 31 - _FIRST_NAMED)


@functools.lru_cache(maxsize=8)
def _streams(streams: Tuple[int, ...]):
    """The streams' own hashes, on the host once (int32s that upload with each batch's ops,
    rather than a hash traced into every step)."""
    import torch
    return mix32(torch.tensor(streams, dtype=torch.int32) * _GOLDEN)


def normal(u1, u2):
    """Standard normal draws from two uniform tensors (Box-Muller)."""
    import torch
    return torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos(2 * math.pi * u2)


GAMMA_TRIES = 6  # candidates per draw; all rejected (p < 1e-7) gives the mode


def gamma_streams() -> int:
    """Uniform streams one `gamma` draw takes."""
    return 1 + 3 * GAMMA_TRIES


def gamma(alpha: float, u):
    """Gamma(alpha, 1) draws from `u`, [N, gamma_streams()] uniforms (Marsaglia-Tsang).

    The rejection loop runs as GAMMA_TRIES candidates side by side, the first accepted
    one kept: fixed shapes and no host read. alpha < 1 is boosted from alpha + 1."""
    import torch
    a = alpha + 1.0 if alpha < 1 else alpha
    d = a - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    t = GAMMA_TRIES
    z = normal(u[:, 1:1 + t], u[:, 1 + t:1 + 2 * t])
    v = (1.0 + c * z) ** 3
    accept = torch.log1p(-u[:, 1 + 2 * t:]) < 0.5 * z * z + d - d * v + d * torch.log(v.clamp_min(1e-30))
    accept = accept & (v > 0)
    first = accept.to(torch.int32).argmax(1, keepdim=True)  # the first accepted candidate
    out = torch.where(accept.any(1), (d * v).gather(1, first.to(torch.int64)).squeeze(1), torch.full_like(z[:, 0], d))
    if alpha < 1:
        out = out * (1.0 - u[:, 0]) ** (1.0 / alpha)
    return out


def beta(alpha: float, u):
    """Beta(alpha, alpha) draws from `u`, [N, 2 * gamma_streams()] uniforms."""
    n = gamma_streams()
    g = gamma(alpha, u[:, :2 * n].reshape(-1, n)).reshape(-1, 2)  # both gammas in one pass
    return g[:, 0] / g.sum(1).clamp_min(1e-30)
