"""setup_tpu and friends: detection from a fake PCI bus, host fixes, the install hint,
and the promise that none of import/setup_tpu/scale_lr_bs starts the XLA runtime."""
import importlib.metadata
import math
import sys

import pytest

import tpu_utility as tu
from tpu_utility.environment import host_fixes, install_command, setup_tpu


def fake_pci(tmp_path, device_ids, vendor="0x1ae0"):
    tmp_path = tmp_path / "pci"
    tmp_path.mkdir()
    for i, dev in enumerate(device_ids):
        d = tmp_path / f"0000:00:0{i}.0"
        d.mkdir()
        (d / "vendor").write_text(vendor + "\n")
        (d / "device").write_text(dev + "\n")
    other = tmp_path / "0000:00:1f.0"  # a non-Google device is ignored
    other.mkdir()
    (other / "vendor").write_text("0x8086\n")
    (other / "device").write_text("0x0027\n")
    return str(tmp_path)


@pytest.mark.parametrize("device_id, chips, accelerator, devices", [
    ("0x0027", 4, "v3-8", 8),        # Kaggle's v3-8: 4 chips x 2 cores
    ("0x0063", 8, "v5litepod-8", 8),  # Kaggle's v5e-8
    ("0x0063", 1, "v5litepod-1", 1),  # free Colab
    ("0x005e", 4, "v4-8", 4),
])
def test_tpu_detection_from_pci(tmp_path, device_id, chips, accelerator, devices):
    env = {}
    info = setup_tpu(verbose=False, env=env, sysfs=fake_pci(tmp_path, [device_id] * chips))
    assert (info.accelerator, info.num_devices, info.platform) == (accelerator, devices, "gcp")
    assert env["PJRT_DEVICE"] == "TPU" and info.pjrt_device == "TPU"


def test_cpu_host_and_platforms(tmp_path, capsys):
    env = {}
    info = setup_tpu(env=env, sysfs=str(tmp_path))
    assert (info.platform, info.accelerator, info.num_devices) == ("cpu", "cpu", 8)
    assert env["PJRT_DEVICE"] == "CPU"
    assert info.torch_version and info.torch_xla_version
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "CPU only" in out and "8 device(s)" in out
    assert setup_tpu(verbose=False, env={"CPU_NUM_DEVICES": "2"}, sysfs=str(tmp_path)).num_devices == 2
    sysfs = fake_pci(tmp_path, ["0x0027"] * 4)
    assert setup_tpu(verbose=False, env={"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, sysfs=sysfs).platform == "kaggle"
    assert setup_tpu(verbose=False, env={"COLAB_RELEASE_TAG": "x"}, sysfs=sysfs).platform == "colab"
    named = setup_tpu(verbose=False, env={"TPU_ACCELERATOR_TYPE": "v3-8"}, sysfs=sysfs)
    assert named.accelerator == "v3-8"


def test_kaggle_host_fixes(tmp_path, capsys):
    # v3-8: one preset address, four processes to start.
    env = {"TPU_PROCESS_ADDRESSES": "local:8476", "TPU_WORKER_HOSTNAMES": "localhost"}
    info = setup_tpu(env=env, sysfs=fake_pci(tmp_path, ["0x0027"] * 4))
    assert "TPU_PROCESS_ADDRESSES" not in env and env["TPU_WORKER_HOSTNAMES"] == "localhost"
    assert info.fixes == ["TPU_PROCESS_ADDRESSES"]
    assert "fixed: TPU_PROCESS_ADDRESSES" in capsys.readouterr().out
    # v5e-8: a warning text where hostnames belong.
    env = {"TPU_WORKER_HOSTNAMES": "WARNING: could not determine TPU worker hostnames"}
    assert host_fixes(env, local_processes=8) == ["TPU_WORKER_HOSTNAMES"] and env == {}
    # A correct multi-process setting is left alone.
    env = {"TPU_PROCESS_ADDRESSES": "a:1,b:1,c:1,d:1", "TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3"}
    assert host_fixes(dict(env), local_processes=4) == []


def test_install_command_matches_installed_torch():
    cmd = install_command("2.9.0+cu128")
    assert cmd[:4] == [sys.executable, "-m", "pip", "install"]
    assert cmd[4:] == ["torch_xla[tpu]==2.9.0"]


def test_missing_torch_xla_on_a_tpu_host_names_the_pip_command(run_script, tmp_path):
    sysfs = fake_pci(tmp_path, ["0x0027"] * 4)
    proc = run_script(f"""
        import json, sys
        sys.modules["torch_xla"] = None  # the point of this test: torch_xla is absent
        import tpu_utility as tu
        from tpu_utility import environment
        res = {{}}
        try:
            tu.setup_tpu(env={{}}, sysfs={sysfs!r})
        except RuntimeError as e:
            res["message"] = str(e)
        ran = []
        environment.subprocess.run = lambda cmd, check: ran.append(cmd)  # no download in tests
        try:
            tu.setup_tpu(install=True, env={{}}, sysfs={sysfs!r})
        except Exception:
            pass
        res["ran"] = ran
        print("RESULT", json.dumps(res))
    """)
    r = proc.result
    assert "torch_xla is not installed" in r["message"]
    torch_version = importlib.metadata.version("torch").split("+")[0]  # the pair's torch
    assert f"pip install torch_xla[tpu]=={torch_version}" in r["message"]
    assert r["ran"] == [[sys.executable, "-m", "pip", "install", f"torch_xla[tpu]=={torch_version}"]]


def test_import_setup_and_scaling_do_not_start_the_runtime(run_script):
    proc = run_script("""
        import json, sys
        import tpu_utility as tu
        cheap = "torch_xla" not in sys.modules and "torch" not in sys.modules
        tu.setup_tpu()
        tu.scale_lr_bs(1e-3, 32)
        tu.master_print("hello")
        import torch_xla
        print("RESULT", json.dumps({"cheap_import": cheap,
            "started": torch_xla._XLAC._xla_runtime_is_initialized()}))
    """, fresh=True)  # what `import tpu_utility` imports: a process that imported nothing yet
    assert proc.result == {"cheap_import": True, "started": False}


def test_scale_lr_bs_closed_form(capsys):
    s = tu.scale_lr_bs(2e-4, 32, cores=8)
    assert math.isclose(s.lr, 1.6e-3) and (s.batch_size, s.global_batch_size) == (32, 256)
    assert capsys.readouterr().out.count("\n") == 1
    s = tu.scale_lr_bs(2e-4, 32, cores=8, rule="sqrt", verbose=False)
    assert math.isclose(s.lr, 2e-4 * math.sqrt(8))
    assert tu.scale_lr_bs(1.0, 4, cores=1, verbose=False).lr == 1.0
    with pytest.raises(ValueError, match="rule must be"):
        tu.scale_lr_bs(1e-3, 32, cores=8, rule="cubic")
    with pytest.raises(ValueError, match="batch_size"):
        tu.scale_lr_bs(1e-3, 0, cores=8)
    with pytest.raises(ValueError, match="cores"):
        tu.scale_lr_bs(1e-3, 8, cores=0)


def test_a_scripts_own_logging_set_up_works_after_the_device_is_used(run_script, tmp_path):
    # torch_xla's import calls logging.basicConfig(), and the device's first use (inside
    # train_fn) imports it: the script's own basicConfig after that did nothing (no file,
    # no INFO or DEBUG lines), at 1 core and 8 alike. torch_xla's own warnings still show:
    # in the user's log where there is one, on stderr where there is none.
    for cores in (1, 8):  # each a fresh script: the device's first use is inside its run
        path = tmp_path / f"{cores}.log"
        run_script(f"""
            import logging
            import tpu_utility as tu

            def train_fn(path):
                tu.get_device()
                logging.basicConfig(filename=path, level=logging.DEBUG, format="%(levelname)s|%(message)s")
                logging.getLogger("train").info("epoch 1: loss 0.5")
                logging.debug("a detail")
                logging.getLogger("torch_xla").warning("torch_xla warns")

            if __name__ == "__main__":
                tu.run(train_fn, cores={cores}, args=({str(path)!r},))
        """, fresh=True, timeout=300)
        assert path.read_text().splitlines() == [
            "INFO|epoch 1: loss 0.5", "DEBUG|a detail", "WARNING|torch_xla warns"]
    quiet = run_script("""
        import logging
        import tpu_utility as tu

        def train_fn():
            tu.get_device()
            logging.getLogger("torch_xla").warning("torch_xla warns")

        if __name__ == "__main__":
            tu.run(train_fn, cores=1)
    """, fresh=True, timeout=300)
    assert "torch_xla warns" in quiet.stderr
