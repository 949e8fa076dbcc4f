"""Issue 35, bad arguments and bad data: `average_gradients` on what is not a list of
parameters, and parameters with a gradient on some replicas only; `gather` and `predict`
of dict and tuple outputs; datasets that return None, samples that do not collate;
`aug_transforms` arguments of the wrong type; `optimizer_step`'s closure and make_loader's
DataLoader arguments. Each refusal is one sentence naming the argument and the fix, the
same at every world size, before any collective.

The multi-replica cases run real processes over gloo (engine "distributed", forked: no
XLA in them); the XLA cases (SPMD over 8 CPU devices, make_loader's loading thread and
its workers) run as scripts in a subprocess."""
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import tpu_utility as tu
from conftest import child_processes


def run(fn, cores, *args):
    return tu.run(fn, cores=cores, args=args, engine="distributed", start_method="fork",
                  timeout=120)


def attempt(fn):
    try:
        fn()
        return None
    except Exception as e:
        return f"{type(e).__name__}: {e}"


# -- average_gradients on what is not parameters: one answer at every world size --------------

def not_parameters():
    """average_gradients of each thing that is not a list of parameters: the error, or None."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(tu.get_device())
    model(torch.randn(3, 4, device=tu.get_device())).sum().backward()
    used_up = model.parameters()
    list(used_up)  # as an optimizer made from it did
    cases = {"module": model, "plain": [torch.ones(2, device=tu.get_device())],
             "used_up": used_up, "tensor": model.weight, "dict": model.state_dict(),
             "named": model.named_parameters(), "numbers": [1.0, 2.0]}
    return {name: attempt(lambda: tu.average_gradients(arg)) for name, arg in cases.items()}


NOT_PARAMETERS = {
    "module": "TypeError: average_gradients(params): pass model.parameters(), got an nn.Module (Linear)",
    "plain": "TypeError: average_gradients(params): pass model.parameters(): the tensor at position 0 "
             "takes no gradient",
    "used_up": "ValueError: average_gradients(params): got no parameters (a generator such as "
               "model.parameters() is used up",
    "tensor": "TypeError: average_gradients(params): pass model.parameters() or a list of parameters "
              "([w]), got a single tensor",
    "dict": "TypeError: average_gradients(params): pass model.parameters() or a list of parameters (a "
            "state_dict's tensors take no gradients)",
    "named": "TypeError: average_gradients(params): pass model.parameters(), got (name, parameter) pairs",
    "numbers": "TypeError: average_gradients(params): pass model.parameters() or a list of tensors, got "
               "a float at position 0",
}


def check_not_parameters(out):
    for name, start in NOT_PARAMETERS.items():
        assert out[name] is not None and out[name].startswith(start), (name, out[name])


@pytest.mark.parametrize("world", [1, 2])
def test_average_gradients_refuses_what_is_not_parameters_at_every_world_size(world):
    out = run(not_parameters, world)
    check_not_parameters(out)
    assert child_processes() == []


SPMD_SCRIPT = """
    import json, test_bad_arguments as t, tpu_utility as tu

    if __name__ == "__main__":
        print("RESULT", json.dumps(tu.run(t.not_parameters, cores=8, engine="spmd",
                                          start_method="fork", timeout=300)))
"""


def test_average_gradients_refuses_the_same_under_spmd(run_script):
    out = run_script(SPMD_SCRIPT, timeout=300).result
    check_not_parameters(out)
    assert out == run(not_parameters, 2)  # word for word what two replicas say


# -- a gradient on some replicas and not on others --------------------------------------------

def two_layers():
    torch.manual_seed(0)
    return nn.Linear(4, 3), nn.Linear(4, 3)


def rows(rank):
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))


def uneven(case):
    """Gradients of two layers, made uneven over replicas as `case` says; the error, or
    the averaged gradients."""
    a, b = two_layers()
    x = rows(tu.rank())
    if case == "branch":  # the second layer used on replica 0 only
        y = a(x) + (b(x) if tu.rank() == 0 else 0)
    else:
        y = a(x) + b(x) if case != "unused" else a(x)
    y.square().sum().backward()
    params = list(a.parameters()) + list(b.parameters())
    if case == "set_none" and tu.rank() == 1:
        b.bias.grad = None
    if case == "swapped":  # as many numbers on each replica, of different parameters
        (a if tu.rank() == 0 else b).bias.grad = None
    if case == "optimizer":
        opt = torch.optim.SGD(params, lr=0.1)
        if tu.rank() == 1:
            b.weight.grad = None
        return attempt(lambda: tu.optimizer_step(opt))
    error = attempt(lambda: tu.average_gradients(params))
    return error or [None if p.grad is None else p.grad for p in params]


@pytest.mark.parametrize("case, named", [
    ("branch", ["parameter 2 (shape [3, 4]", "parameter 3 (shape [3]"]),
    ("set_none", ["parameter 3 (shape [3], a gradient on this replica)"]),
    ("swapped", ["parameter 1 (shape [3], no gradient on this replica)", "parameter 3 (shape [3]"]),
    ("optimizer", ["optimizer_step: parameter 2 (shape [3, 4]"]),
])
def test_a_gradient_on_some_replicas_only_is_named_not_a_gloo_abort(case, named):
    # Before: gloo aborted the replica ("data size doesn't match"), or, with as many numbers
    # on each replica ("swapped"), averaged one parameter's gradient into another's.
    out = run(uneven, 2, case)
    assert isinstance(out, str) and out.startswith("RuntimeError: "), out
    for words in named:
        assert words in out, out
    assert "got a gradient on some of the 2 replicas and not on the others" in out
    assert "use every parameter in the forward pass of every replica, or give an unused one " \
           "zeros (p.grad = torch.zeros_like(p))" in out
    assert child_processes() == []


def test_a_parameter_unused_on_every_replica_keeps_no_gradient_and_the_rest_average():
    out = run(uneven, 2, "unused")
    grads = []
    for rank in range(2):  # plain CPU torch: each replica's gradients, then their mean
        a, b = two_layers()
        a(rows(rank)).square().sum().backward()
        grads.append([p.grad for p in a.parameters()])
    mean = [(g0 + g1) / 2 for g0, g1 in zip(*grads)]
    assert out[2] is None and out[3] is None  # as before: no gradient made up
    assert all(torch.equal(got, want) for got, want in zip(out[:2], mean))


# -- gather and predict of dict and tuple outputs ---------------------------------------------

class Heads(nn.Module):
    """A model whose output is a dict (nested) or a tuple of per-sample rows."""

    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.body, self.head = kind, nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        f = torch.relu(self.body(x))
        if self.kind == "dict":
            return {"logits": self.head(f), "aux": {"feat": f, "ids": x[:, 0].long()}}
        if self.kind == "per_sample":  # a list with a tensor for each sample
            return list(self.head(f))
        return self.head(f), f


def heads_data():
    x = torch.randn(203, 3, generator=torch.Generator().manual_seed(0))  # 203: no world divides it
    x[:, 0] = torch.arange(203.)
    return torch.utils.data.TensorDataset(x)


def as_lists(tree):
    if isinstance(tree, dict):
        return {k: as_lists(v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return [as_lists(v) for v in tree]
    return tree.tolist()


def evaluate_heads():
    """predict of dict and tuple outputs, and gather in a loop of one's own."""
    out = {}
    for kind in ("dict", "tuple"):
        model = Heads(kind).to(tu.get_device()).train()
        out[kind] = as_lists(tu.predict(model, heads_data(), batch_size=16))
        out[kind + "_mode"] = model.training  # given back as it came
    loader = tu.make_loader(heads_data(), 16, train=False, num_workers=0)
    mine = {"x": [], "twice": []}
    for (x,) in loader:  # a user's own evaluation loop with dict outputs
        mine["x"].append(x[:, 0])
        mine["twice"].append(2 * x)
    out["gather"] = as_lists(tu.to_cpu(tu.gather({k: torch.cat(v) for k, v in mine.items()}, loader)))
    out["unjoined"] = attempt(lambda: tu.gather(mine["x"], loader))
    out["scalar"] = attempt(lambda: tu.gather({"loss": torch.zeros((), device=tu.get_device())}, loader))
    out["per_sample"] = attempt(lambda: tu.predict(Heads("per_sample").to(tu.get_device()),
                                                   heads_data(), batch_size=16))
    out["batch_size"] = attempt(lambda: tu.predict(Heads("dict").to(tu.get_device()), heads_data(),
                                                   batch_size=0))
    return out


GATHER_SCRIPT = """
    import json, test_bad_arguments as t, tpu_utility as tu

    if __name__ == "__main__":
        out = {f"{engine}{cores}": tu.run(t.evaluate_heads, cores=cores, engine=engine,
                                          start_method="fork", timeout=300)
               for engine, cores in ((None, 1), (None, 8), ("distributed", 3))}
        print("RESULT", json.dumps(out))
"""


def test_gather_and_predict_keep_dicts_and_tuples_of_outputs(run_script):
    r = run_script(GATHER_SCRIPT, timeout=400).result
    x = heads_data().tensors[0]
    with torch.no_grad():  # the same models on plain CPU torch
        want_dict = Heads("dict").eval()(x)
        want_tuple = Heads("tuple").eval()(x)
    for name, case in r.items():
        got = case["dict"]
        assert sorted(got) == ["aux", "logits"] and sorted(got["aux"]) == ["feat", "ids"], name
        assert got["aux"]["ids"] == list(range(203)), name  # dataset order, each sample once
        assert torch.allclose(torch.tensor(got["logits"]), want_dict["logits"], atol=1e-5), name
        assert torch.allclose(torch.tensor(got["aux"]["feat"]), want_dict["aux"]["feat"], atol=1e-5), name
        logits, feat = case["tuple"]
        assert torch.allclose(torch.tensor(logits), want_tuple[0], atol=1e-5), name
        assert torch.allclose(torch.tensor(feat), want_tuple[1], atol=1e-5), name
        assert case["dict_mode"] is True and case["tuple_mode"] is True, name  # still training
        assert case["gather"]["x"] == [float(i) for i in range(203)], name
        assert torch.equal(torch.tensor(case["gather"]["twice"]), 2 * x), name
        assert "pass torch.cat(outputs), the batches' outputs joined" in case["unjoined"], name
        assert case["scalar"].startswith("TypeError: gather: gathers tensors with one row per sample")
        assert "got a 0-dim tensor (output['loss'])" in case["scalar"], name
        assert case["per_sample"].startswith("TypeError: predict: got a list of "), name
        assert "return tensors whose dim 0 is the batch's samples" in case["per_sample"], name
        assert case["batch_size"] == "ValueError: predict: batch_size must be a positive int or " \
                                     "None (per core), got 0", name


# -- what a dataset returns ------------------------------------------------------------------

LOADING_SCRIPT = """
    import json, torch, tpu_utility as tu
    from torch.utils.data import Dataset

    class Odd(Dataset):
        '''32 samples of (tensor [3, 8], label); sample 13 is what `kind` says.'''

        def __init__(self, kind, n=32):
            self.kind, self.n = kind, n

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            if i == 13 and self.kind == "none":
                return None  # a forgotten `return`
            if i == 13 and self.kind == "mixed":
                return torch.zeros(3, 8), "cat"
            if i == 13 and self.kind == "shape":
                return torch.zeros(3, 6), 0
            if i == 13 and self.kind == "form":
                return {"image": torch.zeros(3, 8), "label": 0}
            if i >= 20 and self.kind == "short":  # fewer samples than __len__ says
                raise IndexError(f"list index {i} out of range")
            if self.kind == "dicts":
                return {"image": torch.zeros(3, 8, 8), "label": 1}
            return torch.zeros(3, 8), 1

    def attempt(fn):
        try:
            return {"value": fn()}
        except Exception as e:
            return {"error": type(e).__name__, "message": str(e)}

    def train():
        out = {}
        for workers in (0, 2):
            for kind in ("none", "mixed", "shape", "form", "short"):
                loader = tu.make_loader(Odd(kind), 4, num_workers=workers, shuffle=False)
                out[f"{kind}{workers}"] = attempt(lambda: sum(1 for _ in loader))
            valid = tu.make_loader(Odd("none"), 4, train=False, num_workers=workers)
            out[f"predict{workers}"] = attempt(lambda: tu.predict(torch.nn.Identity(), valid))
            skip = tu.make_loader(Odd("none"), 4, num_workers=workers, shuffle=False, skip_errors=True)
            out[f"skip{workers}"] = attempt(lambda: sum(1 for _ in skip))
            out[f"skipped{workers}"] = [i for i, _ in skip.skipped]
        out["empty"] = attempt(lambda: tu.make_loader(Odd("none", n=0), 4))
        # a collate_fn that returns nothing, and dict samples to augment
        nothing = tu.make_loader(Odd("fine"), 4, num_workers=0, collate_fn=lambda samples: None)
        out["collate_none"] = attempt(lambda: sum(1 for _ in nothing))
        dicts = tu.make_loader(Odd("dicts"), 4, num_workers=0,
                               augment=tu.aug_transforms(mixup=0.4, num_classes=3))
        out["dict_augment"] = attempt(lambda: sum(1 for _ in dicts))
        return out

    if __name__ == "__main__":
        print("RESULT", json.dumps(tu.run(train, cores=1, start_method="fork", timeout=300)))
"""


def test_bad_samples_name_their_dataset_index_and_the_fix(run_script):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = run_script(LOADING_SCRIPT, timeout=400).result
    for workers in (0, 2):  # in make_loader's loading thread, and in DataLoader workers
        def said(kind):
            case = r[f"{kind}{workers}"]
            assert "error" in case, (kind, workers, case)
            return case["error"], case["message"]
        for kind in ("none", "predict"):
            error, message = said(kind)
            assert error == "TypeError" and "dataset[13] returned None: __getitem__ must return " \
                                           "the sample (is its `return` missing" in message, message
        error, message = said("mixed")
        assert error == "TypeError" and "dataset[12]'s sample[1] is an int where dataset[13]'s is a " \
                                        "str: return one type there for every sample" in message
        error, message = said("shape")
        assert error == "TypeError" and "dataset[12]'s sample[0] is a tensor of shape [3, 8] where " \
                                        "dataset[13]'s is one of shape [3, 6]: make every sample one " \
                                        "size in the dataset" in message and "collate_fn" in message
        error, message = said("form")
        assert error == "TypeError" and "dataset[12] is a tuple of 2 and dataset[13] is a dict with " \
                                        "keys ['image', 'label']: return one structure" in message
        # Fewer samples than __len__: the IndexError reaches the loop, not a short epoch.
        error, message = said("short")
        assert error == "IndexError" and "list index 20 out of range" in message
        # skip_errors takes a None for a failed sample: replaced, and listed.
        assert r[f"skip{workers}"] == {"value": 8} and r[f"skipped{workers}"] == [13]
    assert r["empty"]["message"].startswith("make_loader: the dataset is empty (0 samples): check")
    # Before: "the thread that loads batches died", and "a sample's label is None".
    assert r["collate_none"] == {"error": "TypeError", "message": "make_loader: the collate_fn "
                                 "returned None for a batch: return the collated batch from it"}
    assert r["dict_augment"]["error"] == "TypeError"
    assert "the dataset returned a dict: return (image, label) from __getitem__" in \
        r["dict_augment"]["message"]


# -- aug_transforms' arguments, by type -------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(size=32.0), "size must be a positive int or (height, width), got 32.0 (a float: pass an int)"),
    (dict(size=(32, 32.0)), "size must be a positive int or (height, width), got (32, 32.0)"),
    (dict(size=True), "size must be a positive int or (height, width), got True"),
    (dict(size=torch.tensor(32)), "size must be a positive int or (height, width), got tensor(32)"),
    (dict(flip="yes"), "flip must be a number in [0, 1] (a probability), got 'yes'"),
    (dict(p_affine=None), "p_affine must be a number in [0, 1] (a probability), got None"),
    (dict(max_rotate="10"), "max_rotate must be a number in [0, inf] (not negative), got '10'"),
    (dict(max_zoom="1.1"), "(min_zoom, max_zoom) must be a (low, high) pair of numbers, got (1.0, '1.1')"),
    (dict(min_zoom="1.0"), "(min_zoom, max_zoom) must be a (low, high) pair of numbers, got ('1.0', 1.1)"),
    (dict(ratio=(0.75, math.inf)), "ratio must be finite, got (0.75, inf)"),
    (dict(cutout_ratio=(0.3, math.inf)), "cutout_ratio must be finite, got (0.3, inf)"),
    (dict(cutout_scale="ab"), "cutout_scale must be a (low, high) pair of numbers, got 'ab'"),
    (dict(max_translate=2.0), "max_translate must be at most 1 (a shift by the whole side), got 2.0"),
    (dict(mixup=True, num_classes=3), "mixup must be a number in [0, inf] (not negative), got True"),
    (dict(mixup=0.4, num_classes=3.0), "pass num_classes= (an int >= 2), got num_classes=3.0"),
])
def test_aug_transforms_refuses_wrong_types_in_one_sentence(kwargs, message):
    with pytest.raises(ValueError) as info:
        tu.aug_transforms(**kwargs)
    assert message in str(info.value)


def test_augment_given_the_function_itself_says_call_it():
    ds = torch.utils.data.TensorDataset(torch.zeros(8, 3, 4, 4), torch.zeros(8))
    with pytest.raises(TypeError) as info:
        tu.make_loader(ds, 4, augment=tu.aug_transforms)
    assert str(info.value) == "augment=tu.aug_transforms passes the function: call it, " \
                              "augment=tu.aug_transforms(...)"


def test_aug_transforms_takes_numpy_numbers():
    aug = tu.aug_transforms(size=np.int64(32), flip=np.float32(0.5), max_rotate=np.float64(5),
                            mixup=0.2, num_classes=np.int64(10))
    assert aug.size == (32, 32) and type(aug.size[0]) is int and aug.flip == 0.5
    assert aug.num_classes == 10 and type(aug.num_classes) is int


# -- optimizer_step's closure, and make_loader's DataLoader arguments --------------------------

def closures():
    """optimizer_step with a closure that is not a function, returns None, or calls no
    backward; and with something that is not an optimizer."""
    w = nn.Parameter(torch.ones(2))
    lbfgs = torch.optim.LBFGS([w], max_iter=3)
    sgd = torch.optim.SGD([w], lr=0.1)

    def no_backward():
        lbfgs.zero_grad()
        return ((w - 3) ** 2).sum()

    def no_loss():
        lbfgs.zero_grad()
        ((w - 3) ** 2).sum().backward()

    out = {"no_backward": attempt(lambda: tu.optimizer_step(lbfgs, no_backward)),
           "unmoved": w.tolist(),
           "no_loss": attempt(lambda: tu.optimizer_step(lbfgs, no_loss)),
           "tensor": attempt(lambda: tu.optimizer_step(sgd, (w ** 2).sum())),
           "model": attempt(lambda: tu.optimizer_step(nn.Linear(2, 2)))}
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_optimizer_step_closures_that_would_step_nothing_are_refused(world):
    out = run(closures, world)
    # Before: LBFGS returned at once with no gradients, silently (w stayed at 1).
    assert out["no_backward"] == "RuntimeError: optimizer_step(opt, closure): the closure left no " \
                                 "gradients: call loss.backward() inside it, after opt.zero_grad()"
    assert out["unmoved"] == [1.0, 1.0]
    assert out["no_loss"] == "TypeError: optimizer_step(opt, closure): LBFGS reads the loss the " \
                             "closure returns, and it returned None: return the loss"
    assert out["tensor"].startswith("TypeError: optimizer_step(opt, closure): the closure must be a "
                                    "function that computes the loss and calls backward, got Tensor")
    assert out["model"] == "TypeError: optimizer_step(opt): pass the torch optimizer, got Linear"


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(num_workers=2.5), ValueError, "make_loader: num_workers must be an int >= 0 or None, got 2.5"),
    (dict(num_workers=-1), ValueError, "make_loader: num_workers must be an int >= 0 or None, got -1"),
    (dict(seed=None), TypeError, "make_loader: seed must be an int (it seeds each epoch's order), got None"),
    (dict(seed=1.5), TypeError, "make_loader: seed must be an int (it seeds each epoch's order), got 1.5"),
    # A bare AssertionError at the first epoch before; a raw random_() error at its start.
    (dict(num_workers=2, prefetch_factor=0), ValueError,
     "make_loader: prefetch_factor must be a positive int or None, got 0"),
    (dict(generator=0), TypeError,
     "make_loader(generator=...) takes a torch.Generator (or None), got int: for a seed, pass seed="),
])
def test_make_loader_refuses_worker_counts_and_seeds_of_the_wrong_kind(kwargs, error, message):
    # Refused as the loader is made (its spec), before any DataLoader: no XLA here.
    ds = torch.utils.data.TensorDataset(torch.zeros(8, 2))
    with pytest.raises(error) as info:
        tu.make_loader(ds, 4, **kwargs)
    assert str(info.value) == message


# -- NumPy numbers, as torch takes them (issue 47) ---------------------------------------------

def numpy_numbers(numbers):
    """train_one_cycle on make_loader with every count and size given as `numbers` makes
    them: NumPy's scalars (a config read with np.load, an arange) or Python's."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g),
                                        torch.randint(0, 3, (64,), generator=g))
    model = nn.Linear(4, 3).to(tu.get_device())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = tu.make_loader(ds, numbers.int(16), num_workers=numbers.int(2),
                            prefetch_factor=numbers.int(2), seed=numbers.int(7))
    tu.train_one_cycle(model, loader, opt, nn.functional.cross_entropy,
                       epochs=numbers.int(2), max_lr=numbers.float(0.05),
                       clip=numbers.float(1.0), grad_accum=numbers.int(1), progress=False)
    spec = loader.spec
    return {"weights": [p.detach().cpu() for p in model.parameters()],
            "types": [type(v).__name__ for v in (spec.batch_size, spec.num_workers, spec.seed)]}


class _Python:
    int, float = int, float


class _NumPy:
    int, float = np.int64, np.float32


def test_numpy_numbers_are_taken_where_python_numbers_are():
    # 3d4ad59: run(cores=np.int64(1)), num_workers/prefetch_factor/seed=np.int64(...) and
    # clip=np.float32(1.0) were each refused ("must be an int", "a positive number").
    numpy = tu.run(numpy_numbers, cores=np.int64(1), args=(_NumPy,), engine="distributed",
                   start_method="fork", timeout=np.int64(120))
    python = run(numpy_numbers, 1, _Python)
    assert numpy["types"] == ["int", "int", "int"]  # kept as ints: JSON and pickle stay plain
    # max_lr is np.float32(0.05) there, so the schedule differs from 0.05 in the 9th digit
    for a, b in zip(numpy["weights"], python["weights"]):
        assert torch.allclose(a, b, atol=1e-6), (a, b)
    assert tu.scale_lr_bs(1e-3, np.int64(32), cores=np.int64(8), verbose=False).global_batch_size == 256
