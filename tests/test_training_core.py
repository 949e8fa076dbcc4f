"""The converted CUDA script (examples/tpu_train.py) on 1 XLA device, on 8 SPMD devices
and without torch_xla, each against a plain CPU torch reference; the loader's order and
what its samples draw."""
import pytest
import torch


def test_one_core_trains_and_matches_cpu_reference(run_script):
    proc = run_script("""
        import json, torch, torch_xla, torch_xla.runtime as xr
        import tpu_utility as tu, tpu_train
        from reference import reference_train, max_param_diff
        out = tu.run(tpu_train.train_fn, cores=1, start_method="fork")
        ref = reference_train(global_batch=64)
        print("RESULT", json.dumps({
            "losses": out["losses"].tolist(), "ref_losses": ref["losses"].tolist(),
            "diff": max_param_diff(out["state"], ref["state"]),
            "on_cpu": all(v.device.type == "cpu" for v in out["state"].values())}))
    """)
    r = proc.result
    assert r["losses"][-1] < 0.8 * r["losses"][0], r["losses"]
    assert r["diff"] < 1e-5
    assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) < 1e-4
    assert r["on_cpu"]


def test_eight_cores_spmd_matches_cpu_reference_over_global_batches(run_script):
    proc = run_script("""
        import json, torch, torch_xla, torch_xla.runtime as xr
        import tpu_utility as tu, tpu_train, replica_fns
        from reference import reference_train, max_param_diff

        def probe():
            # What the replica sees: world size, scaled lr, and how a batch is laid out.
            loader = tu.make_loader(tpu_train.make_dataset(), batch_size=64)
            x, y = next(iter(loader))
            return {"world": tu.world_size(), "batch": list(x.shape),
                    "lr": tu.scale_lr_bs(1e-3, 64, verbose=False).lr,
                    "sharding": torch_xla._XLAC._get_xla_sharding_spec(x),
                    "steps": len(loader), "spmd": xr.is_spmd(),
                    "devices": xr.global_runtime_device_count()}

        if __name__ == "__main__":
            # Forked replicas first: once this process has run a backward pass (the CPU
            # references), a forked replica's autograd fails on XLA (torch's engine keeps
            # the parent's device count).
            info = tu.run(probe, cores=8, start_method="fork")
            # Plain SGD: its step scales with the gradient, which must be the global batch's mean.
            sgd = tu.run(replica_fns.sgd_loop, cores=8, start_method="fork")
            # The example as a script runs it: the default start method there is spawn.
            out = tu.run(tpu_train.train_fn, cores=8)
            ref = reference_train(global_batch=64 * 8)
            sgd_ref = reference_train(global_batch=64 * 8, lr=replica_fns.SGD_LR, sgd=True)
            print("RESULT", json.dumps(dict(info, diff=max_param_diff(out["state"], ref["state"]),
                sgd_diff=max_param_diff(sgd["state"], sgd_ref["state"]),
                losses=out["losses"].tolist(), ref_losses=ref["losses"].tolist(),
                parent_runtime=torch_xla._XLAC._xla_runtime_is_initialized())))
    """)
    r = proc.result
    assert r["world"] == 8 and r["spmd"] and r["devices"] == 8 and not r["parent_runtime"]
    assert r["batch"] == [512, 20] and r["steps"] == 2048 // 512
    assert "devices=[8,1]" in r["sharding"], r["sharding"]  # batch dim split over 8 devices
    assert abs(r["lr"] - 8e-3) < 1e-12
    assert r["diff"] < 1e-5, r["diff"]
    assert r["sgd_diff"] < 1e-5, r["sgd_diff"]
    assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) < 1e-4
    # Three short 8-core runs, quietly: no XLA line per compile or per batch.
    print(f"8-core runs' stderr: {len(proc.stderr.splitlines())} lines")
    assert len(proc.stderr.splitlines()) <= 2, proc.stderr


def test_loader_order_is_a_fresh_seeded_permutation_each_epoch(run_script):
    proc = run_script("""
        import json, torch, tpu_utility as tu
        def order(batch_size):
            ds = torch.utils.data.TensorDataset(torch.arange(100))
            loader = tu.make_loader(ds, batch_size=batch_size, seed=5, num_workers=0)
            # An existing DataLoader is converted: its batch size, shuffling off for eval.
            dl = torch.utils.data.DataLoader(ds, batch_size=batch_size)
            evaluation = [b[0].cpu().tolist() for b in tu.make_loader(dl, train=False)]
            try:
                tu.make_loader(ds, batch_size=128)
                too_few = ""
            except ValueError as e:
                too_few = str(e)
            # DataLoader worker processes (forked beside the running XLA runtime) give the
            # same batches.
            with_workers = tu.make_loader(ds, batch_size=batch_size, seed=5, num_workers=2)
            return {"epochs": [[b[0].cpu().tolist() for b in loader] for epoch in range(2)],
                    "workers": [[b[0].cpu().tolist() for b in with_workers] for epoch in range(2)],
                    "eval": evaluation, "too_few": too_few}
        # cores=1 then cores=8 in one process: each run gets a fresh runtime in a child.
        one = tu.run(order, cores=1, args=(4,), start_method="fork")
        eight = tu.run(order, cores=8, args=(4,), start_method="fork")
        print("RESULT", json.dumps({"one": one, "eight": eight}))
    """)
    import torch
    one, eight = proc.result["one"], proc.result["eight"]
    for epoch in range(2):
        perm = torch.randperm(100, generator=torch.Generator().manual_seed(5 + epoch)).tolist()
        assert one["epochs"][epoch] == [perm[i:i + 4] for i in range(0, 100 - 3, 4)]
        assert eight["epochs"][epoch] == [perm[i:i + 32] for i in range(0, 100 - 31, 32)]  # drop_last
    assert one["epochs"][0] != one["epochs"][1]
    assert one["workers"] == one["epochs"] and eight["workers"] == eight["epochs"]
    assert one["eval"] == [list(range(i, i + 4)) for i in range(0, 100, 4)]
    assert sum(eight["eval"], []) == list(range(100))  # global batches of 32, short last one kept
    assert "100 samples make no full batch of 128" in one["too_few"]
    assert "1024 (128 per core x 8 cores)" in eight["too_few"]


def test_without_torch_xla_the_same_script_runs_on_cpu_torch(run_script):
    proc = run_script("""
        import sys
        sys.modules["torch_xla"] = None  # the point of this test: torch_xla is absent
        import json, torch, tpu_utility as tu, tpu_train
        from reference import reference_train, max_param_diff
        info = tu.setup_tpu(verbose=False)
        out = tu.run(tpu_train.train_fn, cores=1, start_method="fork")
        ref = reference_train(global_batch=64)
        print("RESULT", json.dumps({"has_xla": info.has_xla, "device": str(tu.get_device()),
            "losses": out["losses"].tolist(), "diff": max_param_diff(out["state"], ref["state"]),
            "xla_loaded": any(m.startswith("torch_xla.") for m in sys.modules)}))
    """)
    r = proc.result
    assert r["has_xla"] is False and r["device"] == "cpu" and not r["xla_loaded"]
    assert r["losses"][-1] < 0.8 * r["losses"][0]
    assert r["diff"] < 1e-5


def test_conversion_is_the_documented_handful_of_lines():
    import difflib
    from conftest import ROOT
    cuda = (ROOT / "examples" / "cuda_train.py").read_text().splitlines()
    tpu = (ROOT / "examples" / "tpu_train.py").read_text().splitlines()
    changed = [l for l in difflib.unified_diff(cuda, tpu, lineterm="", n=0)
               if l[:1] in "+-" and not l.startswith(("+++", "---"))]
    readme = (ROOT / "README.md").read_text()
    assert len([l for l in changed if l.startswith("+")]) <= 5, changed
    for line in changed:  # the README shows this diff
        assert line[1:].strip() in readme, line


class _Drawing(torch.utils.data.Dataset):
    """A row plus noise from torch's, Python's and numpy's generators."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        import random
        import numpy as np
        return torch.full((2,), float(i)) + torch.rand(2) + random.random() + float(np.random.rand())


def _batches(loader, epochs=2):
    out = []
    for epoch in range(epochs):  # the torch DataLoader make_loader feeds from: no device
        loader.sampler.set_epoch(epoch)
        out.append([b.clone() for b in loader])
    return out


def test_what_a_sample_draws_depends_on_its_batch_not_on_workers_and_the_caller_keeps_its_stream():
    import random
    import tpu_utility as tu
    random.seed(7)
    torch.manual_seed(7)
    expected = (random.random(), torch.rand(1).item())
    random.seed(7)
    torch.manual_seed(7)
    no_workers = _batches(tu.make_loader(_Drawing(), 4, seed=3, num_workers=0).loader)
    assert (random.random(), torch.rand(1).item()) == expected  # loading here left them as they were
    workers = _batches(tu.make_loader(_Drawing(), 4, seed=3, num_workers=2).loader)
    assert all(torch.equal(a, b) for e0, e1 in zip(no_workers, workers) for a, b in zip(e0, e1))
    flat = torch.cat(no_workers[0] + no_workers[1])
    assert len(set(flat[:, 0].sub(flat[:, 0].floor()).tolist())) == len(flat)  # fresh noise each sample
    other_seed = _batches(tu.make_loader(_Drawing(), 4, seed=4, num_workers=0).loader)
    assert not torch.equal(torch.cat(other_seed[0]), torch.cat(no_workers[0]))


def test_datasets_known_to_draw_no_random_numbers():
    from torch.utils.data import ConcatDataset, Subset, TensorDataset
    from tpu_utility.data import PaddedDataset, draws_no_randomness
    from tpu_utility.cache import CachedDataset
    tensors = TensorDataset(torch.zeros(4, 2))

    class Jittered(TensorDataset):
        def __getitem__(self, i):
            return super().__getitem__(i)[0] + torch.randn(2)

    assert draws_no_randomness(tensors) and draws_no_randomness([1, 2])
    assert draws_no_randomness(Subset(PaddedDataset(ConcatDataset([tensors, tensors]), 3), [0, 1]))
    assert draws_no_randomness(CachedDataset.__new__(CachedDataset))
    assert not draws_no_randomness(Jittered(torch.zeros(4, 2)))
    assert not draws_no_randomness(_Drawing())
    assert not draws_no_randomness(ConcatDataset([tensors, _Drawing()]))
    assert not draws_no_randomness(Subset(_Drawing(), [0]))


def test_default_workers_none_for_rows_in_memory_the_cores_otherwise():
    import os
    import tpu_utility as tu
    assert tu.make_loader(torch.utils.data.TensorDataset(torch.zeros(40, 2)), 4).loader.num_workers == 0
    cores = min(4, os.cpu_count() or 1)
    assert tu.make_loader(_Drawing(), 4).loader.num_workers == (cores if cores >= 2 else 0)
    assert tu.make_loader(_Drawing(), 4, num_workers=1).loader.num_workers == 1


@pytest.mark.parametrize("replicas, fed, cpus, workers", [
    (1, 8, 224, 32),   # SPMD on a v5e-8 host: one process feeds 8 chips
    (8, 1, 224, 4),    # one process per chip there: 4 each, 32 in all
    (1, 8, 96, 32),    # a v3-8 host's 96 CPUs, SPMD
    (8, 1, 96, 4),
    (1, 8, 16, 16),    # fewer CPUs than 4 per chip: the host's CPUs
    (1, 1, 44, 4),     # Colab's single chip
    (1, 8, 1, 0),      # under 2: none
])
def test_default_workers_scale_with_the_devices_one_process_feeds(replicas, fed, cpus, workers):
    from tpu_utility.data import default_workers
    assert default_workers(replicas, fed_devices=fed, cpus=cpus) == workers
    assert default_workers(replicas, True, fed_devices=fed, cpus=cpus) == 0  # rows in memory


def test_spmd_on_a_tpu_adds_the_rng_flag_unless_the_user_named_it():
    from tpu_utility.engines.xla_spmd import with_rng_flag
    env = {}
    with_rng_flag(env)
    assert env == {"LIBTPU_INIT_ARGS": "--xla_tpu_spmd_rng_bit_generator_unsafe=true"}
    env = {"LIBTPU_INIT_ARGS": "--xla_enable_async_all_gather=true"}
    with_rng_flag(env)
    assert env["LIBTPU_INIT_ARGS"] == ("--xla_enable_async_all_gather=true "
                                       "--xla_tpu_spmd_rng_bit_generator_unsafe=true")
    mine = {"LIBTPU_INIT_ARGS": "--xla_tpu_spmd_rng_bit_generator_unsafe=false"}
    with_rng_flag(mine)
    assert mine == {"LIBTPU_INIT_ARGS": "--xla_tpu_spmd_rng_bit_generator_unsafe=false"}
