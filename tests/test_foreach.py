"""On XLA the library's optimizer step uses torch's foreach kernels where the user left
`foreach` unset (torch picks them on CUDA and CPU only): the results are bit-equal to
torch's per-parameter loop, with and without clipping, at 1 device and 8 SPMD devices;
an explicit foreach=False is kept."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import tpu_utility as tu

OPTIMIZERS = {
    "Adam": lambda params, **kw: torch.optim.Adam(params, lr=1e-2, **kw),
    "AdamW": lambda params, **kw: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **kw),
    "SGD momentum": lambda params, **kw: torch.optim.SGD(params, lr=0.05, momentum=0.9,
                                                         nesterov=True, weight_decay=1e-4, **kw),
    "RMSprop": lambda params, **kw: torch.optim.RMSprop(params, lr=1e-3, momentum=0.5, **kw),
}


def data():
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(128, 8, generator=g) * 4, torch.randint(0, 3, (128,), generator=g))


def train(make, clip, foreach_false):
    """One epoch of 16 global batches; the library's step, or torch's loop kept by foreach=False."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 3)).to(tu.get_device())
    opt = make(model.parameters(), foreach=False) if foreach_false else make(model.parameters())
    for x, y in tu.make_loader(data(), 8 // tu.world_size(), num_workers=0):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if clip:  # small enough to clip every step
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        tu.optimizer_step(opt)
    return tu.to_cpu(model.state_dict()), opt.param_groups[0]["foreach"]


def foreach_against_the_loop():
    out = {}
    for name, make in OPTIMIZERS.items():
        for clip in (None, 0.05):
            (mine, mine_foreach), (loop, loop_foreach) = (train(make, clip, False),
                                                          train(make, clip, True))
            out[f"{name} clip={clip}"] = {
                "equal": all(torch.equal(mine[k], loop[k]) for k in loop),
                "moved": any(not torch.equal(mine[k], v) for k, v in data_free_init().items()),
                "foreach": [mine_foreach, loop_foreach]}
    torch.manual_seed(0)
    model = nn.Linear(8, 3).to(tu.get_device())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    tu.train_one_cycle(model, tu.make_loader(data(), 8, num_workers=0), opt, F.cross_entropy,
                       1, clip=1.0, progress=False)
    out["train_one_cycle"] = opt.param_groups[0]["foreach"]
    return out


def data_free_init():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 3)).state_dict()


def test_foreach_steps_and_clipping_are_bit_equal_to_torchs_loop(run_script):
    proc = run_script("""
        import json, tpu_utility as tu
        from test_foreach import foreach_against_the_loop
        print("RESULT", json.dumps({str(c): tu.run(foreach_against_the_loop, cores=c,
                                                   start_method="fork") for c in (1, 8)}))
    """, timeout=300)
    for cores, cases in proc.result.items():
        assert cases.pop("train_one_cycle") is True, cores
        assert len(cases) == 8
        for case, r in cases.items():
            assert r["equal"] and r["moved"], (cores, case)
            assert r["foreach"] == [True, False], (cores, case)  # set where unset; False kept
