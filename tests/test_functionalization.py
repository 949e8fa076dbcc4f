"""run(functionalization=False) and check_functionalization: the replicas trace without
torch_xla's functional tensors, and the check finds equal, differing and failing models.

One script: each tu.run and each check run is a fresh child of it.
"""
import pytest

import tpu_utility as tu
from tpu_utility.compat import functionalization_on


def test_the_environment_is_read_as_torch_xla_reads_it():
    # sys_util::GetEnvBool: "true"/"false", else atoi(), nonzero meaning disabled
    cases = {None: True, "1": False, "0": True, "true": False, "false": True, "2": False,
             "yes": True, "": True, " 1": False, "-1": False, "01": False}
    for value, on in cases.items():
        env = {} if value is None else {"XLA_DISABLE_FUNCTIONALIZATION": value}
        assert functionalization_on(env) is on, value


def test_bad_arguments_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="functionalization must be True, False or None"):
        tu.run(print, cores=1, functionalization="off")
    with pytest.raises(ValueError, match="steps must be an integer > 2"):
        tu.check_functionalization(print, steps=2)


def test_the_switch_and_the_check(run_script):
    proc = run_script("""
        import json, os
        import torch, torch.nn as nn, torch.nn.functional as F
        import tpu_utility as tu

        def functional():
            return torch._is_functional_tensor(torch.ones(2, device=tu.get_device()))

        def data():
            g = torch.Generator().manual_seed(0)
            return torch.utils.data.TensorDataset(torch.randn(1024, 16, generator=g),
                                                  torch.randint(0, 4, (1024,), generator=g))

        def cnn_adam():
            # BatchNorm and dropout (in-place buffer updates, random masks), Adam, through
            # train_one_cycle: the library's own step path.
            torch.manual_seed(0)
            model = nn.Sequential(nn.Unflatten(1, (1, 4, 4)), nn.Conv2d(1, 8, 3, padding=1),
                                  nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.2), nn.Flatten(),
                                  nn.Linear(128, 4)).to(tu.get_device())
            opt = torch.optim.Adam(model.parameters())
            loader = tu.make_loader(data(), 32, num_workers=0)
            tu.train_one_cycle(model, loader, opt, F.cross_entropy, 2, max_lr=1e-3, progress=False)

        def again():
            # Without functionalization torch_xla orders a graph's outputs by tensor age: a
            # second call on the same optimizer, and the next fold's fresh model and optimizer,
            # must reuse the graphs compiled by the first call.
            from tpu_utility.compat import xla_counts
            out = []
            for fold in range(2):
                torch.manual_seed(fold)
                model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(tu.get_device())
                opt = torch.optim.Adam(model.parameters())
                loader = tu.make_loader(data(), 32, num_workers=0)
                for call in range(2):
                    before = xla_counts()["compiles"]
                    tu.train_one_cycle(model, loader, opt, F.cross_entropy, 1, max_lr=1e-3,
                                       progress=False)
                    out.append(xla_counts()["compiles"] - before)
            return out

        def steps(fn, n=8):
            # a hand-written loop on make_loader: fn(model, x) is the loss
            torch.manual_seed(0)
            model = nn.Linear(16, 6).to(tu.get_device())
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for i, (x, y) in enumerate(tu.make_loader(data(), 32, num_workers=0)):
                if i == n:
                    break
                fn(model, x).backward()
                tu.optimizer_step(opt)
                opt.zero_grad()

        def differs():
            # a model whose code reads whether its tensors are functional: the check must see it
            def loss(model, x):
                out = model(x).sum()
                return out if torch._is_functional_tensor(out) else out * (1 + 2 ** -20)
            steps(loss)

        def fails():
            def loss(model, x):  # affine_grid refuses to trace without functionalization
                theta = model(x)[:, :6].reshape(-1, 2, 3)
                return F.affine_grid(theta, (x.shape[0], 1, 4, 4), align_corners=False).sum()
            steps(loss)

        def by_hand():
            # opt.step() in place of tu.optimizer_step: the check sees no step to compare
            torch.manual_seed(0)
            model = nn.Linear(16, 6).to(tu.get_device())
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for x, y in tu.make_loader(data(), 256, num_workers=0):
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()

        if __name__ == "__main__":
            out = {"default": tu.run(functional, cores=1, start_method="fork"),
                   "off": tu.run(functional, cores=1, start_method="fork", functionalization=False)}
            os.environ["XLA_DISABLE_FUNCTIONALIZATION"] = "1"  # None: as the environment says
            out["env off"] = tu.run(functional, cores=1, start_method="fork")
            out["env off, True"] = tu.run(functional, cores=1, start_method="fork",
                                          functionalization=True)
            del os.environ["XLA_DISABLE_FUNCTIONALIZATION"]
            out["spmd off"] = tu.run(functional, cores=8, start_method="fork",
                                     functionalization=False)
            for cores in (1, 8):
                out[f"again {cores}"] = tu.run(again, cores=cores, start_method="fork",
                                               functionalization=False)
            for name, fn, cores in (("cnn", cnn_adam, 1), ("cnn8", cnn_adam, 8),
                                    ("differs", differs, 1), ("fails", fails, 1)):
                r = tu.check_functionalization(fn, cores=cores, steps=6, start_method="fork")
                out[name] = {"equal": r.equal, "steps": r.steps, "tensors": r.tensors,
                             "differing": list(r.differing), "error": r.error,
                             "host_ms": list(r.host_ms), "text": str(r)}
            try:
                out["by hand"] = tu.check_functionalization(by_hand, steps=6, start_method="fork")
            except ValueError as e:
                out["by hand"] = str(e)
            # This process now starts the XLA runtime: no fresh processes can follow.
            torch.ones(1).to(tu.get_device()).cpu()
            for name, call in (("check here", lambda: tu.check_functionalization(functional)),
                               ("run here", lambda: tu.run(functional, cores=1,
                                                           functionalization=False))):
                try:
                    out[name] = call()
                except RuntimeError as e:
                    out[name] = str(e)
            out["run here, as it is"] = tu.run(functional, cores=1, functionalization=True)
            print("RESULT " + json.dumps(out))
    """, timeout=400)
    r = proc.result
    assert r["default"] is True and r["off"] is False and r["spmd off"] is False
    assert r["env off"] is False and r["env off, True"] is True
    for cores in (1, 8):  # compiles per call: fold 1 twice, fold 2 twice
        first, *rest = r[f"again {cores}"]
        assert first > 0 and rest == [0, 0, 0], r[f"again {cores}"]
    for name in ("cnn", "cnn8"):
        c = r[name]
        assert c["equal"] and c["steps"] == 6 and c["tensors"] == 6 and c["error"] is None, c
        assert all(ms is not None and ms > 0 for ms in c["host_ms"]), c
        assert c["text"].startswith("All 6 parameter tensors are bit-equal after 6 steps"), c
    d = r["differs"]
    assert not d["equal"] and d["error"] is None and d["steps"] == 6, d
    assert d["differing"][0].startswith("parameter 0 [6, 16]: "), d
    assert "keep it on" in d["text"], d
    f = r["fails"]
    assert not f["equal"] and f["differing"] == [], f
    assert "XLA_DISABLE_FUNCTIONALIZATION" in f["error"] and "F.affine_grid(theta" in f["error"], f
    assert f["text"].startswith("Without functionalization this train_fn fails"), f
    # Stepped with opt.step(): refused, not "all 0 tensors bit-equal after 0 steps" (3d4ad59)
    assert isinstance(r["by hand"], str) and "took no step through tu.optimizer_step" in r["by hand"] \
        and "in place of opt.step()" in r["by hand"], r["by hand"]
    # After the caller used the device, both refuse before running anything.
    assert "already started the XLA runtime" in r["check here"], r
    assert r["run here"].startswith("run(functionalization=False) starts fresh processes"), r
    assert r["run here, as it is"] is True  # the process's own setting: it runs here
