"""The training loop's pure parts, in this process and without XLA: argument refusals,
the lr/momentum writer, the state_dict round trips, the nested-data walker and the
positive-int check. Expected values are closed forms (tests/reference.py) or written out."""
import collections
import dataclasses
import inspect
import math
import re
import sys

import numpy as np
import pytest
import torch

from reference import one_cycle_lr, one_cycle_mom
from tpu_utility._tree import (batch_len, flatten, leaf_names, map_tensors, replace_tensors_anywhere,
                               tensors_anywhere, unbatch, unflatten)
from tpu_utility.amp import autocast_context
from tpu_utility.checks import check_int
from tpu_utility.loop import one_cycle as oc
from tpu_utility.loop.hypers import Hypers, momentum_key
from tpu_utility.loop.lr_find import _check as check_lr_find
from tpu_utility.loop.resume import check_same_run, data_fingerprint, resume_point
from tpu_utility.input_wait import InputWait
from tpu_utility.loop.state import EpochStats, History, LossGuard, Position
from tpu_utility.schedules import one_cycle

DEFAULTS = {k: p.default for k, p in inspect.signature(oc.train_one_cycle).parameters.items()
            if p.default is not inspect.Parameter.empty}


def adam(lr=1e-3):
    return torch.optim.Adam([torch.nn.Parameter(torch.ones(2))], lr=lr)


def options(**given):
    """train_one_cycle's arguments as its locals() would hold them, checked."""
    args = {**DEFAULTS, "model": None, "train_loader": None, "opt": adam(), "loss_fn": None,
            "epochs": 2, **given}
    return oc._Options.check(args)


@pytest.mark.parametrize("given, message", [
    (dict(epochs=0), "epochs must be a positive int, got 0"),
    (dict(epochs=2.0), "epochs must be"),
    (dict(epochs=True), "epochs must be"),
    (dict(grad_accum=0), "grad_accum must be a positive int"),
    (dict(log_every=0), "log_every must be a positive int or None"),
    (dict(checkpoint_every=5), "checkpoint_every needs checkpoint=path"),
    (dict(checkpoint_every=0, checkpoint="c.pt"), "checkpoint_every must be a positive int or None (optimizer steps)"),
    (dict(max_lr=0.0), "max_lr must be a positive number, got 0.0"),
    (dict(max_lr=-1e-3), "max_lr must be a positive number"),
    (dict(pct_start=1.0), "pct_start"),
    (dict(save_best="b.pt", monitor="accuracy"), "monitor='accuracy' is not computed here"),
    (dict(opt=torch.optim.Adagrad([torch.nn.Parameter(torch.ones(1))])), "neither `momentum` nor `betas`"),
])
def test_train_one_cycle_refuses_bad_options_naming_them(given, message):
    with pytest.raises(ValueError) as e:
        options(**given)
    assert message in str(e.value)


def test_options_take_the_optimizers_lr_per_group_and_its_momentum_key():
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.ones(1))], "lr": 0.1},
                           {"params": [torch.nn.Parameter(torch.ones(1))], "lr": 0.3}], momentum=0.9)
    o = options(opt=opt)
    assert o.max_lrs == (0.1, 0.3) and o.mom_key == "momentum"
    assert options(max_lr=0.5, opt=opt).max_lrs == (0.5, 0.5)
    assert options(moms=None, opt=torch.optim.Adagrad([torch.nn.Parameter(torch.ones(1))])).mom_key is None
    assert momentum_key(adam()) == "betas"


def test_precision_refusals():
    with pytest.raises(ValueError, match="fp16.*bf16"):
        autocast_context("fp16", torch.device("xla"))
    with pytest.raises(ValueError, match="precision must be 'fp32', 'bf16' or 'fp16', got 'fp8'"):
        autocast_context("fp8", torch.device("cpu"))


@pytest.mark.parametrize("args, message", [
    ((1.0, 1e-3, 100, 10, ()), "start_lr < end_lr"),
    ((1e-7, 10.0, 5, 10, ()), "num_it must be an int >= 30"),
    ((1e-7, 10.0, 100, 0, ()), "check_every must be a positive int"),
    ((1e-7, 10.0, 100, 10, ("best",)), "unknown suggestions ['best']"),
])
def test_lr_find_refuses_bad_arguments(args, message):
    with pytest.raises(ValueError) as e:
        check_lr_find(*args, dict(stop_div=True, beta=0.98, batch_fn=None, precision="fp32"))
    assert message in str(e.value)


def test_hypers_write_the_closed_form_schedule_and_give_the_optimizer_back():
    opt = torch.optim.Adam([{"params": [torch.nn.Parameter(torch.ones(1))], "lr": 1e-3},
                            {"params": [torch.nn.Parameter(torch.ones(1))], "lr": 2e-3}],
                           betas=(0.9, 0.99))
    hypers = Hypers(opt, [one_cycle(0.1), one_cycle(0.2)], "betas")
    with hypers.restoring():
        for pos in (0.1, 0.25, 0.6, 0.99):
            hypers.set(pos)
            for group, max_lr in zip(opt.param_groups, (0.1, 0.2)):
                assert group["lr"] == pytest.approx(one_cycle_lr(max_lr, pos), rel=1e-12)
                assert group["betas"][0] == pytest.approx(one_cycle_mom(pos), rel=1e-12)
                assert group["betas"][1] == 0.99
            lr, mom = hypers.held()
            assert (lr, mom) == (opt.param_groups[0]["lr"], opt.param_groups[0]["betas"][0])
        # 0.0 and 1.0 are never written (XLA makes them special constants: a new graph)
        Hypers(opt, [(lambda pos: 0.0, lambda pos: 1.0)] * 2, "betas").set(0.5)
        assert 0.0 < opt.param_groups[0]["lr"] <= 1e-30 and 0.999999 < opt.param_groups[0]["betas"][0] < 1.0
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 2e-3]
    assert [g["betas"] for g in opt.param_groups] == [(0.9, 0.99), (0.9, 0.99)]


def test_hypers_restore_even_when_training_fails():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.5, momentum=0.8)
    hypers = Hypers(opt, [one_cycle(1.0)], "momentum")
    with pytest.raises(RuntimeError), hypers.restoring():
        hypers.set(0.5)
        raise RuntimeError("a step failed")
    assert (opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]) == (0.5, 0.8)


def test_state_dicts_round_trip_through_plain_values():
    h = History(epochs=[EpochStats(0, 0.5, 0.4, {"accuracy": 0.9}, 1e-3, 2.0, 100.0, 3, 2, True, 1, 0.25)],
                lrs=[1e-3, 2e-3], moms=[0.9, 0.85], logged=[(1, 0.7), (2, 0.6)], best=0.4, plot="p.png",
                input=InputWait(0, 0.5, 2.0, 10, 640, 2, "image files", False))
    saved = torch.load(_through_a_file(h.state_dict()), weights_only=True)
    back = History()
    back.load_state_dict(saved)
    assert back == h and back.logged == [(1, 0.7), (2, 0.6)]
    at = Position(2, 7, 40, 28)
    back_at = Position()
    back_at.load_state_dict(at.state_dict())
    assert back_at == at
    guard = LossGuard(h, 1e-2, "best.pt")
    guard.checked, guard.last_good, guard.saved_epoch = 2, (2, 0.6), 0
    other = LossGuard(History(), 1e-2, "best.pt")
    other.load_state_dict(torch.load(_through_a_file(guard.state_dict()), weights_only=True))
    assert (other.checked, other.last_good, other.saved_epoch) == (2, (2, 0.6), 0)


def _through_a_file(obj):
    import io
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_loss_guard_names_where_the_loss_went_non_finite():
    h = History(logged=[(1, 0.9), (50, 0.5), (100, math.nan)])
    guard = LossGuard(h, 1e-2, None)
    with pytest.raises(FloatingPointError, match=r"between step 50 \(loss 0.5\) and step 100") as e:
        guard.check_logged()
    assert e.value.history is h


def test_resume_point_on_the_same_and_on_another_number_of_cores():
    saved = {"epoch": 1, "batch": 26, "step": 90, "samples": 104, "run": {"cores": 1}}
    assert resume_point(saved, {"cores": 1, "steps per epoch": 64}, 1) == Position(1, 26, 90, 104)
    # 26 batches of 4 at 1 core are 13 of 2 x 4 at 2 cores; 32 steps an epoch there.
    assert resume_point(saved, {"cores": 2, "steps per epoch": 32}, 1) == Position(1, 13, 45, 52)


def test_a_checkpoint_of_another_run_is_refused_naming_each_difference():
    here = {"epochs": 3, "cores": 2, "parameter shapes": {"w": [4]}}
    with pytest.raises(ValueError, match=r"epochs 3 here, 2 in the checkpoint.*allow_world_change"):
        check_same_run({"epochs": 2, "cores": 1, "parameter shapes": {"w": [4]}}, here, "c.pt", False)
    check_same_run({"epochs": 3, "cores": 1, "parameter shapes": {"w": [4]}}, here, "c.pt", True)


def test_check_int():
    for bad in (0, -1, 2.0, True, "3", None):
        with pytest.raises(ValueError, match="n must be a positive int, got"):
            check_int(bad, "n")
    check_int(None, "n", none_ok=True)
    with pytest.raises(ValueError, match=r"show: q must be an int in 1..95, got 96"):
        check_int(96, "q", high=95, who="show")


def test_one_walker_over_nested_data():
    Pair = collections.namedtuple("Pair", "x y")
    data = {"a": (torch.ones(3, 2), [torch.zeros(3), "tag"]), "b": Pair(torch.arange(3), None)}
    structure, leaves = flatten(data)
    assert len(leaves) == 5 and leaf_names(structure)[1] == "sample['a'][1][0]"
    doubled = map_tensors(data, lambda t: t * 2)
    assert isinstance(doubled["b"], Pair) and doubled["b"].x.tolist() == [0, 2, 4]
    assert doubled["a"][1][1] == "tag" and doubled["a"][0].sum().item() == 12
    assert unflatten(structure, leaves)["a"][1][1] == "tag"
    assert batch_len(data) == 3 and batch_len(torch.tensor(5.0)) == 1 and batch_len(["x"]) == 0
    samples = unbatch([torch.arange(3), ["a", "b", "c"]], "show")
    assert [(s[0].item(), s[1]) for s in samples] == [(0, "a"), (1, "b"), (2, "c")]
    with pytest.raises(TypeError, match="show: cannot split a batch of type int"):
        unbatch(7, "show")


@dataclasses.dataclass
class _Box:
    w: torch.Tensor
    inner: object


class _Slotted:
    __slots__ = ("xs",)

    def __init__(self, xs):
        self.xs = xs


def test_the_result_walker_reaches_tensors_inside_any_object():
    # run()'s result (issue 47): tensors inside a dataclass, a slotted object's list, a
    # module, however deep, each found once; a copy with the chosen ones replaced.
    a, b, p = torch.ones(2), torch.zeros(3), torch.nn.Parameter(torch.full((1,), 5.0))
    module = torch.nn.Linear(1, 1)
    data = {"box": _Box(a, _Slotted([b, (a, {"p": p})])), "m": module, "n": 3}
    found = tensors_anywhere(data)
    assert {id(t) for t in found} == {id(a), id(b), id(p), id(module.weight), id(module.bias)}
    assert len(found) == 5
    out = replace_tensors_anywhere(data, {id(a): a + 1, id(p): torch.nn.Parameter(p * 2)})
    assert out["box"].w.tolist() == [2.0, 2.0] and out["box"].inner.xs[1][0] is out["box"].w
    assert out["box"].inner.xs[0] is b and out["n"] == 3  # the others stay the same objects
    assert isinstance(out["box"].inner.xs[1][1]["p"], torch.nn.Parameter)
    assert out["box"].inner.xs[1][1]["p"].tolist() == [10.0] and out["m"].weight is module.weight
    with pytest.raises(Exception, match="lambda|local object"):
        tensors_anywhere(_Box(a, lambda: 1))


class _OwnRng(torch.utils.data.Dataset):
    def __init__(self, n, own=True):
        self.n, self.rng = n, np.random.default_rng() if own else None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        noise = self.rng.normal(size=2) if self.rng is not None else np.random.normal(size=2)
        return torch.tensor(noise, dtype=torch.float32), i % 2


def test_data_with_its_own_random_generator_is_fingerprinted_by_its_layout():
    # Issue 47: rows that differ between two reads under the same seeds get no hash.
    steady = data_fingerprint(_OwnRng(32, own=False))  # the global generator: seeded, reproducible
    assert re.fullmatch(r"32 rows, hash \w{12}", steady) and data_fingerprint(_OwnRng(32, own=False)) == steady
    own = data_fingerprint(_OwnRng(32))
    assert re.fullmatch(r"32 rows, rows that differ between reads \(layout \w{12}\)", own)
    assert data_fingerprint(_OwnRng(32)) == own  # the same layout in every process
    here = {"train data": own, "cores": 1}
    assert check_same_run({"train data": own, "cores": 1}, here, "c.pt", False) == ["train data"]
    assert check_same_run({"train data": "32 rows, hash 0123456789ab", "cores": 1}, here,
                          "c.pt", False) == ["train data"]  # an older checkpoint of such data
    for other in (data_fingerprint(_OwnRng(16)), "16 rows, hash 0123456789ab"):
        with pytest.raises(ValueError, match="train data 32 rows, rows that differ"):
            check_same_run({"train data": other, "cores": 1}, here, "c.pt", False)
    with pytest.raises(ValueError, match=r"train data 32 rows, hash \w+ here, 32 rows, hash 0123"):
        check_same_run({"train data": "32 rows, hash 0123456789ab", "cores": 1},
                       {"train data": steady, "cores": 1}, "c.pt", False)  # reproducible data: as before


def test_the_parts_run_without_xla():
    assert "torch_xla" not in sys.modules


class _Planted:
    """Pickles as a call that would write a file when unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_checkpoint_is_read_without_unpickling_code(tmp_path):
    from tpu_utility.checkpoint import FORMAT, read
    path, marker = tmp_path / "ckpt.pt", tmp_path / "ran"
    torch.save({"format": FORMAT, "extra": _Planted(str(marker))}, path)
    with pytest.raises(ValueError, match="could run code"):
        read(str(path))
    assert not marker.exists()
