"""The engine layer directly: which engine runs where, and each engine's contract (rank,
world size, sampler slices, reduce, gather order, broadcast) on what XLA:CPU can run."""
import os

import pytest
import torch

import tpu_utility as tu
from conftest import child_processes
from tpu_utility.engines import REGISTRY, choose
from tpu_utility.replica import current
from tpu_utility.environment import TpuInfo


def host(accelerator="cpu", devices=8, xla="2.9.0", gpus=0):
    return TpuInfo("gcp" if accelerator != "cpu" else "cpu", accelerator, devices, "2.9.0", xla,
                   "TPU" if accelerator != "cpu" else ("CPU" if xla else None), cuda_devices=gpus)


@pytest.mark.parametrize("info, cores, name", [
    (host(), 1, "single"),
    (host(), 8, "spmd"),                                   # XLA:CPU: SPMD, not replica threads
    (host("v5litepod-8"), 8, "spmd"),                      # Kaggle's v5e-8: one process, 8 chips
    (host("v5litepod-8"), 1, "single"),
    (host("v3-8"), 8, "spmd"),                             # v3-8: was 4 processes x 2 threads
    (host("v4-8", devices=4), 4, "spmd"),
    (host("v5litepod-1", devices=1), 1, "single"),         # Colab
    (host(xla=None), 8, "torch"),                          # no torch_xla, no GPU: one device
    (host(xla=None, gpus=1), 1, "torch"),
    (host(xla=None, gpus=2), 2, "distributed"),            # Kaggle's GPU T4 x2: NCCL
    (host(xla=None, gpus=2), 1, "torch"),
])
def test_automatic_choice(info, cores, name):
    assert choose(cores, info, env={}).name == name


@pytest.mark.parametrize("value, cores, name", [
    ("launch", 8, "launch"), ("spmd", 8, "spmd"),
    ("launch", 1, "single"),  # one core: no choice to make, the variable is not read
    ("", 8, "spmd"),
])
def test_engine_from_the_environment(value, cores, name):
    tpu = host("v5litepod-8")
    assert choose(cores, tpu, env={"TPU_UTILITY_ENGINE": value}).name == name
    assert choose(cores, tpu, "single" if cores == 1 else "spmd",
                  env={"TPU_UTILITY_ENGINE": "launch"}).name != "launch"  # an argument wins
    with pytest.raises(ValueError, match="TPU_UTILITY_ENGINE must be one of .*got 'lanch'"):
        choose(8, tpu, env={"TPU_UTILITY_ENGINE": "lanch"})
    with pytest.raises(ValueError, match="TPU_UTILITY_ENGINE=launch: engine='launch' on XLA:CPU"):
        choose(8, host(), env={"TPU_UTILITY_ENGINE": "launch"})


def test_the_first_line_names_the_engine_and_the_other():
    from tpu_utility.engines import describe
    tpu, cls = host("v5litepod-8"), choose(8, host("v5litepod-8"), env={})
    assert describe(cls, tpu, 8) == (
        "tpu_utility: engine 'spmd' on 8 device(s), one process; each batch split over the "
        "devices; for one process per device, pass engine='launch' to run() or set "
        "TPU_UTILITY_ENGINE=launch")
    assert describe(REGISTRY["launch"], tpu, 8).endswith(
        "for one process; each batch split over the devices, pass engine='spmd' to run() or "
        "set TPU_UTILITY_ENGINE=spmd")
    # on a CPU host the other cannot run 8 devices (its collectives hang): not offered
    assert describe(REGISTRY["spmd"], host(), 8) == \
        "tpu_utility: engine 'spmd' on 8 device(s), one process; each batch split over the devices"


@pytest.mark.parametrize("info, cores, engine, message", [
    (host(), 3, None, "cores must be 1 or 8 on this host"),
    (host("v5litepod-1", devices=1), 8, None, "v5litepod-1 has one core"),
    (host(xla=None, gpus=2), 8, None, r"cores must be 1 or 2 .*2 CUDA GPUs"),
    (host(xla=None, gpus=2), 4, "distributed", "cores must be 1 or 2"),
    (host(), 8, "launch", "would hang"),
    (host(xla=None), 1, "spmd", "needs torch_xla"),
    (host(), 0, "distributed", "cores must be >= 1"),
    (host(), 8, "threads", "engine must be one of"),
    (host(), 2.0, None, "cores must be an int"),
    (host(xla=None), 0, None, r"cores must be 1 on this host \(no torch_xla, no GPU"),
    (host(xla=None), -1, None, "cores must be 1 on this host"),
    (host(xla=None, gpus=1), 0, None, r"cores must be 1 on this host \(no torch_xla, one CUDA GPU"),
    (host(xla=None, gpus=2), -2, None, "cores must be 1 or 2"),
    (host(), -8, None, "cores must be 1 or 8"),
])
def test_refusals_name_the_fix(info, cores, engine, message):
    with pytest.raises(ValueError, match=message):
        choose(cores, info, engine)


def test_distributed_uses_nccl_on_gpus_and_gloo_elsewhere():
    backend = REGISTRY["distributed"]._backend
    assert backend(host(xla=None, gpus=2)) == "nccl"
    assert backend(host(xla=None)) == "gloo" and backend(host()) == "gloo"


def contract(out_dir):
    """What one replica sees of its engine; each replica keeps its own view."""
    e = current().engine
    ds = torch.utils.data.TensorDataset(torch.arange(40))
    loader = tu.make_loader(ds, batch_size=2, num_workers=0)
    r = e.rank
    view = {
        "rank": r, "tu_rank": tu.rank(), "world": tu.world_size(), "replicas": e.replicas,
        "shard": e.shard(), "per_step": e.per_step_batch(2), "master": tu.is_master(),
        "sum": e.all_reduce_sum([torch.tensor([1.0, r]), torch.tensor([float(r)])]),
        "gather": e.all_gather(torch.full((2, 3), float(r))),
        "epochs": [[b[0].tolist() for b in loader] for _ in range(2)],
    }
    t = torch.full((4,), float(r))
    e.broadcast([t])
    view["broadcast"] = t
    e.barrier()
    torch.save(view, os.path.join(out_dir, f"view{r}.pt"))


@pytest.mark.parametrize("world", [1, 3])
def test_distributed_engine_contract(world, tmp_path):
    tu.run(contract, cores=world, args=(str(tmp_path),), engine="distributed", start_method="fork", timeout=300)  # a hang's bound
    views = [torch.load(tmp_path / f"view{r}.pt") for r in range(world)]
    seen = [[], []]
    for r, v in enumerate(views):
        assert (v["rank"], v["tu_rank"], v["world"], v["replicas"]) == (r, r, world, world)
        assert v["shard"] == (world, r) and v["per_step"] == 2 and v["master"] == (r == 0)
        assert v["sum"][0].tolist() == [world, sum(range(world))] and v["sum"][1].item() == sum(range(world))
        assert v["gather"][:, 0].tolist() == [float(q) for q in range(world) for _ in range(2)]
        assert v["broadcast"].tolist() == [0.0] * 4
        for epoch in range(2):
            seen[epoch] += sum(v["epochs"][epoch], [])
    for epoch in range(2):  # the slices of one permutation: disjoint, all of it but drop_last's cut
        assert len(seen[epoch]) == len(set(seen[epoch])) == 40 // (2 * world) * 2 * world
    assert views[0]["epochs"][0] != views[0]["epochs"][1]  # reshuffled each epoch
    assert child_processes() == []


def test_local_engine_contract(tmp_path):
    tu.run(contract, cores=1, args=(str(tmp_path),), engine="torch")
    v = torch.load(tmp_path / "view0.pt")
    assert (v["rank"], v["world"], v["replicas"], v["shard"], v["master"]) == (0, 1, 1, (1, 0), True)
    assert v["sum"][0].tolist() == [1.0, 0.0] and v["gather"].shape == (2, 3)
    assert sorted(sum(v["epochs"][0], [])) == list(range(40))


def test_xla_engine_contracts(run_script, tmp_path):
    proc = run_script("""
        import json, os, torch, tpu_utility as tu
        from test_engines import contract
        out = {}
        for name, cores in (("single", 1), ("spmd", 8)):
            os.makedirs(name, exist_ok=True)
            tu.run(contract, cores=cores, args=(name,), start_method="fork")
            v = torch.load(os.path.join(name, "view0.pt"))
            out[name] = {"rank": v["rank"], "world": v["world"], "replicas": v["replicas"],
                         "shard": list(v["shard"]), "per_step": v["per_step"],
                         "sum": v["sum"][0].tolist(), "gather": list(v["gather"].shape),
                         "epoch": sorted(sum(v["epochs"][0], []))}
        print("RESULT", json.dumps(out))
    """)
    single, spmd = proc.result["single"], proc.result["spmd"]
    assert (single["world"], single["replicas"], single["shard"], single["per_step"]) == (1, 1, [1, 0], 2)
    assert (spmd["world"], spmd["replicas"], spmd["shard"], spmd["per_step"]) == (8, 1, [1, 0], 16)
    for v in (single, spmd):
        assert v["rank"] == 0 and v["sum"] == [1.0, 0.0] and v["gather"] == [2, 3]
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(0)).tolist()
    assert single["epoch"] == list(range(40)) and spmd["epoch"] == sorted(perm[:32])  # 2 x 16, drop_last


def test_replica_threads_share_a_loader_made_outside_train_fn(run_script):
    # The TPU v2/v3 layout: replicas are threads of one process. On XLA:CPU two devices
    # run as two threads through torch_xla's thread-per-device launch (no collectives).
    proc = run_script("""
        import json, threading, torch, tpu_utility as tu
        from tpu_utility.engines import REGISTRY
        from tpu_utility.engines.xla_single import XlaSetup
        from tpu_utility.replica import Replica, activate
        loader = tu.make_loader(torch.utils.data.TensorDataset(torch.arange(64)), batch_size=4,
                                num_workers=0)  # made once, before the replicas exist
        views, lock = {}, threading.Lock()

        def body(engine):
            with activate(Replica(engine)):
                epochs = [[b[0].cpu().tolist() for b in loader] for _ in range(3)]
                with lock:
                    views[engine.rank] = {"epochs": epochs, "replicas": engine.replicas,
                                          "thread": threading.get_ident(), "epoch": loader.epoch}

        REGISTRY["launch"].start(XlaSetup(cache=None), 0, body)
        print("RESULT", json.dumps(views))
    """, CPU_NUM_DEVICES=2)
    views = proc.result
    assert sorted(views) == ["0", "1"] and views["0"]["thread"] != views["1"]["thread"]
    assert views["0"]["replicas"] == views["1"]["replicas"] == 2
    assert views["0"]["epoch"] == views["1"]["epoch"] == 3  # each replica counts its own epochs
    for epoch in range(3):
        a, b = (sum(views[r]["epochs"][epoch], []) for r in ("0", "1"))
        assert not set(a) & set(b) and sorted(a + b) == list(range(64))  # disjoint and complete
        perm = torch.randperm(64, generator=torch.Generator().manual_seed(epoch)).tolist()
        assert a == perm[0::2] and b == perm[1::2]  # each its own slice of one permutation
