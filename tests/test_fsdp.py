"""tu.fsdp (issue 46): parameters, gradients and optimizer state split over the 8 SPMD
devices with torch_xla's sharding; training equals the unsplit run; a whole state dict
saved; the memory per device measured, and a run too big for the device refused before
its first step. (Resume from a split run: test_checkpoint.py; train_one_cycle, predict and
lr_find: test_hf.py.)"""
import pytest

pytest.importorskip("transformers")


def test_fsdp_splits_each_large_weight_equals_the_unsplit_run_and_fits_where_it_did_not(run_script, tmp_path):
    # TPU_UTILITY_DEVICE_MEMORY=2M for the later runs: the unsplit BERT needs 3.3 MB a device
    # for weights, gradients and AdamW's state, so it is refused before its first step;
    # split, 1.0 MB. The compiled step's peak (activations and all) is more: report() says so.
    saved = str(tmp_path / "split.pt")
    r = run_script(f"""
        import functools, json, os, torch
        import tpu_utility as tu, big_fns
        from reference import max_param_diff

        def refused():
            try:
                tu.fsdp(torch.nn.Linear(256, 256).to(tu.get_device()))
            except RuntimeError as e:
                return str(e)

        if __name__ == "__main__":
            go = lambda **kw: tu.run(functools.partial(big_fns.train, steps=6, **kw), cores=8, start_method="fork")
            plain = go()
            amp = go(bf16=True)
            ckpt = go(checkpointing="hf")  # HF's gradient checkpointing at 8 devices (issue 46, 1)
            os.environ["TPU_UTILITY_DEVICE_MEMORY"] = "2M"
            try:
                go()
                too_big = None
            except MemoryError as e:
                too_big = str(e)
            split = go(split=True, save={saved!r})
            both = go(split=True, checkpointing="hf", bf16=True)  # with checkpointing, under bf16
            model = big_fns.bert()
            model.load_state_dict(torch.load({saved!r}, weights_only=True))
            print("RESULT", json.dumps({{
                "losses": [plain["losses"], split["losses"], ckpt["losses"]],
                "amp": [amp["losses"], both["losses"]], "peaks": [plain["peak"], ckpt["peak"]],
                "diff_ckpt": max_param_diff(plain["state"], ckpt["state"]),
                "diff": max_param_diff(plain["state"], split["state"]),
                "diff_amp": max_param_diff(amp["state"], both["state"]),
                "loaded": max_param_diff(split["state"], model.state_dict()),
                "split": split["split"], "numel": split["numel"], "state_split": split["state_split"],
                "memory": [plain["memory"], split["memory"]], "report": split["report"],
                "too_big": too_big, "fused": [plain["fused_took_it"], split["fused_took_it"]],
                "one_core": tu.run(refused, cores=1, start_method="fork")}}))
    """, timeout=400).result
    big = [n for n, k in r["numel"].items() if k >= 32768]
    assert len(big) == 5, r["numel"]  # the word embeddings and 2 x 2 feed-forward weights
    assert all(r["split"][n] for n in big), r["split"]
    assert sum(r["state_split"]) == 2 * len(big), r  # AdamW's two moments of each
    plain, split, ckpt = r["losses"]
    assert len(plain) == 6 and max(abs(a - b) for a, b in zip(plain, split)) < 1e-4, r
    assert r["diff"] < 1e-4, r
    # HF's gradient checkpointing (transformers 4.x: reentrant, 5.x: not), dropout 0.1:
    # the run without it, and the compiled step's peak falls (test_recompute.py: 1 device).
    assert max(abs(a - b) for a, b in zip(plain, ckpt)) < 1e-5 and r["diff_ckpt"] < 1e-5, r
    assert r["peaks"][1] < r["peaks"][0], r
    # Split and checkpointed, under bf16 autocast, against the plain run under it: bf16 sums
    # taken in another order; Adam moves a weight by up to lr (1e-3) a step whatever the
    # size of its gradient, so the weights agree less closely than the losses.
    assert max(abs(a - b) for a, b in zip(*r["amp"])) < 1e-4 and r["diff_amp"] < 6e-3, r
    assert r["loaded"] == 0.0, r  # the saved state dict: whole tensors, into a plain CPU model
    # The fused step (issue 39) takes the unsplit step, and steps aside for split tensors.
    assert r["fused"] == [True, False], r
    # Per device: each split weight counts its eighth; the other weights stay whole.
    whole, eighths = r["memory"]
    numel = sum(r["numel"].values())
    small = numel - sum(r["numel"][n] for n in big)
    assert whole["parameters"] == 4 * numel and whole["optimizer"] == 8 * numel, r
    assert eighths["parameters"] == 4 * (small + sum(r["numel"][n] for n in big) // 8), r
    assert eighths["gradients"] == eighths["parameters"] and eighths["optimizer"] == 2 * eighths["parameters"]
    # Refused before its first step, naming the fix; split, the same run trains and reports.
    assert r["too_big"] and "3.29 MB per device" in r["too_big"] and "tu.fsdp(model)" in r["too_big"], r
    assert ("memory per device: parameters 248.07 kB, gradients 248.07 kB, optimizer state "
            "496.14 kB; the compiled step's peak") in r["report"], r
    assert "(of 2.10 MB)" in r["report"] and "hint: the compiled step needs" in r["report"], r
    assert "SPMD" in r["one_core"] and "cores=" in r["one_core"], r
