"""Environment and set-up: where are we running, and make the host ready for torch_xla.

Nothing here imports torch_xla or starts the XLA runtime: a TPU can only be claimed
once per process, so detection reads the PCI bus and the environment instead.
"""
from __future__ import annotations

import glob
import math
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from typing import List, Mapping, MutableMapping, Optional

from .compat import runtime_started, supports_gpu

# PCI ids of Google TPU chips (torch_xla/_internal/tpu.py at v2.9.0), with the TPU
# generation, and how many XLA devices one chip exposes (v2/v3 chips have two cores; v4
# and v5p fuse theirs into one "megacore" device).
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_CHIPS = {
    "0x0027": ("v3", 2),  # v2 and v3 share the id; Kaggle and Colab only offer v3
    "0x005e": ("v4", 1),
    "0x0062": ("v5p", 1),  # in torch_xla's list as "testing only"; not seen here on hardware
    "0x0063": ("v5e", 1),
    "0x006f": ("v6e", 1),
    "0x0076": ("v7x", 1),
}
# Memory per XLA device, GiB: a chip's HBM over its devices (v3: 16 GiB, 2 cores).
_HBM_GIB = {"v3": 8, "v4": 32, "v5p": 95, "v5e": 16, "v6e": 32, "v7x": 192}
_PJRT_DEVICES = ("CPU", "TPU", "CUDA", "GPU", "NEURON")
# A CPU "host" emulates a v3-8 / v5e-8 so that cores=8 code paths run unchanged.
CPU_DEFAULT_DEVICES = 8
_HOSTNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.\-_:]*$")


@dataclass
class TpuInfo:
    """What `setup_tpu` found. `num_devices` is the number of XLA devices on this host.

    Example:
        >>> import tpu_utility as tu
        >>> info = tu.TpuInfo("cpu", "cpu", 8, "2.9.0", "2.9.0", "CPU")
        >>> info.num_devices, info.hosts
        (8, 1)
    """

    platform: str  # "kaggle", "colab", "gcp" or "cpu"
    accelerator: str  # e.g. "v3-8", "v5litepod-8", or "cpu"
    num_devices: int
    torch_version: Optional[str]
    torch_xla_version: Optional[str]
    pjrt_device: Optional[str]
    fixes: List[str] = field(default_factory=list)
    cuda_devices: int = 0  # CUDA GPUs, counted where there is neither TPU nor torch_xla
    hosts: int = 1  # TPU hosts (workers) in this slice: more than 1 on a pod
    torchtpu: Optional[str] = None  # the version of Google's torch-tpu, when installed
    torch_reports_tpu: bool = False  # torch.accelerator is TorchTPU's "tpu" (no torch_xla)

    @property
    def has_tpu(self) -> bool:
        return self.accelerator != "cpu"

    @property
    def has_xla(self) -> bool:
        return self.torch_xla_version is not None

    def summary(self) -> str:
        xla = f"torch_xla {self.torch_xla_version}" if self.has_xla else "no torch_xla"
        where = f"TPU {self.accelerator}" if self.has_tpu else "CPU only"
        if self.cuda_devices:
            where = f"{self.cuda_devices} CUDA GPU(s)"
        if self.hosts > 1:
            where += f" (a pod of {self.hosts} hosts: run the same command on every one)"
        if self.torchtpu and not self.has_xla:
            xla += f", torch-tpu {self.torchtpu} (experimental)"
        fixes = f"; fixed: {', '.join(self.fixes)}" if self.fixes else ""
        return (f"tpu_utility: {self.platform}, {where}, {self.num_devices} device(s) here, "
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
    # Cloud names count TensorCores for v2-v4 and v5p (2 per chip), chips for v5e and v6e.
    size = len(chips) * 2 if gen in ("v3", "v4", "v5p") else len(chips)
    name = {"v5e": "v5litepod", "v6e": "v6e", "v7x": "tpu7x"}.get(gen, gen)
    return env.get("TPU_ACCELERATOR_TYPE") or f"{name}-{size}", devices


def device_memory_line(chips: List[str], devices: int, env: Mapping[str, str]) -> str:
    """What one device holds, and what that means for full fine-tuning with AdamW (16 bytes
    a parameter: weights, gradients, two moments; activations come on top)."""
    from .memory import LIMIT_ENV, parse_size
    if env.get(LIMIT_ENV):
        gib, where = parse_size(env[LIMIT_ENV]) / 2 ** 30, f"{LIMIT_ENV}"
    elif chips and chips[0] in _HBM_GIB:
        gib, where = _HBM_GIB[chips[0]], f"HBM of {chips[0]}"
    else:
        return (f"no limit on XLA:CPU ({LIMIT_ENV}=16G checks a run against a v5e chip; "
                f"report() shows a run's memory per device)")
    one, split = gib * 2 ** 30 / 16 / 1e9, gib * 2 ** 30 * devices / 16 / 1e9
    fits = (f"{one:.1f}B parameters replicated, {split:.1f}B split over {devices} with tu.fsdp"
            if devices > 1 else f"{one:.1f}B parameters")
    return (f"{gib:g} GiB per device ({where}): AdamW fine-tuning fits about {fits}, before "
            f"activations; report() shows a run's memory per device")


def pod_hosts(env: Mapping[str, str], chips: List[str]) -> int:
    """TPU hosts in this slice: TPU_WORKER_HOSTNAMES's count, or the accelerator type's
    size over this host's; 1 when neither says more (a single-host TPU, or no TPU)."""
    if not chips:
        return 1
    hostnames = env.get("TPU_WORKER_HOSTNAMES")
    if hostnames and all(_HOSTNAME.match(h.strip()) for h in hostnames.split(",")):
        return len(hostnames.split(","))
    size = re.compile(r"^[a-z0-9]+-(\d+)$")
    total = size.match(env.get("TPU_ACCELERATOR_TYPE", ""))
    here = size.match(_accelerator_and_devices(chips, {})[0])
    if total and here and int(total.group(1)) > int(here.group(1)):
        return int(total.group(1)) // int(here.group(1))
    return 1


def env_problems(env: Mapping[str, str], chips: List[str],
                 torch_xla_version: Optional[str]) -> List[str]:
    """Settings that contradict this host and would fail a run later, each with its fix."""
    problems = []
    raw = env.get("CPU_NUM_DEVICES")
    if not chips and raw is not None and not (raw.strip().isdigit() and int(raw) >= 1):
        problems.append(f"CPU_NUM_DEVICES={raw!r} must be a whole number >= 1 (how many "
                        f"virtual XLA:CPU devices): unset it, or set it to 8")
    pjrt = env.get("PJRT_DEVICE")
    if torch_xla_version and pjrt is not None:
        value = pjrt.strip().upper()
        if value == "TPU" and not chips:
            problems.append("PJRT_DEVICE=TPU, but this host has no TPU (none on its PCI bus): "
                            "unset PJRT_DEVICE (setup_tpu then uses the CPU), or run on a TPU host")
        elif value in ("CUDA", "GPU") and not supports_gpu(torch_xla_version):
            problems.append(f"PJRT_DEVICE={pjrt}, but torch_xla {torch_xla_version} has no GPU "
                            f"support: unset PJRT_DEVICE; to train on GPUs, uninstall torch_xla "
                            f"and run(cores=N) uses them over torch.distributed")
        elif value in ("CUDA", "GPU") and _version("torch_xla_cuda_plugin") is None:
            problems.append(f"PJRT_DEVICE={pjrt}, but torch_xla's CUDA plugin "
                            f"(torch_xla_cuda_plugin) is not installed: unset PJRT_DEVICE")
        elif value not in _PJRT_DEVICES:
            problems.append(f"PJRT_DEVICE={pjrt!r} is not one of {', '.join(_PJRT_DEVICES[:3])}: "
                            f"unset it (setup_tpu picks TPU or CPU)")
    return problems


def torchtpu_version() -> Optional[str]:
    """The version of Google's `torch-tpu` (TorchTPU), None when absent or another vendor's.

    SOPHGO ships a different package under the same name and import name, so the
    distribution's metadata must point at Google.
    """
    try:
        meta = importlib.metadata.distribution("torch-tpu").metadata
    except importlib.metadata.PackageNotFoundError:
        return None
    fields = ["Author", "Author-email", "Maintainer", "Maintainer-email", "Home-page", "Summary"]
    text = " ".join([meta.get(f) or "" for f in fields] + (meta.get_all("Project-URL") or []))
    return meta.get("Version") if "google" in text.lower() else None


def torch_reports_tpu() -> bool:
    """Whether torch's accelerator is TorchTPU's "tpu", registered and available.

    TorchTPU registers it only where TPU chips are on the PCI bus. This allocates nothing,
    and asks for availability only once the type is "tpu": for "cuda" that would start
    the driver, and forked replicas could no longer use their GPUs.
    """
    try:
        import torch
    except ImportError:
        return False
    acc = getattr(torch, "accelerator", None)
    if acc is None or not hasattr(acc, "current_accelerator"):
        return False
    device = acc.current_accelerator()
    return device is not None and device.type == "tpu" and acc.current_accelerator(check_available=True) is not None


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
    torch_xla_version = xla_version()
    problems = env_problems(env, chips, torch_xla_version)
    if problems:
        raise ValueError("setup_tpu: " + "; ".join(problems))
    accelerator, num_devices = _accelerator_and_devices(chips, env)
    fixes = host_fixes(env, local_processes=len(chips)) if chips else []
    torchtpu = None if torch_xla_version else torchtpu_version()
    if chips and torch_xla_version is None and torchtpu is None:
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
                   _version("torch"), torch_xla_version, pjrt, fixes,
                   cuda_devices=0 if chips or torch_xla_version else cuda_device_count(),
                   hosts=pod_hosts(env, chips), torchtpu=torchtpu,
                   torch_reports_tpu=bool(torchtpu) and torch_reports_tpu())
    if verbose:
        print(info.summary(), flush=True)
    return info


COMPILE_CACHE_VAR = "TPU_UTILITY_COMPILE_CACHE"


def compile_cache_dir(info: TpuInfo, env: Mapping[str, str] = os.environ) -> Optional[str]:
    """The folder where `run()` keeps XLA's compiled graphs across runs, or None (off).

    Every `run()` starts fresh processes that compile everything again; torch_xla's
    persistent cache lets a later run (the next notebook cell) load them instead. On by
    default on TPU hosts, in a private per-user folder ($XDG_CACHE_HOME or ~/.cache, then
    tpu_utility/xla-<torch_xla version>-<TPU>); `TPU_UTILITY_COMPILE_CACHE=0` turns it off and
    a path puts it there; torch_xla's own XLA_PERSISTENT_CACHE_PATH, if set, stands. Off on XLA:CPU, where torch_xla 2.9 writes the cache but cannot
    read it back ("Deserializing serialized executable not supported"). Not verified on
    TPU hardware.

    Example:
        >>> from tpu_utility.environment import TpuInfo, compile_cache_dir
        >>> compile_cache_dir(TpuInfo("cpu", "cpu", 8, "2.9.0", "2.9.0", "CPU")) is None
        True
    """
    setting = env.get(COMPILE_CACHE_VAR, "").strip()
    if setting.lower() in ("0", "off", "false", "no") or not (info.has_xla and info.has_tpu):
        return None
    if env.get("XLA_PERSISTENT_CACHE_PATH"):  # the user's own torch_xla setting stands
        return None
    home = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".cache")
    folder = setting or os.path.join(home, "tpu_utility", f"xla-{info.torch_xla_version}-{info.accelerator}")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise PermissionError(f"{folder} is not writable")
    except OSError as e:
        import warnings
        warnings.warn(f"run() compiles from scratch: it cannot keep compiled graphs in {folder} "
                      f"({e}); set {COMPILE_CACHE_VAR} to a writable folder, or to 0 to turn "
                      f"this off", RuntimeWarning, stacklevel=3)
        return None
    return folder


def cuda_device_count() -> int:
    """CUDA GPUs visible to torch (NVML's count: a fork made afterwards can still use CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()  # not is_available(): that initialises the driver


def in_notebook() -> bool:
    """True inside a Jupyter kernel, where only the `fork` start method can run cell code."""
    shell = sys.modules.get("IPython")
    ip = shell.get_ipython() if shell is not None and hasattr(shell, "get_ipython") else None
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


def versions_match(torch_version: Optional[str], torch_xla_version: Optional[str]) -> bool:
    """torch_xla X.Y.Z works with torch X.Y.Z only (local tags like +cu128 aside)."""
    if not torch_version or not torch_xla_version:
        return False
    return torch_version.split("+")[0] == torch_xla_version.split("+")[0]


def _fix_command(torch_version: Optional[str], has_tpu: bool) -> str:
    cmd = install_command(torch_version)
    if not has_tpu:  # no TPU: the plain torch_xla, which runs on CPU
        cmd = [c.replace("torch_xla[tpu]", "torch_xla") for c in cmd]
    return " ".join(["pip"] + cmd[3:])


def host_ram_gib() -> Optional[float]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return None


def batch_ceiling(ram_per_core_gib: float, sample_mib: float = 0.574) -> int:
    """A per-core batch size the host can buffer: a power of two.

    The input pipeline holds about 26 batches per core in host memory (loader and device
    prefetch queues, worker prefetch); allow a quarter of the core's share of RAM for it.
    `sample_mib` defaults to a 3x224x224 float32 image.
    """
    ceiling = ram_per_core_gib * 1024 / 4 / (26 * sample_mib)
    return 2 ** max(0, int(math.log2(ceiling))) if ceiling >= 1 else 1


def doctor(*, env: Optional[MutableMapping[str, str]] = None, sysfs: str = "/sys/bus/pci/devices",
           versions: Optional[Mapping[str, Optional[str]]] = None) -> int:
    """Print what matters when a TPU run fails; return the exit status (0 when all is well).

    Never starts the XLA runtime, and changes nothing (the host fixes are reported, not
    applied). Run it as `python -m tpu_utility doctor`.

    Example:
        >>> import tpu_utility as tu
        >>> status = tu.doctor()  # doctest: +ELLIPSIS
        tpu_utility doctor
        ...
    """
    env = dict(os.environ if env is None else env)
    versions = dict(versions or {})
    torch_v = versions.get("torch", _version("torch"))
    xla_v = versions["torch_xla"] if "torch_xla" in versions else xla_version()
    libtpu_v = versions.get("libtpu", _version("libtpu") or _version("libtpu-nightly"))
    torchtpu_v = versions["torch-tpu"] if "torch-tpu" in versions else torchtpu_version()
    chips = tpu_chips(sysfs)
    problems = env_problems(env, chips, xla_v)
    if any(p.startswith("CPU_NUM_DEVICES") for p in problems):
        env.pop("CPU_NUM_DEVICES")  # reported below; count the default to go on
    accelerator, devices = _accelerator_and_devices(chips, env)
    hosts = pod_hosts(env, chips)
    ram = host_ram_gib()
    print("tpu_utility doctor")
    print(f"  platform        {detect_platform(env, bool(chips))}, "
          f"{'TPU ' + accelerator if chips else 'no TPU (CPU only)'}, {devices} device(s) expected"
          + (f" on each of {hosts} hosts (a pod: run the same command on every worker)" if hosts > 1 else ""))
    print(f"  torch           {torch_v or 'not installed'}")
    print(f"  torch_xla       {xla_v or 'not installed'}")
    print(f"  libtpu          {libtpu_v or ('not installed' if chips else 'not needed (no TPU)')}")
    if torchtpu_v:
        print(f"  torch-tpu       {torchtpu_v} (Google's TorchTPU: experimental, used when torch_xla "
              f"is not installed{'' if xla_v is None else '; torch_xla is, so it is not used'})")
    if xla_v is None and not (chips and torchtpu_v):
        problems.append(f"torch_xla is not installed: {_fix_command(torch_v, bool(chips))}")
    elif xla_v is not None and not versions_match(torch_v, xla_v):
        problems.append(f"torch {torch_v} and torch_xla {xla_v} do not match (torch_xla works "
                        f"only with the same torch version): {_fix_command(torch_v, bool(chips))}")
    elif xla_v is not None:
        print("  versions match  yes")
    print(f"  XLA runtime     {'already started in this process' if runtime_started() else 'not started'}")
    fixes = host_fixes(env, local_processes=len(chips)) if chips else []
    print(f"  host fixes      {', '.join(f'remove {f}' for f in fixes) if fixes else 'none needed'}"
          f"{' (setup_tpu() applies them)' if fixes else ''}")
    if ram is not None:
        per_core = ram / devices
        print(f"  host RAM        {ram:.1f} GiB, {per_core:.1f} GiB per core; per-core batch "
              f"ceiling about {batch_ceiling(per_core)} for 3x224x224 float32 inputs")
    print(f"  device memory   {device_memory_line(chips, devices, env)}")
    from .memory import last
    ran = last()
    if ran is not None:  # a run in this process (a notebook's): what it measured
        print(f"  last run        {ran}")
    print("  start method    notebooks: fork (run() picks it); scripts: spawn, so guard them "
          "with `if __name__ == \"__main__\":`")
    for p in problems:
        print(f"  PROBLEM         {p}")
    return 1 if problems else 0
