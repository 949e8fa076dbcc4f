"""The TPU's own compiler on any host: jax's ahead-of-time compile, with libtpu, for a
described TPU topology (no TPU needed). jax's private calls live here alone.

A step's program (HLO text as torch_xla lowers it, its split parameters annotated) is
compiled for the target's chips, partitioned as torch_xla's SPMD partitions it, and the
compiler's buffer assignment (`memory`), its cost figures and, where it does not fit, its
own error come back. It runs in a child process of its own (`compile_in_child`), so jax
and a second libtpu never share a process with the user's torch_xla runtime.

`python -m tpu_utility.tpu_compile REQUEST.json RESULT.json` is that child.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

INSTALL = ('pip install "jax[tpu]==0.10.2" (checked: jax 0.10.2 with libtpu 0.0.42.1; it '
           'installs no torch or torch_xla)')
# libtpu, with no TPU in sight, otherwise asks the cloud's metadata server for minutes and
# warns it cannot tell the accelerator; a compile-only topology needs neither. Its lockfile
# (/tmp/libtpu_lockfile) would refuse a second compile while one runs: these use no chip.
_QUIET = {"JAX_PLATFORMS": "cpu", "TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
          "TPU_ACCELERATOR_TYPE": "v5litepod-8", "TPU_WORKER_HOSTNAMES": "localhost",
          "TPU_WORKER_ID": "0", "TF_CPP_MIN_LOG_LEVEL": "3"}


def available() -> Optional[str]:
    """None where jax and libtpu can be imported, else the sentence that says how."""
    missing = [m for m in ("jax", "libtpu") if not _found(m)]
    if not missing:
        return None
    return (f"planning for a TPU compiles with the TPU's own compiler, from jax and libtpu, "
            f"and this Python has no {' or '.join(missing)}: {INSTALL}")


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # sys.modules holds None for it: blocked
        return False


def check_api() -> None:
    """Import every private jax name this module calls; an ImportError or AttributeError
    names the one a jax release moved."""
    from jax._src import compiler  # noqa: F401
    from jax._src.interpreters import mlir
    from jax._src.lib import _jax, xla_client  # noqa: F401
    from jax._src.lib.mlir import ir  # noqa: F401
    from jax.experimental import topologies  # noqa: F401
    import jaxlib._hlo as hlo
    for owner, name in ((hlo, "hlo_module_from_text"), (_jax.mlir, "hlo_to_stablehlo"),
                        (mlir, "make_ir_context"), (compiler, "get_compile_options"),
                        (topologies, "get_topology_desc"), (xla_client, "DeviceList")):
        if not hasattr(owner, name):
            raise AttributeError(f"jax {_version()} has no {owner.__name__}.{name}, which "
                                 f"tpu_utility's TPU compile calls: {INSTALL}")


def _version() -> str:
    import jax
    return jax.__version__


def topology(name: str, megacore: bool = False, one_chip: bool = False):
    """The compile-only devices of topology `name` ("v5e:2x4")."""
    from jax.experimental import topologies
    kwargs = {}
    if one_chip:  # a 1x1 layout is not divisible by the default 2x2x1 host bounds
        kwargs["chips_per_host_bounds"] = (1, 1, 1)
    if megacore:  # a v4 chip is one device of two cores, as jax and torch_xla see it
        kwargs["chip_config_name"] = "megacore"
    return topologies.get_topology_desc(name, "tpu", **kwargs)


def compile_hlo(text: str, topo_name: str, donors: List[int], megacore: bool = False,
                one_chip: bool = False, hbm_mib: Optional[int] = None) -> Dict:
    """Compile HLO `text` for every device of `topo_name`, SPMD-partitioned by its
    `sharding=` annotations, with the arguments in `donors` donated (torch_xla donates the
    buffers a step overwrites; jax's HLO-to-StableHLO loses that). Returns the compiler's
    bytes per device (`argument`, `output`, `alias`, `temp`, `peak`, `code`), `flops` and
    `bytes_accessed` per device, or `error`, the compiler's words, where it refuses.
    `hbm_mib`: the HBM the compiler may use, in MiB (None: the chip's)."""
    import numpy as np
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import _jax, xla_client as xc
    from jax._src.lib.mlir import ir
    import jaxlib._hlo as hlo
    proto = hlo.hlo_module_from_text(text).as_serialized_hlo_module_proto()
    ctx = mlir.make_ir_context()
    module = ir.Module.parse(_jax.mlir.hlo_to_stablehlo(proto), context=ctx)
    with ctx:
        main = next(op for op in module.body.operations
                    if ir.StringAttr(op.attributes["sym_name"]).value == "main")
        count = len(main.regions[0].blocks[0].arguments)
        attrs = ir.ArrayAttr(main.attributes["arg_attrs"]) if "arg_attrs" in main.attributes else None
        marked = []
        for i in range(count):  # an unsplit program's arguments have no attributes at all
            d = ir.DictAttr(attrs[i]) if attrs is not None else ir.DictAttr.get({})
            kv = {d[j].name: d[j].attr for j in range(len(d))}
            if i in donors:
                kv["jax.buffer_donor"] = ir.BoolAttr.get(True)
            marked.append(ir.DictAttr.get(kv))
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(marked)
    devices = topology(topo_name, megacore, one_chip).devices
    n = len(devices)
    overrides = {"xla_tpu_max_hbm_size_mib": str(hbm_mib)} if hbm_mib else None
    opts = compiler.get_compile_options(num_replicas=1, num_partitions=n,
                                        device_assignment=np.array([d.id for d in devices]).reshape(1, n),
                                        env_options_overrides=overrides)
    build = opts.executable_build_options
    build.use_spmd_partitioning = n > 1
    build.use_shardy_partitioner = False  # torch_xla 2.8 and 2.9 annotate for GSPMD
    if n > 1:  # torch_xla leaves the outputs unannotated, to be propagated
        build.allow_spmd_sharding_propagation_to_output = [True]
    try:
        exe = devices[0].client.compile(module, executable_devices=xc.DeviceList(tuple(devices)),
                                        compile_options=opts)
    except Exception as e:  # the compiler's verdict: out of HBM, or a program it cannot build
        return {"error": _first_lines(str(e)), "devices": n, "kind": devices[0].device_kind}
    m = exe.get_compiled_memory_stats()
    cost = exe.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    return {"devices": n, "kind": devices[0].device_kind,
            "argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
            "alias": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes,
            "peak": m.peak_memory_in_bytes, "code": m.generated_code_size_in_bytes,
            "flops": float(cost.get("flops", 0.0)),
            "bytes_accessed": float(cost.get("bytes accessed", 0.0))}


def _first_lines(message: str) -> str:
    """The compiler's message without its source-location trace."""
    message = message.split("=== Source Location Trace", 1)[0].strip()
    return re.sub(r"\s+", " ", message)[:600]


def compile_in_child(text: str, topo_name: str, donors: List[int], *, megacore: bool = False,
                     one_chip: bool = False, hbm_mib: Optional[int] = None, timeout: float = 1800.0,
                     python: Optional[str] = None) -> Dict:
    """`compile_hlo` in a fresh process (this Python, or `python`), bounded by `timeout`
    seconds; the files it reads and writes are in a private folder removed after."""
    why = available() if python is None else None
    if why:
        raise RuntimeError(why)
    with tempfile.TemporaryDirectory(prefix="tpu_utility-plan-") as folder:
        request, result = os.path.join(folder, "request.json"), os.path.join(folder, "result.json")
        with open(request, "w") as f:
            json.dump({"text": text, "topology": topo_name, "donors": donors,
                       "megacore": megacore, "one_chip": one_chip, "hbm_mib": hbm_mib}, f)
        env = {**os.environ, **_QUIET}
        env.pop("PJRT_DEVICE", None)
        try:
            done = subprocess.run([python or sys.executable, "-m", "tpu_utility.tpu_compile",
                                   request, result], env=env, timeout=timeout,
                                  capture_output=True, text=True, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:  # subprocess.run kills it
            raise TimeoutError(f"the TPU compile for {topo_name} took over {timeout:.0f} s") from None
        if not os.path.exists(result):
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise RuntimeError(f"the TPU compile for {topo_name} ended with exit status "
                               f"{done.returncode} and no result: " + " | ".join(tail))
        with open(result) as f:
            return json.load(f)


def main(argv: List[str]) -> int:
    request, result = argv
    with open(request) as f:
        r = json.load(f)
    out = compile_hlo(r["text"], r["topology"], r["donors"], r["megacore"], r["one_chip"], r["hbm_mib"])
    partial = result + ".part"
    with open(partial, "w") as f:
        json.dump(out, f)
    os.replace(partial, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
