"""The AMP swap (tu.autocast, tu.GradScaler) against a hand-written bf16 torch_xla loop, and
tu.gather for users' own evaluation loops, at 1 core, 8 SPMD devices and several replicas."""

COMMON = """
    import json, os, sys, torch, torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    import tpu_utility as tu
    from tpu_utility.compat import xla_counts
    from cuda_train import make_dataset, make_model

    EPOCHS, N, BATCH = 2, 256, 32

    def params(model):
        return {k: v.detach().cpu().tolist() for k, v in model.state_dict().items()}
"""

AMP_SCRIPT = COMMON + """
    def swapped():
        '''The Kaggle AMP loop with its names swapped, nothing restructured.'''
        torch.manual_seed(0)
        model = make_model().to(tu.get_device())
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = tu.GradScaler()
        loader = tu.make_loader(make_dataset(n=N), BATCH, shuffle=False, num_workers=0)
        transfers = []
        for epoch in range(EPOCHS):
            c0 = xla_counts()
            for x, y in loader:
                opt.zero_grad()
                with tu.autocast():
                    loss = F.cross_entropy(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            tu.sync()
            transfers.append(xla_counts()["transfers"] - c0["transfers"])
        with tu.autocast():
            dtype = str(model[0](x).dtype)
        return {"params": params(model), "transfers": transfers, "dtype": dtype}

    def hand_written():
        '''torch_xla's own bf16 loop: torch.autocast("xla"), backward, opt.step, a graph cut per
        step; under SPMD the global batch sharded over the mesh by hand.'''
        import torch_xla
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
        dev = torch_xla.device()
        mesh = xs.get_global_mesh() if xr.is_spmd() else None
        devices = xr.global_runtime_device_count() if mesh is not None else 1
        torch.manual_seed(0)
        model = make_model().to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loader = DataLoader(make_dataset(n=N), batch_size=BATCH * devices, shuffle=False, drop_last=True)
        for epoch in range(EPOCHS):
            for x, y in loader:
                x, y = x.to(dev), y.to(dev)
                if mesh is not None:
                    xs.mark_sharding(x, mesh, ("data", None))
                    xs.mark_sharding(y, mesh, ("data",))
                opt.zero_grad()
                with torch.autocast("xla", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                torch_xla.sync()
        return params(model)

    def both():
        return {"swapped": swapped(), "reference": hand_written()}

    if __name__ == "__main__":
        print("RESULT", json.dumps({cores: tu.run(both, cores=cores, start_method="fork", timeout=300)
                                    for cores in (1, 8)}))
"""


def max_diff(a, b):
    import torch
    return max((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max().item() for k in a)


def test_amp_swap_equals_a_hand_written_bf16_xla_loop(run_script):
    r = run_script(AMP_SCRIPT).result
    for cores in ("1", "8"):
        swapped, reference = r[cores]["swapped"], r[cores]["reference"]
        assert swapped["dtype"] == "torch.bfloat16"  # autocast is on, in bf16
        assert max_diff(swapped["params"], reference) == 0.0, cores
        # No loss scale, no inf check: not one host read in any epoch.
        assert swapped["transfers"] == [0, 0], (cores, swapped["transfers"])


REPLICAS_SCRIPT = COMMON + """
    def loop(amp):
        torch.manual_seed(0)
        model = make_model().to(tu.get_device())
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = tu.GradScaler()
        loader = tu.make_loader(make_dataset(n=N), BATCH, num_workers=0)
        for epoch in range(2):
            for x, y in loader:
                opt.zero_grad()
                with tu.autocast():
                    loss = F.cross_entropy(model(x), y)
                if amp:
                    scaler.scale(loss).backward()
                    scaler.unscale_(opt)  # before clipping, as the AMP recipe has it
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    scaler.step(opt)
                    scaler.update()
                else:
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    tu.optimizer_step(opt)
        return params(model)

    if __name__ == "__main__":
        out = {name: tu.run(loop, cores=2, args=(amp,), engine="distributed", start_method="fork",
                            timeout=300) for name, amp in (("amp", True), ("plain", False))}
        print("RESULT", json.dumps(out))
"""


def test_grad_scaler_step_averages_gradients_over_replicas(run_script):
    # On CPU (gloo) autocast is off and the scaler scales nothing: the AMP loop must train
    # exactly as the optimizer_step loop does, which averages the two replicas' gradients
    # (a scaler.step that only called opt.step would train each replica on its half).
    r = run_script(REPLICAS_SCRIPT).result
    assert max_diff(r["amp"], r["plain"]) == 0.0


GATHER_SCRIPT = """
    import json, torch, tpu_utility as tu
    from torch.utils.data import TensorDataset

    def evaluate():
        ds = TensorDataset(torch.arange(203.))  # 203: no world size divides it
        loader = tu.make_loader(ds, 16, train=False, num_workers=0)
        preds = []
        for (x,) in loader:  # a user's own evaluation loop
            preds.append(x * 2)
        out = tu.gather(torch.cat(preds), loader)
        try:
            tu.gather(torch.cat(preds), tu.make_loader(ds, 16, num_workers=0))
            refused = None
        except ValueError as e:
            refused = str(e)
        return {"rows": out.cpu().tolist(), "refused": refused}

    if __name__ == "__main__":
        out = {f"{engine}{cores}": tu.run(evaluate, cores=cores, engine=engine, start_method="fork",
                                          timeout=300)
               for engine, cores in ((None, 1), (None, 8), ("distributed", 3))}
        print("RESULT", json.dumps(out))
"""


def test_gather_gives_dataset_order_on_every_engine(run_script):
    r = run_script(GATHER_SCRIPT).result
    for name, case in r.items():
        assert case["rows"] == [2.0 * i for i in range(203)], name
        assert "train=False" in case["refused"]
