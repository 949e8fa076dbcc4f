"""Environment and set-up: where are we running, and make the host ready for torch_xla.

Nothing here imports torch_xla or starts the XLA runtime: a TPU can only be claimed
once per process, so detection reads the PCI bus and the environment instead.
"""
from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from typing import List, Mapping, MutableMapping, Optional

# PCI ids of Google TPU chips (torch_xla/_internal/tpu.py at v2.9.0), with the TPU
# generation, and how many XLA devices one chip exposes (v2/v3 chips have two cores).
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_CHIPS = {
    "0x0027": ("v3", 2),  # v2 and v3 share the id; Kaggle and Colab only offer v3
    "0x005e": ("v4", 1),
    "0x0063": ("v5e", 1),
    "0x006f": ("v6e", 1),
    "0x0076": ("v7x", 1),
}
# A CPU "host" emulates a v3-8 / v5e-8 so that cores=8 code paths run unchanged.
CPU_DEFAULT_DEVICES = 8
_HOSTNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.\-_:]*$")


@dataclass
class TpuInfo:
    """What `setup_tpu` found. `num_devices` is the number of XLA devices on this host."""

    platform: str  # "kaggle", "colab", "gcp" or "cpu"
    accelerator: str  # e.g. "v3-8", "v5litepod-8", or "cpu"
    num_devices: int
    torch_version: Optional[str]
    torch_xla_version: Optional[str]
    pjrt_device: Optional[str]
    fixes: List[str] = field(default_factory=list)

    @property
    def has_tpu(self) -> bool:
        return self.accelerator != "cpu"

    @property
    def has_xla(self) -> bool:
        return self.torch_xla_version is not None

    def summary(self) -> str:
        xla = f"torch_xla {self.torch_xla_version}" if self.has_xla else "no torch_xla"
        where = f"TPU {self.accelerator}" if self.has_tpu else "CPU only"
        fixes = f"; fixed: {', '.join(self.fixes)}" if self.fixes else ""
        return (f"tpu_utility: {self.platform}, {where}, {self.num_devices} device(s), "
                f"torch {self.torch_version}, {xla}, PJRT_DEVICE={self.pjrt_device}{fixes}")


def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def xla_version() -> Optional[str]:
    """The installed torch_xla version, None when it cannot be imported; imports nothing."""
    try:
        if importlib.util.find_spec("torch_xla") is None:
            return None
    except (ImportError, ValueError):  # e.g. sys.modules["torch_xla"] = None
        return None
    return _version("torch_xla") or "unknown"


def tpu_chips(sysfs: str = "/sys/bus/pci/devices") -> List[str]:
    """TPU generation of every TPU chip on the PCI bus, e.g. ["v3", "v3", "v3", "v3"]."""
    chips = []
    for vendor_path in sorted(glob.glob(os.path.join(sysfs, "*", "vendor"))):
        try:
            with open(vendor_path) as f:
                if f.read().strip() != _GOOGLE_PCI_VENDOR:
                    continue
            with open(os.path.join(os.path.dirname(vendor_path), "device")) as f:
                device_id = f.read().strip()
        except OSError:
            continue
        if device_id in _TPU_CHIPS:
            chips.append(_TPU_CHIPS[device_id][0])
    return chips


def detect_platform(env: Mapping[str, str], has_tpu: bool) -> str:
    if "KAGGLE_KERNEL_RUN_TYPE" in env or "KAGGLE_URL_BASE" in env:
        return "kaggle"
    if "COLAB_RELEASE_TAG" in env or "COLAB_GPU" in env or "COLAB_TPU_ADDR" in env:
        return "colab"
    return "gcp" if has_tpu else "cpu"


def _accelerator_and_devices(chips: List[str], env: Mapping[str, str]):
    if not chips:
        return "cpu", int(env.get("CPU_NUM_DEVICES", CPU_DEFAULT_DEVICES))
    gen = chips[0]
    per_chip = dict(_TPU_CHIPS.values())[gen]
    devices = len(chips) * per_chip
    # Cloud names count TensorCores for v2-v4 (2 per chip) and chips from v5e on.
    size = len(chips) * 2 if gen in ("v3", "v4") else len(chips)
    name = {"v5e": "v5litepod", "v6e": "v6e", "v7x": "tpu7x"}.get(gen, gen)
    return env.get("TPU_ACCELERATOR_TYPE") or f"{name}-{size}", devices


def host_fixes(env: MutableMapping[str, str], local_processes: int) -> List[str]:
    """Remove the TPU variables that Kaggle presets wrongly on a single host.

    - Kaggle's v3-8 image presets TPU_PROCESS_ADDRESSES with one address, so a
      4-process start fails with "Expected 4 worker addresses, got 1".
    - Kaggle's v5e-8 image can hold a warning text in TPU_WORKER_HOSTNAMES, which
      libtpu rejects.
    Returns the names of the variables removed.
    """
    fixes = []
    addresses = env.get("TPU_PROCESS_ADDRESSES")
    if addresses is not None and len(addresses.split(",")) != local_processes:
        env.pop("TPU_PROCESS_ADDRESSES")
        fixes.append("TPU_PROCESS_ADDRESSES")
    hosts = env.get("TPU_WORKER_HOSTNAMES")
    if hosts is not None and not all(_HOSTNAME.match(h.strip()) for h in hosts.split(",")):
        env.pop("TPU_WORKER_HOSTNAMES")
        fixes.append("TPU_WORKER_HOSTNAMES")
    return fixes


def install_command(torch_version: Optional[str] = None) -> List[str]:
    """The pip command that installs the torch_xla matching the installed torch, for TPU.

    torch_xla only works with the torch of the same version, so an unpinned install
    on Kaggle would pull a new torch and break the image.
    """
    torch_version = torch_version or _version("torch")
    if torch_version is None:
        return [sys.executable, "-m", "pip", "install", "torch==2.9.0", "torch_xla[tpu]==2.9.0"]
    base = torch_version.split("+")[0]
    return [sys.executable, "-m", "pip", "install", f"torch_xla[tpu]=={base}"]


def setup_tpu(*, install: bool = False, verbose: bool = True,
              env: Optional[MutableMapping[str, str]] = None,
              sysfs: str = "/sys/bus/pci/devices") -> TpuInfo:
    """Detect TPU or CPU, set PJRT_DEVICE, apply host fixes; never starts the XLA runtime.

    Call it first, in the process that will call `run`. `install=True` runs the pip
    command that installs the torch_xla matching your torch when a TPU has none.

    Example:
        >>> import tpu_utility as tu
        >>> info = tu.setup_tpu(verbose=False)
        >>> info.platform in ("kaggle", "colab", "gcp", "cpu")
        True
    """
    env = os.environ if env is None else env
    chips = tpu_chips(sysfs)
    accelerator, num_devices = _accelerator_and_devices(chips, env)
    fixes = host_fixes(env, local_processes=len(chips)) if chips else []
    torch_xla_version = xla_version()
    if chips and torch_xla_version is None:
        cmd = install_command()
        if not install:
            raise RuntimeError(
                f"This host has a TPU ({accelerator}) but torch_xla is not installed: run "
                f"`{' '.join(cmd[2:])}` (or setup_tpu(install=True)), then restart the kernel.")
        subprocess.run(cmd, check=True)
        torch_xla_version = xla_version()
    pjrt = None
    if torch_xla_version is not None:
        env.setdefault("PJRT_DEVICE", "TPU" if chips else "CPU")
        pjrt = env["PJRT_DEVICE"]
    info = TpuInfo(detect_platform(env, bool(chips)), accelerator, num_devices,
                   _version("torch"), torch_xla_version, pjrt, fixes)
    if verbose:
        print(info.summary(), flush=True)
    return info


def in_notebook() -> bool:
    """True inside a Jupyter kernel, where only the `fork` start method can run cell code."""
    shell = sys.modules.get("IPython")
    ip = shell.get_ipython() if shell is not None and hasattr(shell, "get_ipython") else None
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


def runtime_started() -> bool:
    """Whether this process already holds the XLA runtime, checked without starting it."""
    if "torch_xla" not in sys.modules:
        return False
    import torch_xla
    return bool(torch_xla._XLAC._xla_runtime_is_initialized())
