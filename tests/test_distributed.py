"""Several replicas with real collectives: the "distributed" engine, processes over gloo.

The multi-replica code (gradient averaging, the first-step broadcast, per-replica loader
slices, metrics reduced without the padding, predictions gathered in order, one writer)
is the same for the TPU's "launch" engine; only the collectives differ. No XLA here, so
a replica costs a fork of this process.
"""
import time

import pytest
import torch

import replica_fns
import tpu_train
import tpu_utility as tu
from conftest import child_processes
from reference import max_param_diff, reference_one_cycle, reference_train


def run(fn, cores, *args, start_method="fork", timeout=120):
    return tu.run(fn, cores=cores, args=args, engine="distributed", start_method=start_method,
                  timeout=timeout)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_swapped_script_matches_one_process_over_the_same_global_batches(world, capfd):
    out = run(tpu_train.train_fn, world)
    assert "[Gloo]" not in capfd.readouterr().out  # gloo's "Rank N is connected" line, per replica
    ref = reference_train(global_batch=64 * world)
    diff = max_param_diff(out["state"], ref["state"])
    print(f"world {world}: max parameter difference {diff:.2e}")
    assert diff < 1e-5
    assert child_processes() == []


@pytest.mark.parametrize("world", [2, 4])
def test_gradients_are_averaged_over_replicas_not_summed(world):
    # Plain SGD moves by the gradient itself: a sum over replicas would step `world`
    # times too far (the Adam runs above cannot tell, their step is scale-free).
    out = run(replica_fns.sgd_loop, world)
    ref = reference_train(global_batch=64 * world, lr=replica_fns.SGD_LR, sgd=True)
    diff = max_param_diff(out["state"], ref["state"])
    print(f"SGD, world {world}: max parameter difference {diff:.2e}")
    assert diff < 1e-5


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_sums_or_averages_over_replicas_in_place(world):
    # port's swap for dist.all_reduce: closed forms of 1 + 2 + ... + world
    out = run(replica_fns.reduced, world)
    assert out == {"sum": world * (world + 1) / 2, "mean": [(world + 1) / 2, float(world + 1)],
                   "in_place": True, "accelerator": False}  # (a CPU engine: no accelerator)
    with pytest.raises(ValueError, match="op is 'sum' or 'mean'"):
        tu.all_reduce(torch.ones(1), op="max")


def test_spawned_replicas_match_too():
    out = run(tpu_train.train_fn, 2, start_method="spawn")
    assert max_param_diff(out["state"], reference_train(global_batch=128)["state"]) < 1e-5
    assert child_processes() == []


@pytest.fixture(scope="module")
def one_cycle_ref():
    train_ds, valid_ds = replica_fns.split()
    x, y = train_ds.dataset.tensors
    n = replica_fns.N_TRAIN
    return {w: reference_one_cycle(x[:n], y[:n], x[n:], y[n:], epochs=2, global_batch=32 * w, max_lr=3e-3)
            for w in (1, 2, 4)}


@pytest.mark.parametrize("world", [2, 4])
def test_train_one_cycle_metrics_and_predict_over_replicas(world, one_cycle_ref):
    out = run(replica_fns.one_cycle, world)
    ref = one_cycle_ref[world]
    assert out["world"] == world
    assert max_param_diff(out["state"], ref["state"]) < 1e-5
    # 203 validation samples: every replica pads its slice, the repeats are left out.
    assert out["valid_loss"] == pytest.approx(ref["valid_loss"], abs=1e-5)
    assert out["accuracy"] == pytest.approx(ref["accuracy"], abs=1e-6)
    assert out["ids"].tolist() == list(range(replica_fns.N_VALID))  # in order, once each
    with torch.no_grad():
        model = tpu_train.make_model()
        model.load_state_dict(out["state"])
        x, _ = replica_fns.split()[1].dataset.tensors
        expected = model(x[replica_fns.N_TRAIN:])
    assert (out["preds"] - expected).abs().max().item() < 1e-5


def test_one_replica_runs_the_same_metrics_as_one_process(one_cycle_ref):
    out = run(replica_fns.one_cycle, 1)
    assert out["valid_loss"] == pytest.approx(one_cycle_ref[1]["valid_loss"], abs=1e-5)
    assert out["accuracy"] == pytest.approx(one_cycle_ref[1]["accuracy"], abs=1e-6)


def _per_rank(tmp_path, name, world):
    return [torch.load(tmp_path / f"{name}-rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_replicas_seeded_differently_end_identical(world, tmp_path):
    # Each mechanism alone, read from every replica's own parameters and buffers: the first
    # step's broadcast (the hand loop), train_one_cycle's and lr_find's.
    run(replica_fns.seeded_loop, world, str(tmp_path))
    run(replica_fns.seeded_one_cycle, world, str(tmp_path))
    run(replica_fns.seeded_lr_find, world, str(tmp_path))
    for name in ("loop", "one_cycle", "lr_find"):
        ranks = _per_rank(tmp_path, name, world)
        for r in range(1, world):
            assert max_param_diff(ranks[r]["first"], ranks[0]["first"]) > 1e-3  # they did start apart
            for k, v in ranks[0]["last"].items():  # every replica, not just the master
                assert torch.equal(ranks[r]["last"][k], v), (name, r, k)
    # lr_find hands the model back as it found it, once it was the master's.
    swept = _per_rank(tmp_path, "lr_find", world)
    for r in swept:
        for k, v in swept[0]["first"].items():
            assert torch.equal(r["last"][k], v), k


def test_save_best_and_plot_are_written_once_by_the_master(tmp_path):
    run(replica_fns.writes_once, 4, str(tmp_path))
    ranks = _per_rank(tmp_path, "writes", 4)
    saved = ranks[0]["saved"]
    assert saved[0] and all(r["saved"] == saved for r in ranks)  # every replica decided alike
    writes = ranks[0]["writes"]
    assert writes.count(("rename", str(tmp_path / "best.pt"))) == sum(saved)
    assert writes.count(("rename", str(tmp_path / "curves.png"))) == 1
    assert all(r["writes"] == [] for r in ranks[1:])
    assert sorted(p.name for p in tmp_path.iterdir() if "rank" not in p.name) == ["best.pt", "curves.png"]


@pytest.mark.parametrize("fn, error, message", [
    (replica_fns.raising, ValueError, "boom in replica 1"),
    (replica_fns.exiting, RuntimeError, "exit codes"),
    (replica_fns.stuck, TimeoutError, "timed out"),
])
def test_a_failing_replica_stops_the_run(fn, error, message):
    t = time.monotonic()
    with pytest.raises(error, match=message) as info:
        run(fn, 4, timeout=5)
    seconds = time.monotonic() - t
    print(f"{fn.__name__}: raised after {seconds:.1f} s")
    assert seconds < 15  # the stuck replica is bounded by timeout=5; the others need no timeout
    if fn is replica_fns.raising:
        assert "Replica 1 traceback" in str(info.value.__cause__)
        assert "in raising" in str(info.value.__cause__)
        assert seconds < 10
    if fn is replica_fns.exiting:
        assert ": 3" in str(info.value) and seconds < 10
    assert child_processes() == []
