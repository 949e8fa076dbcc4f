"""Issue 47, going further: 30 hostile cases as a Kaggle/Colab user with CUDA habits hits
them, against fsdp, bf16_weights, checkpointing (recompute), the memory check, run's
arguments, train_one_cycle's checkpoint=/save_best=, lr_find, make_loader,
optimizer_step with unusual optimizers, predict and save. Each case asserts torch's own
result on the CPU (computed here with plain torch) or the exact refusal.

The cases that need no XLA run in one forked replica of the "distributed" engine (and
two, over gloo, where replicas matter); the XLA cases run in one script (8 SPMD devices
and one XLA:CPU device), so the file imports torch_xla once more than the suite does."""
import io
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tpu_utility as tu
from conftest import child_processes


def attempt(fn):
    try:
        out = fn()
        return {"value": out}
    except BaseException as e:  # MemoryError, and whatever else a case raises
        return {"error": type(e).__name__, "message": str(e)}


def data(n=64, d=4, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, d, generator=g),
                                          torch.randint(0, classes, (n,), generator=g))


def linear(seed=0, d=4, classes=3):
    torch.manual_seed(seed)
    return nn.Linear(d, classes)


# -- the cases that need no XLA: one replica of the "distributed" engine ---------------------

def cpu_cases(folder):
    dev = tu.get_device()
    out = {}
    ds = data()

    def loop(**kw):
        model = linear().to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        args = dict(model=model, train_loader=tu.make_loader(ds, 16, num_workers=0), opt=opt,
                    loss_fn=F.cross_entropy, epochs=1, progress=False)
        args.update(kw)
        return tu.train_one_cycle(**args)

    out["epochs0"] = attempt(lambda: loop(epochs=0))
    out["zero_batches"] = attempt(lambda: tu.make_loader(data(10), 16))
    out["big_batch_eval"] = attempt(lambda: len(tu.make_loader(data(10), 16, train=False)))
    out["nonscalar_loss"] = attempt(lambda: loop(loss_fn=lambda o, t: F.cross_entropy(o, t, reduction="none")))
    out["loss_class"] = attempt(lambda: loop(loss_fn=nn.CrossEntropyLoss))
    out["float_metric"] = attempt(lambda: loop(valid_loader=tu.make_loader(ds, 16, train=False, num_workers=0),
                                               metrics=[lambda o, t: 0.5]).epochs[0].metrics)
    out["metric_list"] = attempt(lambda: loop(valid_loader=tu.make_loader(ds, 16, train=False, num_workers=0),
                                              metrics=[tu.accuracy]).epochs[0].metrics)
    out["metric_not_list"] = attempt(lambda: loop(valid_loader=tu.make_loader(ds, 16, train=False, num_workers=0),
                                                  metrics=tu.accuracy).epochs[0].metrics)
    os.makedirs(os.path.join(folder, "ckdir"), exist_ok=True)
    out["checkpoint_dir"] = attempt(lambda: loop(checkpoint=os.path.join(folder, "ckdir")))
    out["save_best_ro"] = attempt(lambda: loop(valid_loader=tu.make_loader(ds, 16, train=False, num_workers=0),
                                               save_best="/proc/tpu_utility_hostile/best.pt"))
    plain = os.path.join(folder, "model.pt")
    torch.save(linear().state_dict(), plain)
    before = open(plain, "rb").read()
    out["checkpoint_plain"] = attempt(lambda: loop(checkpoint=plain))
    out["checkpoint_plain_kept"] = open(plain, "rb").read() == before
    out["max_lr_str"] = attempt(lambda: loop(max_lr="1e-3"))
    # lr_find
    def sweep(lr=0.1, **kw):
        model = linear().to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        res = tu.lr_find(model, tu.make_loader(ds, 16, num_workers=0), opt, F.cross_entropy,
                         num_it=30, **kw)
        return {"n": len(res.raw_losses), "lr_after": opt.param_groups[0]["lr"],
                "weight_kept": torch.equal(model.weight, linear().weight)}
    out["lr_find_lr0"] = attempt(lambda: sweep(lr=0.0))
    out["lr_find_str"] = attempt(lambda: sweep(start_lr="1e-7"))
    out["lr_find_suggest_str"] = attempt(lambda: sweep(suggest="valley"))
    # make_loader
    def gen():
        return (ds[i] for i in range(len(ds)))
    out["loader_generator"] = attempt(lambda: len(tu.make_loader(gen(), 16)))
    pairs = [(torch.full((2,), float(i)), i) for i in range(10)]
    out["loader_list"] = attempt(lambda: [[t.cpu().tolist() for t in b] for b in
                                          tu.make_loader(pairs, 4, train=False, num_workers=0)])
    out["batch_str"] = attempt(lambda: tu.make_loader(ds, "32"))
    # optimizer_step
    model = linear().to(dev)
    o1, o2 = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    model(ds.tensors[0].to(dev)).sum().backward()
    out["step_list"] = attempt(lambda: tu.optimizer_step([o1, o2]))
    lb = torch.optim.LBFGS(model.parameters())
    out["lbfgs_no_closure"] = attempt(lambda: tu.optimizer_step(lb))
    # predict on a training loader, in dataset order
    m = linear().to(dev)
    out["predict_train_loader"] = attempt(lambda: tu.predict(m, tu.make_loader(ds, 16, num_workers=0)).tolist())
    # save
    out["save_dir"] = attempt(lambda: tu.save(m.state_dict(), folder))
    buf = io.BytesIO()
    out["save_bytesio"] = attempt(lambda: (tu.save(m.state_dict(), buf), None)[1])
    out["save_bytesio_loaded"] = torch.load(io.BytesIO(buf.getvalue()))["weight"].tolist() if buf.getvalue() else None
    # the memory limit's setting, read at the first step
    from tpu_utility import memory
    for name, value in (("mem_dot", "."), ("mem_zero", "0"), ("mem_space", "16 GB")):
        out[name] = attempt(lambda: memory.limit(torch.device("cpu"), {"TPU_UTILITY_DEVICE_MEMORY": value}))
    return out


# -- the XLA cases: 8 SPMD devices (fsdp), one XLA:CPU device (bf16_weights, checkpointing) --

def wide(seed=0):
    """A model with one weight large enough for fsdp to split (64 x 1024 = 65536 elements)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 3))


def wide_batches(steps=3, n=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 64, generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(steps)]


def sgd_steps(model, opt, batches, dev, step=None):
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x.to(dev)), y.to(dev)).backward()
        (step or tu.optimizer_step)(opt)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def spmd_cases():
    dev = tu.get_device()
    out = {}
    out["fsdp_before_to"] = attempt(lambda: tu.fsdp(wide()))
    out["fsdp_generator"] = attempt(lambda: tu.fsdp(wide().to(dev).parameters()))
    out["fsdp_min_str"] = attempt(lambda: tu.fsdp(wide().to(dev), min_elements="1000"))
    # twice: the second call changes nothing
    model = tu.fsdp(tu.fsdp(wide().to(dev)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out["fsdp_twice"] = sgd_steps(model, opt, wide_batches(), dev)
    # an optimizer over the head only: the split first layer stays as it was
    model = tu.fsdp(wide().to(dev))
    opt = torch.optim.Adam(model[2].parameters(), lr=0.01)
    out["fsdp_partial_opt"] = sgd_steps(model, opt, wide_batches(), dev)
    # bf16_weights before fsdp (the README says after): the same training as after
    runs = []
    for order in ("after", "before"):
        model = wide().to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if order == "after":
            tu.bf16_weights(tu.fsdp(model), opt)
        else:
            tu.fsdp(tu.bf16_weights(model, opt))
        runs.append(sgd_steps(model, opt, wide_batches(), dev))
    out["bf16_order"] = runs
    return out


class Complex(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)
        self.phase = nn.Parameter(torch.randn(3, dtype=torch.complex64))

    def forward(self, x):
        return self.lin(x) * self.phase.abs()


def bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def block(x, w):
    return torch.tanh(x @ w).sin()


def xla1_cases():
    dev = tu.get_device()
    out = {}
    ds = data()
    # the optimizer made before model.to(device), as CUDA scripts do
    model = linear()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.to(dev)
    out["bf16_opt_before_to"] = attempt(lambda: tu.bf16_weights(model, opt))
    model = Complex().to(dev)
    out["bf16_complex"] = attempt(lambda: (tu.bf16_weights(model, torch.optim.SGD(model.parameters(), lr=0.1)),
                                           str(model.phase.dtype))[1])
    model = linear().to(dev)
    out["bf16_swapped"] = attempt(lambda: tu.bf16_weights(torch.optim.SGD(model.parameters(), lr=0.1), model))
    # integer buffers (BatchNorm's num_batches_tracked) stay integers and count the steps
    model = bn_model().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tu.bf16_weights(model, opt)
    out["bf16_int_buffer"] = sgd_steps(model, opt, [(ds.tensors[0][i:i + 16], ds.tensors[1][i:i + 16])
                                                    for i in range(0, 64, 16)], dev)
    out["bf16_int_buffer_dtype"] = str(model[1].num_batches_tracked.dtype)
    # checkpointing without use_reentrant (torch's default: reentrant), and checkpoint_sequential
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(2))
    w = torch.randn(5, 5, generator=torch.Generator().manual_seed(3))
    xd, wd = x.to(dev).requires_grad_(), w.to(dev).requires_grad_()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = torch.utils.checkpoint.checkpoint(block, xd, wd)
    y.square().sum().backward()
    out["ckpt_default"] = [xd.grad.cpu(), wd.grad.cpu()]
    seq = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh())
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh()).to(dev)
    torch.utils.checkpoint.checkpoint_sequential(seq, 2, x.to(dev), use_reentrant=False).sum().backward()
    out["ckpt_sequential"] = [p.grad.cpu() for p in seq.parameters()]
    # the memory check under bf16_weights, before the step runs
    os.environ["TPU_UTILITY_DEVICE_MEMORY"] = "1K"
    model = wide().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tu.bf16_weights(model, opt)
    out["memory_bf16"] = attempt(lambda: sgd_steps(model, opt, wide_batches(1), dev))
    # an optimizer over the head only: the first layer's weights and gradients count as well
    model = wide().to(dev)
    opt = torch.optim.AdamW(model[2].parameters(), lr=1e-3)
    x, y = wide_batches(1, n=64)[0]
    out["memory_partial"] = attempt(lambda: tu.train_one_cycle(
        model, tu.make_loader(torch.utils.data.TensorDataset(x, y), 16, num_workers=0), opt,
        F.cross_entropy, 1, progress=False))
    os.environ.pop("TPU_UTILITY_DEVICE_MEMORY")
    return out


XLA_SCRIPT = """
    import json, torch, test_hostile_3 as t, tpu_utility as tu

    def plain(v):
        if isinstance(v, torch.Tensor):
            return v.tolist()
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    if __name__ == "__main__":
        out = {"spmd": tu.run(t.spmd_cases, cores=8, start_method="fork", timeout=300),
               "one": tu.run(t.xla1_cases, cores=1, start_method="fork", timeout=300)}
        print("RESULT", json.dumps(plain(out)))
"""


# -- the tests -------------------------------------------------------------------------------

def run(fn, cores, *args):
    return tu.run(fn, cores=cores, args=args, engine="distributed", start_method="fork", timeout=120)


@pytest.fixture(scope="module")
def cpu(tmp_path_factory):
    out = run(cpu_cases, 1, str(tmp_path_factory.mktemp("hostile3")))
    assert child_processes() == []
    return out


@pytest.fixture(scope="module")
def xla(tmp_path_factory):
    # One script, one import of torch_xla: both runs fork from it.
    from conftest import run_python, script_env
    import json, sys, textwrap
    folder = tmp_path_factory.mktemp("hostile3_xla")
    path = folder / "script.py"
    path.write_text(textwrap.dedent(XLA_SCRIPT))
    proc = run_python([sys.executable, str(path)], timeout=400, cwd=folder, env=script_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def error(case):
    assert "error" in case, case
    return f"{case['error']}: {case['message']}"


def close(got, want, atol):
    got = torch.tensor(got) if not isinstance(got, torch.Tensor) else got
    assert got.shape == want.shape and torch.allclose(got.float(), want.float(), atol=atol), \
        (got - want).abs().max()


# 1-3: epochs and batches

def test_01_epochs_0_is_refused_naming_epochs(cpu):
    assert error(cpu["epochs0"]) == "ValueError: epochs must be a positive int, got 0"


def test_02_a_batch_bigger_than_the_dataset_with_drop_last_is_refused_when_made(cpu):
    # DataLoader would yield 0 batches and train nothing, silently
    assert len(torch.utils.data.DataLoader(data(10), 16, drop_last=True)) == 0
    assert error(cpu["zero_batches"]) == (
        "ValueError: make_loader: 10 samples make no full batch of 16 (16 per core x 1 cores) "
        "with drop_last=True; use a smaller batch_size or more data")


def test_03_the_same_for_evaluation_keeps_the_short_batch_as_dataloader_does(cpu):
    assert cpu["big_batch_eval"] == {"value": len(torch.utils.data.DataLoader(data(10), 16))} == {"value": 1}


# 4-7: losses and metrics

def test_04_a_loss_fn_returning_one_loss_per_sample_is_named(cpu):
    message = error(cpu["nonscalar_loss"])
    assert "loss_fn" in message and "shape [16]" in message and ".mean()" in message


def test_05_the_loss_class_instead_of_an_instance_is_named(cpu):
    message = error(cpu["loss_class"])
    assert "loss_fn" in message and "nn.CrossEntropyLoss()" in message


def test_06_a_metric_returning_a_python_float_is_refused_naming_it(cpu):
    # Before: AttributeError: 'float' object has no attribute 'float'
    assert error(cpu["float_metric"]) == (
        "TypeError: metrics: <lambda> returned a float (0.5), not a tensor: return one value per "
        "sample as a tensor computed on the device from output and target, as tu.accuracy does "
        "((output.argmax(-1) == target).float()), not a number read to the host")


def test_07_metrics_given_one_function_not_a_list(cpu):
    assert "accuracy" in cpu["metric_list"]["value"]
    assert cpu["metric_not_list"] == cpu["metric_list"]


# 8-11: checkpoint=, save_best=, resume

def test_08_a_checkpoint_path_that_is_a_folder_is_refused_before_training(cpu):
    message = error(cpu["checkpoint_dir"])
    assert message.startswith("IsADirectoryError: checkpoint=") and \
        message.endswith("/ckdir' is a folder: give a file name in it")


def test_09_save_best_into_a_folder_that_takes_no_file_is_refused_before_training(cpu):
    # /proc stands in for a read-only folder (/kaggle/input): these tests run as root,
    # which writes into a chmod 555 folder
    assert error(cpu["save_best_ro"]) == (
        "FileNotFoundError: [Errno 2] save_best='/proc/tpu_utility_hostile/best.pt' cannot be "
        "written (No such file or directory in /proc/tpu_utility_hostile): pick a writable "
        "folder, such as /kaggle/working or the current directory")


def test_10_checkpoint_pointing_at_ones_saved_model_is_refused_and_left_alone(cpu):
    message = error(cpu["checkpoint_plain"])
    assert message.startswith("ValueError: checkpoint '") and message.endswith(
        "model.pt' is not a tpu_utility checkpoint (a plain torch.save file?): pass another "
        "path, or move it away")
    assert cpu["checkpoint_plain_kept"] is True


def test_11_max_lr_as_a_string_is_refused(cpu):
    assert error(cpu["max_lr_str"]) == "ValueError: max_lr must be a positive number, got '1e-3' (try lr_find)"


# 12-14: lr_find

def test_12_lr_find_with_an_optimizer_whose_lr_is_0_sweeps_and_gives_it_back(cpu):
    assert cpu["lr_find_lr0"] == {"value": {"n": 30, "lr_after": 0.0, "weight_kept": True}}


def test_13_lr_find_start_lr_as_a_string_is_named(cpu):
    message = error(cpu["lr_find_str"])
    assert "start_lr" in message and "'1e-7'" in message


def test_14_lr_find_suggest_as_one_name(cpu):
    # Before: "unknown suggestions ['a', 'e', 'l', 'v', 'y']"
    assert cpu["lr_find_suggest_str"] == {"value": {"n": 30, "lr_after": 0.1, "weight_kept": True}}


# 15-17: make_loader

def test_15_make_loader_of_a_generator_is_refused_naming_the_fix(cpu):
    # Before: TypeError: object of type 'generator' has no len()
    assert error(cpu["loader_generator"]) == (
        "TypeError: make_loader needs a map-style dataset (with __len__ and __getitem__) so it "
        "can shard it over replicas, got a generator, which has no length: pass list(...) of its "
        "samples, or a Dataset")


def test_16_make_loader_of_a_list_of_pairs_batches_as_dataloader_does(cpu):
    pairs = [(torch.full((2,), float(i)), i) for i in range(10)]
    want = [[t.tolist() for t in b] for b in torch.utils.data.DataLoader(pairs, 4)]
    assert cpu["loader_list"] == {"value": want}


def test_17_batch_size_as_a_string_is_refused(cpu):
    assert error(cpu["batch_str"]) == "ValueError: batch_size must be a positive int (per core), got '32'"


# 18-20: optimizer_step with unusual optimizers

def test_18_optimizer_step_of_a_list_of_optimizers_is_refused(cpu):
    assert error(cpu["step_list"]) == "TypeError: optimizer_step(opt): pass the torch optimizer, got list"


def test_19_lbfgs_without_a_closure_fails_as_torch_does(cpu):
    w = nn.Parameter(torch.ones(2))
    with pytest.raises(TypeError) as info:
        torch.optim.LBFGS([w]).step()
    assert error(cpu["lbfgs_no_closure"]) == f"TypeError: {info.value}"


def sparse_step():
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    emb(torch.tensor([[1, 2], [3, 1]])[tu.rank()]).square().sum().backward()
    return attempt(lambda: tu.optimizer_step(opt)), emb.weight.detach()


def test_20_sparse_gradients_at_two_replicas_are_refused_naming_the_fix():
    # Before: "reshape is not implemented for sparse tensors" from inside the averaging.
    # (One replica steps SparseAdam as torch does: nothing to average.)
    result, weight = run(sparse_step, 2)
    assert result == {"error": "ValueError", "message": "optimizer_step: parameter 0 (shape [10, 3]) has a "
                      "sparse gradient (nn.Embedding(sparse=True)), which cannot be averaged "
                      "over the 2 replicas: make the embedding with sparse=False (and Adam in "
                      "place of SparseAdam), or run on one core"}, result
    torch.manual_seed(0)
    assert torch.equal(weight, nn.Embedding(10, 3, sparse=True).weight.detach())  # unmoved


# 21-23: predict and save

def test_21_predict_on_a_training_loader_gives_every_row_in_dataset_order(cpu):
    with torch.no_grad():
        want = linear()(data().tensors[0])
    close(cpu["predict_train_loader"]["value"], want, 1e-6)


def test_22_save_into_a_folder_is_refused(cpu):
    message = error(cpu["save_dir"])
    assert message.startswith("IsADirectoryError: tu.save(obj, f): f='") and \
        message.endswith("' is a folder: give a file name in it")


def test_23_save_into_a_bytesio_loads_with_plain_torch(cpu):
    assert cpu["save_bytesio"] == {"value": None}
    assert cpu["save_bytesio_loaded"] == linear().weight.tolist()


# 24: the memory limit's setting

def test_24_a_memory_limit_of_nothing_or_no_number_is_refused_naming_the_setting(cpu):
    # Before: "could not convert string to float: '.'", and "0" taken: every run then
    # refused, "a device has 0 B"
    assert error(cpu["mem_dot"]) == ("ValueError: TPU_UTILITY_DEVICE_MEMORY='.': give bytes, e.g. "
                                     "16G for a v5e chip, 32G for a v6e")
    assert error(cpu["mem_zero"]) == ("ValueError: TPU_UTILITY_DEVICE_MEMORY='0' gives a device no "
                                      "memory: give its bytes, e.g. 16G for a v5e chip, 32G for a "
                                      "v6e, or unset it")
    assert cpu["mem_space"] == {"value": 16 * 2 ** 30}


# 25: run's arguments as CUDA habits write them

def one():
    return 1


def test_25_run_with_a_cuda_engine_or_the_function_called_is_refused():
    assert attempt(lambda: tu.run(one, cores=1, engine="cuda"))["message"] == (
        "engine must be one of ('single', 'launch', 'spmd', 'torchtpu', 'distributed', 'torch') "
        "or None, got 'cuda'")
    assert attempt(lambda: tu.run(one(), cores=1)) == {
        "error": "TypeError", "message": "run: train_fn must be a function, got int 1"}
    assert attempt(lambda: tu.run(one, cores="8"))["message"] == "cores must be an int, got '8'"
    assert child_processes() == []


# 26-30: XLA: fsdp over 8 SPMD devices, bf16_weights, checkpointing, the memory check

def cpu_steps(model, opt, batches):
    return sgd_steps(model, opt, batches, "cpu", step=lambda o: o.step())


def bf16_reference(model, make_opt, batches):
    """A hand-written float32-master loop on plain CPU torch."""
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    model.to(torch.bfloat16)
    opt = make_opt(masters)
    for x, y in batches:
        opt.zero_grad()
        model.zero_grad()
        F.cross_entropy(model(x.bfloat16()), y).backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
    return model.state_dict()


def test_26_fsdp_refusals_before_the_move_and_of_the_wrong_types(xla):
    r = xla["spmd"]
    assert error(r["fsdp_before_to"]) == (
        "RuntimeError: fsdp(model): parameter '0.weight' is on cpu, not this run's device xla:0: "
        "call model.to(tu.get_device()) first, then tu.fsdp(model)")
    assert error(r["fsdp_generator"]) == "TypeError: fsdp(model): pass the torch module, got generator"
    assert error(r["fsdp_min_str"]) == "ValueError: fsdp(min_elements=...) must be a positive int, got '1000'"


def test_27_fsdp_twice_and_an_optimizer_over_part_of_the_model_train_as_torch_does(xla):
    r = xla["spmd"]
    model = wide()
    want = cpu_steps(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), wide_batches())
    for k, v in want.items():
        close(r["fsdp_twice"][k], v, 1e-5)
    model = wide()
    want = cpu_steps(model, torch.optim.Adam(model[2].parameters(), lr=0.01), wide_batches())
    for k, v in want.items():
        close(r["fsdp_partial_opt"][k], v, 1e-5)
    assert r["fsdp_partial_opt"]["0.weight"] == wide()[0].weight.tolist()  # never stepped
    # bf16_weights before fsdp (the README says after) trains as after, and as by hand
    after, before = r["bf16_order"]
    assert after == before
    want = bf16_reference(wide(), lambda ps: torch.optim.SGD(ps, lr=0.1), wide_batches())
    for k, v in want.items():
        close(after[k], v, 2e-2)


def test_28_bf16_weights_refuses_an_optimizer_made_before_the_move_and_complex_weights(xla):
    r = xla["one"]
    # Before: "the optimizer holds none of the model's floating parameters: make it over
    # model.parameters()", which it was
    assert error(r["bf16_opt_before_to"]) == (
        "ValueError: bf16_weights(model, optimizer): the optimizer holds parameters on cpu but "
        "the model trains on xla:0, so stepping it would train nothing (on XLA, model.to(device) "
        "makes new parameters and an optimizer made before the move keeps the old ones): create "
        "the optimizer after model.to(device)")
    # Before: the complex weight became a real bfloat16 one, its imaginary part dropped, silently
    assert error(r["bf16_complex"]) == (
        "TypeError: bf16_weights(model, optimizer): 'phase' is complex64, and bfloat16 has no "
        "complex type (the cast would drop its imaginary part): keep it as two real tensors "
        "(real and imaginary), or train this model in float32")
    assert error(r["bf16_swapped"]) == "TypeError: bf16_weights(model, optimizer): pass the torch module first, got SGD"


def test_29_bf16_weights_with_integer_buffers_and_checkpointing_train_as_torch_does(xla):
    r = xla["one"]
    ds = data()
    batches = [(ds.tensors[0][i:i + 16], ds.tensors[1][i:i + 16]) for i in range(0, 64, 16)]
    want = bf16_reference(bn_model(), lambda ps: torch.optim.SGD(ps, lr=0.1), batches)
    assert r["bf16_int_buffer_dtype"] == "torch.int64"
    assert r["bf16_int_buffer"]["1.num_batches_tracked"] == 4
    for k, v in want.items():
        close(r["bf16_int_buffer"][k], v, 2e-2)
    # checkpoint() without use_reentrant (torch's default, reentrant), checkpoint_sequential
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(2)).requires_grad_()
    w = torch.randn(5, 5, generator=torch.Generator().manual_seed(3)).requires_grad_()
    block(x, w).square().sum().backward()
    close(r["ckpt_default"][0], x.grad, 1e-5)
    close(r["ckpt_default"][1], w.grad, 1e-5)
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh())
    seq(x.detach()).sum().backward()
    for got, p in zip(r["ckpt_sequential"], seq.parameters()):
        close(got, p.grad, 1e-5)


def test_30_the_memory_check_counts_bf16_weights_and_refuses_before_the_step(xla):
    n = sum(p.numel() for p in wide().parameters())  # 69635
    assert n == 69635
    # bf16 weights and gradients 2 bytes each; AdamW's two moments and the float32 copy 12
    assert error(xla["one"]["memory_bf16"]) == (
        "MemoryError: this run needs 1.11 MB per device for parameters, gradients and optimizer "
        "state (139.27 kB + 139.27 kB + 835.62 kB) before any activation, and a device has "
        "1.02 kB: split the weights over the devices with tu.fsdp(model) (all cores), turn on "
        "gradient checkpointing (model.gradient_checkpointing_enable()), keep the weights in "
        "bfloat16, or use a smaller batch")


def test_30b_the_memory_check_counts_weights_the_optimizer_does_not_hold(xla):
    # every weight is on the device and takes a gradient; AdamW's state is the head's only
    assert "(278.54 kB + 278.54 kB + 24.60 kB)" in error(xla["one"]["memory_partial"])
