"""The hosts users have (Kaggle's v5e-8, Colab's v5e-1 and v6e-1, v4, v5p, pods), settings
that contradict them, and the TorchTPU runtime. Each host is built as a /sys tree and an
environment in a temporary folder; torch_xla is never faked."""
import sys
import textwrap

import pytest

import tpu_utility as tu
from conftest import ROOT, run_process, script_env
from test_environment import fake_pci
from tpu_utility.engines import choose
from tpu_utility.environment import env_problems, setup_tpu

KAGGLE_V5E = {"KAGGLE_KERNEL_RUN_TYPE": "Interactive", "TPU_PROCESS_ADDRESSES": "local",
              "TPU_WORKER_HOSTNAMES": "WARNING: could not determine TPU worker hostnames"}


@pytest.mark.parametrize("device_id, chips, env, accelerator, devices, engine_8, hosts", [
    ("0x0063", 8, KAGGLE_V5E, "v5litepod-8", 8, "spmd", 1),   # Kaggle: one process, 8 chips
    ("0x006f", 8, {}, "v6e-8", 8, "spmd", 1),
    ("0x0027", 4, {}, "v3-8", 8, "spmd", 1),                   # was 4 processes x 2 threads
    ("0x005e", 4, {}, "v4-8", 4, None, 1),                     # 4 cores: cores=8 is refused
    ("0x0062", 4, {}, "v5p-8", 4, None, 1),
    ("0x005e", 4, {"TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3,10.0.0.4,10.0.0.5"}, "v4-8", 4, None, 4),
    ("0x0063", 4, {"TPU_ACCELERATOR_TYPE": "v5litepod-16"}, "v5litepod-16", 4, None, 4),
])
def test_tpu_layouts(tmp_path, device_id, chips, env, accelerator, devices, engine_8, hosts):
    env = dict(env)
    info = setup_tpu(verbose=False, env=env, sysfs=fake_pci(tmp_path, [device_id] * chips))
    assert (info.accelerator, info.num_devices, info.hosts) == (accelerator, devices, hosts)
    every = "spmd" if hosts == 1 else "launch"  # a pod: a process per device on every host
    no_env = {}
    assert choose(1, info, env=no_env).name == "single"
    assert choose(devices, info, env=no_env).name == every
    # asked for, by argument or by environment, the other engine runs every device
    assert choose(devices, info, "launch", env=no_env).name == "launch"
    assert choose(devices, info, env={"TPU_UTILITY_ENGINE": "launch"}).name == "launch"
    if hosts == 1:
        assert choose(devices, info, "spmd", env=no_env).name == "spmd"
        assert choose(devices, info, env={"TPU_UTILITY_ENGINE": "spmd"}).name == "spmd"
    else:
        with pytest.raises(ValueError, match=f"a pod of {hosts} hosts: use engine='launch'"):
            choose(devices, info, "spmd", env=no_env)
    if engine_8:
        assert choose(8, info, env=no_env).name == engine_8
    else:
        with pytest.raises(ValueError, match=f"cores must be 1 or {devices}"):
            choose(8, info, env=no_env)
    if hosts > 1:
        assert f"a pod of {hosts} hosts" in info.summary()


def test_kaggle_v5e_presets_are_removed(tmp_path):
    env = dict(KAGGLE_V5E)
    info = setup_tpu(verbose=False, env=env, sysfs=fake_pci(tmp_path, ["0x0063"] * 8))
    assert info.platform == "kaggle"
    # torch_xla's own topology set-up uses setdefault: a preset "local" would win over it.
    assert sorted(info.fixes) == ["TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES"]
    assert "TPU_PROCESS_ADDRESSES" not in env and "TPU_WORKER_HOSTNAMES" not in env


@pytest.mark.parametrize("device_id, name", [("0x0063", "v5litepod-1"), ("0x006f", "v6e-1")])
def test_single_chip_colab_refuses_eight_cores_in_one_sentence(tmp_path, device_id, name):
    info = setup_tpu(verbose=False, env={"COLAB_RELEASE_TAG": "x"}, sysfs=fake_pci(tmp_path, [device_id]))
    assert (info.platform, info.accelerator, info.num_devices) == ("colab", name, 1)
    assert choose(1, info).name == "single"
    with pytest.raises(ValueError, match=f"cores must be 1 on this host \\(TPU {name} has one core\\)"):
        choose(8, info)


@pytest.mark.parametrize("env, chips, message", [
    ({"PJRT_DEVICE": "TPU"}, [], "PJRT_DEVICE=TPU, but this host has no TPU"),
    ({"PJRT_DEVICE": "CUDA"}, [], "PJRT_DEVICE=CUDA, but torch_xla"),  # 2.9: no GPU support;
    ({"PJRT_DEVICE": "GPU"}, [], "PJRT_DEVICE=GPU, but torch_xla"),    # 2.8: no CUDA plugin here
    ({"PJRT_DEVICE": "TPUU"}, [], "is not one of CPU, TPU, CUDA"),
    ({"CPU_NUM_DEVICES": "0"}, [], "CPU_NUM_DEVICES='0' must be a whole number >= 1"),
    ({"CPU_NUM_DEVICES": "-2"}, [], "CPU_NUM_DEVICES='-2' must be"),
    ({"CPU_NUM_DEVICES": "eight"}, [], "CPU_NUM_DEVICES='eight' must be"),
])
def test_contradictions_stop_setup_tpu_run_and_doctor(tmp_path, monkeypatch, capsys, env, chips, message):
    sysfs = fake_pci(tmp_path, chips)
    with pytest.raises(ValueError, match=message):
        setup_tpu(verbose=False, env=dict(env), sysfs=sysfs)
    assert tu.doctor(env=dict(env), sysfs=sysfs, versions={"torch_xla": "2.9.0", "torch": "2.9.0"}) == 1
    assert message.split(",")[0] in capsys.readouterr().out
    for key, value in env.items():  # run() checks this host before any work
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=message):
        tu.run(print, cores=1)


def test_gpu_on_torch_xla_2_8_needs_its_cuda_plugin():
    # torch_xla 2.8 still ran PJRT_DEVICE=CUDA, with its CUDA plugin; 2.9 cannot at all.
    assert env_problems({"PJRT_DEVICE": "CUDA"}, [], "2.8.0") == [
        "PJRT_DEVICE=CUDA, but torch_xla's CUDA plugin (torch_xla_cuda_plugin) is not installed: "
        "unset PJRT_DEVICE"]
    assert env_problems({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}, [], "2.9.0") == []
    assert env_problems({"PJRT_DEVICE": "TPU"}, ["v5e"], "2.9.0") == []
    assert env_problems({"PJRT_DEVICE": "TPU"}, [], None) == []  # without torch_xla it means nothing


# TorchTPU: a torch-tpu distribution's metadata, put on the path as a dist-info folder.
GOOGLE = """\
    Metadata-Version: 2.1
    Name: torch-tpu
    Version: 0.2.0
    Summary: TorchTPU: a native PyTorch backend for Cloud TPUs
    Author-email: Google LLC <pytorch-tpu@google.com>
    Project-URL: Homepage, https://github.com/google-pytorch/torch_tpu
"""
SOPHGO = """\
    Metadata-Version: 2.1
    Name: torch_tpu
    Version: 2.1.0.post1
    Summary: TPU bridge for PyTorch
    Author: sophgo
    Author-email: dev@sophgo.com
    Home-page: https://github.com/sophgo/torch-tpu
"""


def site_with(tmp_path, metadata):
    site = tmp_path / "site"
    if metadata:
        info = site / "torch_tpu-0.2.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(textwrap.dedent(metadata))
    else:
        site.mkdir()
    return site


DETECT = """
    import json, sys
    sys.modules["torch_xla"] = None  # TorchTPU hosts have no torch_xla
    import tpu_utility as tu
    from tpu_utility.engines import choose
    from tpu_utility.environment import torchtpu_version
    info = tu.setup_tpu(verbose=False, env={}, sysfs=SYSFS)
    out = {"version": torchtpu_version(), "info": info.torchtpu, "tpu": info.torch_reports_tpu}
    for name in (None, "torchtpu"):
        try:
            out[str(name)] = choose(8, info, name).name
        except ValueError as e:
            out[str(name)] = "ValueError: " + str(e)
    print("RESULT", json.dumps(out))
"""


@pytest.mark.parametrize("metadata, version", [(GOOGLE, "0.2.0"), (SOPHGO, None), (None, None)])
def test_torchtpu_detection(run_script, tmp_path, metadata, version):
    site = site_with(tmp_path, metadata)
    sysfs = fake_pci(tmp_path, ["0x0063"] * 8)  # a v5e-8 without torch_xla
    env = script_env()
    proc = run_script(DETECT.replace("SYSFS", repr(sysfs)), expect_ok=False,
                      PYTHONPATH=f"{env['PYTHONPATH']}:{site}")
    if version is None:  # a TPU with neither runtime: the install command, before any work
        assert proc.returncode != 0 and "torch_xla is not installed" in proc.stderr
        return
    r = proc.result
    assert r["version"] == r["info"] == version
    # This machine's torch has no tpu accelerator, so the engine is not chosen by itself,
    # and the CPU fallback is refused on a TPU host ...
    assert r["tpu"] is False and "torch reports no tpu accelerator" in r["None"]
    assert r["torchtpu"] == "torchtpu"  # ... but engine="torchtpu" forces it


def test_torchtpu_choice_on_a_host_that_reports_tpu():
    from tpu_utility.environment import TpuInfo
    info = TpuInfo("gcp", "v6e-8", 8, "2.13.0", None, None, torchtpu="0.2.0", torch_reports_tpu=True)
    assert choose(8, info).name == choose(1, info).name == "torchtpu"
    with pytest.raises(ValueError, match="cores must be 1 or 8"):
        choose(4, info)
    with_xla = TpuInfo("gcp", "v6e-8", 8, "2.9.0", "2.9.0", "TPU", torchtpu="0.2.0", torch_reports_tpu=True)
    assert choose(8, with_xla, env={}).name == "spmd"  # torch_xla present: TorchTPU is not used
    with pytest.raises(ValueError, match="runs where torch_xla is not installed"):
        choose(8, with_xla, "torchtpu")


def test_torchtpu_starts_with_spawn_only(tmp_path):
    from tpu_utility.engines import REGISTRY
    from tpu_utility.environment import TpuInfo
    info = TpuInfo("gcp", "v6e-8", 8, "2.13.0", None, None, torchtpu="0.2.0", torch_reports_tpu=True)
    with pytest.raises(ValueError, match="spawn only"):
        with REGISTRY["torchtpu"].prepare(info, 8, "fork", None):
            pass
    assert REGISTRY["torchtpu"].start_methods == ("spawn",)


def test_doctor_reports_torchtpu(tmp_path):
    site = site_with(tmp_path, GOOGLE)
    env = script_env()
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{site}"
    sysfs = fake_pci(tmp_path, ["0x006f"] * 8)
    code = (f"import sys; sys.modules['torch_xla'] = None; import tpu_utility as tu; "
            f"sys.exit(tu.doctor(env={{}}, sysfs={sysfs!r}))")
    proc = run_process([sys.executable, "-c", code], cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # a TPU with TorchTPU needs no torch_xla
    assert "torch-tpu       0.2.0 (Google's TorchTPU: experimental" in proc.stdout


def test_compiled_graphs_kept_in_a_private_folder_on_tpu_hosts_only(tmp_path, monkeypatch):
    import os
    import warnings
    from tpu_utility.engines.xla_single import XlaSingle
    from tpu_utility.environment import TpuInfo, compile_cache_dir
    tpu = TpuInfo("kaggle", "v5litepod-8", 8, "2.8.0", "2.8.0", "TPU")
    cpu = TpuInfo("cpu", "cpu", 8, "2.9.0", "2.9.0", "CPU")
    home = {"HOME": str(tmp_path / "home")}
    folder = compile_cache_dir(tpu, home)
    assert folder == str(tmp_path / "home" / ".cache" / "tpu_utility" / "xla-2.8.0-v5litepod-8")
    assert os.path.isdir(folder) and os.stat(folder).st_mode & 0o777 == 0o700
    xdg = compile_cache_dir(tpu, {**home, "XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert xdg.startswith(str(tmp_path / "xdg" / "tpu_utility"))
    assert compile_cache_dir(tpu, {**home, "TPU_UTILITY_COMPILE_CACHE": str(tmp_path / "mine")}) == str(tmp_path / "mine")
    # off: asked, torch_xla's own setting, or XLA:CPU (which cannot read the cache back)
    assert compile_cache_dir(tpu, {**home, "TPU_UTILITY_COMPILE_CACHE": "0"}) is None
    assert compile_cache_dir(tpu, {**home, "XLA_PERSISTENT_CACHE_PATH": "/x"}) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning on CPU
        assert compile_cache_dir(cpu, home) is None
        with XlaSingle.prepare(cpu, 1, "spawn", None) as setup:
            assert setup is None  # what every child gets: no cache
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("TPU_UTILITY_COMPILE_CACHE", raising=False)
    with XlaSingle.prepare(tpu, 1, "spawn", None) as setup:
        assert setup == folder
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.warns(RuntimeWarning, match="cannot keep compiled graphs in .*; set TPU_UTILITY_COMPILE_CACHE"):
        assert compile_cache_dir(tpu, {**home, "TPU_UTILITY_COMPILE_CACHE": str(blocked / "sub")}) is None
