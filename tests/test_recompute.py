"""Gradient checkpointing on XLA (issue 46): Hugging Face's gradient_checkpointing_enable()
and torch.utils.checkpoint in a user's own model run inside `run`, give the results of the
run without it (dropout included, over several steps), and the compiled program's peak
falls (XLA's buffer assignment, as torch_xla reports it after each compile)."""
import pytest
import torch


def test_checkpointing_equals_the_run_without_it_and_the_compiled_peak_falls(run_script):
    pytest.importorskip("transformers")
    # HF's at 1 core (transformers 4.x checkpoints with use_reentrant=True, 5.x with False:
    # each stack runs its own default; two layers: with one, recomputing it costs as much as
    # it saves at this size); at 8 SPMD devices a user's own blocks through
    # torch.utils.checkpoint, one block each way. (HF's at 8 devices: test_fsdp.py.)
    r = run_script("""
        import functools, json, torch
        import tpu_utility as tu, big_fns
        from reference import max_param_diff

        def compare(plain, ckpt):
            return {"losses": [plain["losses"], ckpt["losses"]], "peaks": [plain["peak"], ckpt["peak"]],
                    "diff": max_param_diff(plain["state"], ckpt["state"])}

        def frozen_input():
            # the embedding frozen: a reentrant block's input takes no gradient, so its
            # parameters would get none (torch only warns): refused before any step
            model = big_fns.Blocks(True).to(tu.get_device())
            model.embed.weight.requires_grad_(False)
            ids = torch.zeros(2, big_fns.SEQ, dtype=torch.long, device=tu.get_device())
            try:
                model(ids, torch.zeros(2, dtype=torch.long, device=tu.get_device()))
            except RuntimeError as e:
                return str(e)

        if __name__ == "__main__":
            go = lambda cores, **kw: tu.run(functools.partial(big_fns.train, **kw), cores=cores, start_method="fork")
            refused = tu.run(frozen_input, cores=1, start_method="fork")
            out = {"hf": compare(go(1, layers=2), go(1, checkpointing="hf", layers=2)),
                   "blocks": compare(go(8, model="blocks"), go(8, model="blocks", checkpointing="both"))}
            print("RESULT", json.dumps({**out, "refused": refused}))
    """, timeout=400).result
    refused = r.pop("refused")
    assert refused and "use_reentrant=False" in refused and "enable_input_require_grads" in refused, refused
    for name, c in r.items():
        plain, ckpt = c["losses"]
        assert len(plain) == 3 and max(abs(a - b) for a, b in zip(plain, ckpt)) < 1e-5, (name, c)
        assert c["diff"] < 1e-5, (name, c)
    hf = r["hf"]["peaks"]
    assert hf[1] < hf[0], r  # the activations are recomputed, not kept


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_off_xla_is_torchs_own_after_install(reentrant):
    from torch.utils.checkpoint import checkpoint

    def grads():
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 4))
        x = torch.randn(3, 4, requires_grad=True)
        checkpoint(block, x, use_reentrant=reentrant).sum().backward()
        return [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]

    before = grads()
    from tpu_utility import recompute
    recompute.install()
    after = grads()
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_install_from_replica_threads_at_once(run_script):
    # The "launch" engine's replicas are threads of one process (one per device) that ask
    # for the device at once; each installs. Unlocked, all but one could fail with torch's
    # "The runtime module of 'xla' has already been registered" (seen once in CI). The race
    # is narrow: threads switch every microsecond here, over 10 fresh starts (torch.xla
    # unregistered and install's flag cleared before each).
    out = run_script("""
        import json, sys, threading, torch
        from tpu_utility import recompute
        sys.setswitchinterval(1e-6)
        errors = []

        def install(start):
            start.wait()
            try:
                recompute.install()
            except Exception as e:
                errors.append(repr(e))

        for attempt in range(10):
            if hasattr(torch, "xla"):
                delattr(torch, "xla")
                sys.modules.pop("torch.xla", None)
            recompute._INSTALLED = False
            start = threading.Barrier(8)
            threads = [threading.Thread(target=install, args=(start,)) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        print("RESULT", json.dumps({"errors": errors[:3], "module": hasattr(torch, "xla")}))
    """).result
    assert out == {"errors": [], "module": True}, out
