"""The first steps users take with CUDA habits, which CUDA forgives and XLA does not: an
optimizer made before `model.to(device)`, `@autocast()` as a decorator at import,
`scaler.step(opt, closure)`, `torch.cuda.is_available()` (tu.has_accelerator()), and arguments that would train nothing (`clip=0`)."""
import pytest
import torch

import tpu_utility as tu

HABITS_SCRIPT = """
    import json, torch, torch.nn as nn, torch.nn.functional as F, torch_xla
    from torch.utils.data import TensorDataset
    import tpu_utility as tu

    @tu.autocast()  # at import, as `@torch.cuda.amp.autocast()` sits on many a forward
    def forward(model, x):
        return model(x)

    def data():
        g = torch.Generator().manual_seed(0)
        return TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 2, (64,), generator=g))

    def attempt(fn):
        try:
            fn()
            return None
        except ValueError as e:
            return str(e)

    def optimizer_first():
        dev = tu.get_device()
        out = {}

        def stale():  # the CUDA order: optimizer, then the move
            torch.manual_seed(0)
            model = nn.Linear(8, 2)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model.to(dev)
            return model, opt

        def backward(model):
            x, y = data().tensors
            F.cross_entropy(model(x.to(dev)), y.to(dev)).backward()

        model, opt = stale()
        before = {k: v.cpu().clone() for k, v in model.state_dict().items()}
        backward(model)
        out["optimizer_step"] = attempt(lambda: tu.optimizer_step(opt))
        out["unchanged"] = all(torch.equal(before[k], v.cpu()) for k, v in model.state_dict().items())
        model, opt = stale()
        backward(model)
        out["scaler"] = attempt(lambda: tu.GradScaler().step(opt))
        model, opt = stale()
        loader = tu.make_loader(data(), 16)
        out["train_one_cycle"] = attempt(lambda: tu.train_one_cycle(model, loader, opt, F.cross_entropy, 1,
                                                                    progress=False))
        out["lr_find"] = attempt(lambda: tu.lr_find(model, loader, opt, F.cross_entropy, num_it=30))
        torch.manual_seed(0)
        cpu_model = nn.Linear(8, 2)
        params = list(cpu_model.parameters())  # kept from before the move
        cpu_model.to(dev)
        backward(cpu_model)
        out["average_gradients"] = attempt(lambda: tu.average_gradients(params))
        # The right order trains, through the same calls.
        model = nn.Linear(8, 2).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        backward(model)
        tu.optimizer_step(opt)
        tu.average_gradients(model.parameters())
        hist = tu.train_one_cycle(model, loader, opt, F.cross_entropy, 1, progress=False)
        out["right_order"] = len(hist.epochs)
        # scaler.step(opt, closure) hands the closure on, as torch's GradScaler does.
        w = nn.Parameter(torch.ones(2, device=dev))
        lbfgs = torch.optim.LBFGS([w], max_iter=3)
        def closure():
            lbfgs.zero_grad()
            loss = ((w - 3) ** 2).sum()
            loss.backward()
            return loss
        loss = tu.GradScaler().step(lbfgs, closure)
        out["closure_loss"] = float(loss.detach().cpu())
        out["closure_w"] = tu.to_cpu(w).tolist()
        return out

    def decorated():
        torch.manual_seed(0)
        model = nn.Linear(8, 2).to(tu.get_device())
        x = torch.randn(16, 8, device=tu.get_device())
        inside = forward(model, x).dtype
        outside = model(x).dtype
        return {"inside": str(inside), "outside": str(outside), "accelerator": tu.has_accelerator()}

    if __name__ == "__main__":
        accelerator = tu.has_accelerator()  # port's swap for torch.cuda.is_available()
        started = torch_xla._XLAC._xla_runtime_is_initialized()
        out = {"started_at_import": started, "accelerator": accelerator,
               "eight": tu.run(decorated, cores=8, start_method="fork"),
               "habits": tu.run(optimizer_first, cores=1, start_method="fork")}
        print("RESULT", json.dumps(out))
"""


def test_cuda_habits_are_caught_or_work(run_script):
    r = run_script(HABITS_SCRIPT, timeout=240).result
    # @tu.autocast() at import asks for no device, so the 8-core run can start, and the
    # decorated forward runs in bf16 there (and only it).
    assert r["started_at_import"] is False
    # tu.has_accelerator() at the top level: True with torch_xla, and it started nothing
    assert r["accelerator"] is True
    assert r["eight"] == {"inside": "torch.bfloat16", "outside": "torch.float32", "accelerator": True}
    habits = r["habits"]
    for who in ("optimizer_step", "scaler", "train_one_cycle", "lr_find", "average_gradients"):
        message = habits[who]
        assert message is not None, who
        assert "create the optimizer after model.to(device)" in message, (who, message)
        assert "on cpu" in message and "xla" in message, (who, message)
    assert "train_one_cycle:" in habits["train_one_cycle"] and "lr_find:" in habits["lr_find"]
    assert habits["unchanged"]  # refused before the step: nothing was half-done
    assert habits["right_order"] == 1
    # LBFGS through the scaler: the closure's first loss, and w moved to the minimum at 3
    assert habits["closure_loss"] == pytest.approx(8.0)
    assert habits["closure_w"] == pytest.approx([3.0, 3.0], abs=1e-3)


@pytest.mark.parametrize("clip", [0, 0.0, -1.0, float("nan"), float("inf"), True, "1"])
def test_clip_that_would_train_nothing_or_backwards_is_refused(clip):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ds = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    with pytest.raises(ValueError, match=r"clip must be a positive number or None"):
        tu.train_one_cycle(model, ds, opt, torch.nn.functional.cross_entropy, 1, clip=clip)
