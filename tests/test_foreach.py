"""On XLA the library's optimizer step uses torch's foreach kernels where the user left
`foreach` unset (torch picks them on CUDA and CPU only), traces the optimizer's
in-place updates as an out-of-place op and a copy (in_place.py), and runs SGD's, Adam's and
AdamW's update from their second step as one computation (fused_step.py): the results are
bit-equal to torch's own per-parameter `opt.step()`, with and without clipping, at 1
device and 8 SPMD devices; an explicit foreach=False is kept. No Python meta kernel runs
in the library's step, where torch's own step runs several per parameter tensor, and the
in-place ops it rewrites keep their refusals."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import tpu_utility as tu

OPTIMIZERS = {
    "Adam": lambda params, **kw: torch.optim.Adam(params, lr=1e-2, **kw),
    "AdamW amsgrad": lambda params, **kw: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1,
                                                             amsgrad=True, **kw),
    "SGD momentum": lambda params, **kw: torch.optim.SGD(params, lr=0.05, momentum=0.9,
                                                         nesterov=True, weight_decay=1e-4, **kw),
    "RMSprop": lambda params, **kw: torch.optim.RMSprop(params, lr=1e-3, momentum=0.5, **kw),
}


def data():
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(128, 8, generator=g) * 4, torch.randint(0, 3, (128,), generator=g))


def train(make, clip, torchs_loop):
    """One epoch of 16 global batches: the library's step, or torch's own per-parameter
    `opt.step()` (foreach=False, none of tpu_utility in the step; under SPMD the
    gradients are already global)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 3)).to(tu.get_device())
    opt = make(model.parameters(), foreach=False) if torchs_loop else make(model.parameters())
    for x, y in tu.make_loader(data(), 8 // tu.world_size(), num_workers=0):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if clip:  # small enough to clip every step
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step() if torchs_loop else tu.optimizer_step(opt)
    return tu.to_cpu(model.state_dict()), opt.param_groups[0]["foreach"]


def meta_kernel_calls(step):
    """The Python meta kernels (torch/_meta_registrations.py) one call of `step` entered,
    by name, with how many times."""
    import collections
    import sys
    calls = collections.Counter()

    def profile(frame, event, arg):
        inside = frame.f_code.co_filename.endswith("_meta_registrations.py")
        if event == "call" and inside and not frame.f_back.f_code.co_filename.endswith(
                "_meta_registrations.py"):
            calls[frame.f_code.co_name] += 1
    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return dict(calls)


def steps_without_meta_kernels():
    """Python meta kernels run by one Adam step (foreach=True in both), torch's own
    against tu.optimizer_step's, and by an explicit foreach=False step through tu."""
    out = {}
    for who in ("torch", "tu", "tu foreach=False"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3)).to(tu.get_device())
        opt = torch.optim.Adam(model.parameters(), foreach=who != "tu foreach=False")
        for _ in range(2):  # the second step: the state exists
            opt.zero_grad()
            model(torch.ones(4, 8, device=tu.get_device())).sum().backward()
            out[who] = meta_kernel_calls(opt.step if who == "torch" else
                                         lambda: tu.optimizer_step(opt))
        out[who + " foreach"] = opt.param_groups[0]["foreach"]
    return out


def in_place_refusals():
    """What the rewritten in-place ops do under tu.in_place.as_copies, against the same
    ops without it: the error's first words, or the result's shape, dtype and values."""
    from tpu_utility.in_place import as_copies
    device = tu.get_device()

    def outcome(op):
        try:
            t = op()
            return [list(t.shape), str(t.dtype), t.cpu().tolist()]
        except RuntimeError as e:
            return str(e).split(" ")[:3]
    cases = {
        "broadcast": lambda: torch.zeros(3, device=device).add_(torch.ones(2, 3, device=device)),
        "broadcast foreach": lambda: torch._foreach_lerp_(
            [torch.zeros(3, device=device)], [torch.ones(2, 3, device=device)], 0.5) or
        torch.zeros(1),
        "int by float": lambda: torch.zeros(3, dtype=torch.int32, device=device).add_(
            torch.full((3,), 0.5, device=device)),
        "bf16 by float32": lambda: torch.zeros(3, dtype=torch.bfloat16, device=device).addcmul_(
            torch.full((3,), 1 / 3, device=device), torch.ones(3, device=device)),
        "a view": lambda: _through_a_view(device),
    }
    out = {}
    for name, op in cases.items():
        with torch.no_grad():
            plain = outcome(op)
            with as_copies(device):
                copied = outcome(op)
        out[name] = [plain, copied]
    # With autograd on, the op is left in place: its graph records the op itself.
    x = torch.ones(3, device=device, requires_grad=True)
    with as_copies(device):
        y = x.clone().mul_(torch.full((3,), 2.0, device=device))
    out["autograd"] = type(y.grad_fn).__name__
    return out


def _through_a_view(device):
    base = torch.zeros(2, 3, device=device)
    base[1].addcdiv_(torch.ones(3, device=device), torch.full((3,), 4.0, device=device))
    return base


def foreach_against_the_loop():
    out = {}
    for name, make in OPTIMIZERS.items():
        for clip in (None, 0.05):
            (mine, mine_foreach), (loop, loop_foreach) = (train(make, clip, False),
                                                          train(make, clip, True))
            out[f"{name} clip={clip}"] = {
                "equal": all(torch.equal(mine[k], loop[k]) for k in loop),
                "max difference": max(float((mine[k] - loop[k]).abs().max()) for k in loop),
                "moved": any(not torch.equal(mine[k], v) for k, v in data_free_init().items()),
                "foreach": [mine_foreach, loop_foreach]}
    torch.manual_seed(0)
    model = nn.Linear(8, 3).to(tu.get_device())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    tu.train_one_cycle(model, tu.make_loader(data(), 8, num_workers=0), opt, F.cross_entropy,
                       1, clip=1.0, progress=False)
    out["train_one_cycle"] = opt.param_groups[0]["foreach"]
    out["meta kernels"] = steps_without_meta_kernels()
    if tu.world_size() == 1:
        out["refusals"] = in_place_refusals()
    return out


def data_free_init():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 3)).state_dict()


def torch_xla_version():
    from importlib.metadata import version
    return tuple(int(v) for v in version("torch_xla").split(".")[:2])


def test_foreach_steps_and_clipping_are_bit_equal_to_torchs_loop(run_script):
    proc = run_script("""
        import json, tpu_utility as tu
        from test_foreach import foreach_against_the_loop
        print("RESULT", json.dumps({str(c): tu.run(foreach_against_the_loop, cores=c,
                                                   start_method="fork") for c in (1, 8)}))
    """, timeout=300)
    for cores, cases in proc.result.items():
        assert cases.pop("train_one_cycle") is True, cores
        meta = cases.pop("meta kernels")
        # torch's own step runs the Python meta kernels of lerp_, addcmul_ and addcdiv_ for
        # each of the 4 tensors; the library's none of them, foreach or not (the in-place
        # ops by a Python number it keeps, on purpose, run theirs in both)
        rewritten = {"lerp", "addcmul", "addcdiv"}
        assert all(meta["torch"].get(k) == 4 for k in rewritten), meta
        for who in ("tu", "tu foreach=False"):
            assert not rewritten & set(meta[who]), meta
            assert sum(meta[who].values()) < sum(meta["torch"].values()) / 2, meta
        assert meta["tu foreach"] is True and meta["tu foreach=False foreach"] is False, meta
        refusals = cases.pop("refusals", None)
        if cores == "1":
            for name, outcomes in refusals.items():
                if name != "autograd":
                    assert outcomes[0] == outcomes[1], (name, outcomes)
            assert refusals["broadcast"][0][:2] == ["output", "with"], refusals
            assert refusals["int by float"][0][0] == "Promotion", refusals
            assert refusals["bf16 by float32"][0][:2] == [[3], "torch.bfloat16"], refusals
            assert refusals["a view"][0] == [[2, 3], "torch.float32",
                                             [[0.0] * 3, [0.25] * 3]], refusals
            assert refusals["autograd"] == "MulBackward0", refusals
        assert len(cases) == 8
        for case, r in cases.items():
            assert r["moved"], (cores, case)
            if case.startswith("AdamW amsgrad") and torch_xla_version() < (2, 9):
                # torch_xla 2.8's XLA:CPU rounds this graph, whose outputs come in another
                # order, differently: 6e-8 apart when measured (in_place.py)
                assert r["max difference"] < 1e-6, (cores, case, r)
            else:
                assert r["equal"], (cores, case, r)
            assert r["foreach"] == [True, False], (cores, case)  # set where unset
