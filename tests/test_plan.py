"""Planning a run for a TPU with the TPU's own compiler, on this CPU host (issue 59):
`tu.plan(train_fn, target=...)` and `TPU_UTILITY_TARGET`.

The compile tests need jax and libtpu (the development stack's extra): they are dev_stack.
The figures are checked against a hand count of the step and against torch_xla's own
compile (the buffers it donates), not against the planning code's own arithmetic.
"""
import importlib.util

import pytest

from plan_fns import HIDDEN, IN, OUT

jax_tests = pytest.mark.dev_stack  # the Kaggle and Colab images' stacks have no jax here


def _plan_script(call: str) -> str:
    return f"""
        import dataclasses, functools, json, os
        import tpu_utility as tu, plan_fns

        if __name__ == "__main__":
            plan = {call}
            print(plan)
            print("RESULT " + json.dumps({{"steps": [dataclasses.asdict(s) for s in plan.steps],
                                          "fits": plan.fits, "notes": list(plan.notes),
                                          "fix": plan.fix.config if plan.fix else None}}))
    """


@jax_tests
def test_a_step_planned_for_a_v5e_8_has_the_figures_a_hand_count_gives(run_script, tmp_path):
    log = tmp_path / "read.json"
    r = run_script(_plan_script(f"tu.plan(functools.partial(plan_fns.mlp, rows_per_core=128, "
                                f"log={str(log)!r}), target='v5e-8')"), timeout=300)
    step, = r.result["steps"]
    assert r.result["fits"] and step["config"] == "as written" and step["error"] is None
    params = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT  # replicated: whole on every chip
    assert (step["parameters"], step["gradients"], step["optimizer"]) == (4 * params, 4 * params, 8 * params)
    assert step["rows"] == 128 * 8  # make_loader's global batch, split over the 8 chips
    # The compiler's arguments: weights, AdamW's two moments and this chip's 128 rows (and
    # a few scalars: lr, betas, the step count).
    batch = 128 * IN * 4 + 128 * 8
    assert 12 * params + batch <= step["argument"] <= (12 * params + batch) * 1.001
    assert step["alias"] >= 12 * params  # the donated weights and moments are updated in place
    # Matmul FLOPs per chip: forward, weight gradients, the hidden layer's input gradient.
    r_ = 128
    matmuls = 2 * r_ * (IN * HIDDEN + HIDDEN * OUT) * 2 + 2 * r_ * HIDDEN * OUT
    assert matmuls <= step["flops"] <= 1.2 * matmuls
    # Nothing of the first step ran here: the loop's own loss.item() after it read the
    # zeros it was settled to, and the loop never reached a third step.
    import json
    assert json.loads(log.read_text()) == [0.0]
    assert "tpu_utility plan for TPU v5e-8 (8 chips, 16 GiB HBM each)" in r.stdout
    assert "at most" in r.stdout and "samples/s" in r.stdout


@jax_tests
def test_a_loop_of_two_optimizers_plans_one_whole_iteration(run_script):
    r = run_script(_plan_script("tu.plan(plan_fns.two_models, target='v5e-8')"), timeout=300)
    step, = r.result["steps"]
    rows = 128  # a chip's
    # both models' forward, weight gradients and hidden input gradients, by hand
    matmuls = sum(2 * rows * (IN * h + h * OUT) * 2 + 2 * rows * h * OUT for h in (HIDDEN, HIDDEN // 2))
    assert matmuls <= step["flops"] <= 1.2 * matmuls


@jax_tests
def test_too_big_is_refused_in_the_compilers_words_and_the_fix_is_compiled(run_script):
    # A chip capped at 20 MiB (TPU_UTILITY_DEVICE_MEMORY, as a user leaves headroom): the
    # replicated MLP's 34 MB of weights, gradients and moments do not fit; split 8 ways, they do.
    r = run_script(_plan_script("tu.plan(functools.partial(plan_fns.mlp, rows_per_core=16), "
                                "target='v5e-8')"), timeout=300, TPU_UTILITY_DEVICE_MEMORY="20M")
    written, split = r.result["steps"]
    assert "RESOURCE_EXHAUSTED" in written["error"] and "HBM" in written["error"]
    assert split["config"] == "+ tu.fsdp(model)" and split["error"] is None
    assert r.result["fix"] == "+ tu.fsdp(model)" and not r.result["fits"]
    assert split["parameters"] * 8 == pytest.approx(written["parameters"], rel=0.01)
    assert "the compiler: RESOURCE_EXHAUSTED: Ran out of memory" in r.stdout
    assert "fix: tu.fsdp(model)" in r.stdout


@jax_tests
def test_a_single_chip_with_no_fix_left_says_so(run_script):
    r = run_script(_plan_script("tu.plan(functools.partial(plan_fns.mlp, rows_per_core=16), "
                                "target='v5e-1', cores=1)"), timeout=300, TPU_UTILITY_DEVICE_MEMORY="20M")
    written, = r.result["steps"]
    assert "RESOURCE_EXHAUSTED" in written["error"] and r.result["fix"] is None
    assert "no fix tried fits" in r.stdout


@jax_tests
def test_fsdp_cuts_the_compiled_peak_per_chip_several_times(run_script):
    r = run_script("""
        import functools, json
        import tpu_utility as tu, plan_fns

        if __name__ == "__main__":
            peaks = [tu.plan(functools.partial(plan_fns.mlp, rows_per_core=16, split=split),
                             target="v5e-8").steps[0].peak for split in (False, True)]
            print("RESULT " + json.dumps(peaks))
    """, timeout=300)
    plain, split = r.result
    assert split * 3 < plain


@jax_tests
def test_checkpointing_is_tried_as_a_fix_and_bf16_weights_lower_the_peak_of_a_long_sequence(run_script):
    # 6 layers of 1024 tokens, 8 rows, a chip capped at 700 MiB: the activations are most of
    # the step (866 MB of temporaries), and recomputing them in the backward fits (at 2
    # layers or 512 tokens the TPU compiler's own scheduling leaves checkpointing little to
    # save). The model is not split: one chip, so tu.fsdp is no fix here. With
    # tu.bf16_weights the activations are bfloat16: the same step, as written, fits
    # (XLA:CPU, which computes bfloat16 in float32, could not show it).
    r = run_script("""
        import dataclasses, functools, json
        import tpu_utility as tu, plan_fns

        if __name__ == "__main__":
            plans = [tu.plan(functools.partial(plan_fns.bert, seq=1024, rows=8, layers=6, bf16=bf16),
                             target="v6e-1", cores=1) for bf16 in (False, True)]
            print(plans[0])
            print("RESULT " + json.dumps([[dataclasses.asdict(s) for s in p.steps] for p in plans]
                                         + [plans[0].fix.config if plans[0].fix else None]))
    """, timeout=600, TPU_UTILITY_DEVICE_MEMORY="700M")
    (written, checkpointed), (bf16,), fix = r.result
    assert "RESOURCE_EXHAUSTED" in written["error"]
    assert checkpointed["config"] == "+ model.gradient_checkpointing_enable()"
    assert checkpointed["error"] is None and checkpointed["peak"] < 700 * 2 ** 20
    assert fix == checkpointed["config"]
    assert "fix: model.gradient_checkpointing_enable()" in r.stdout
    assert bf16["config"] == "as written" and bf16["error"] is None and bf16["peak"] < 700 * 2 ** 20
    assert written["rows"] == bf16["rows"] == 8  # the batch, told from the bfloat16 weights too


@jax_tests
def test_a_model_bigger_than_the_host_plans_without_holding_its_weights(run_script):
    # 537M parameters made on the device: weights, gradients and AdamW moments are 8.6 GB,
    # which the plan's two steps settled as zeros held in this host's memory (the code
    # before placeholders was killed for host memory here, at 23.8 GB). Placeholders hold
    # no buffer: the process stays near torch's own size.
    r = run_script("""
        import json, resource
        import tpu_utility as tu, plan_fns

        if __name__ == "__main__":
            plan = tu.plan(plan_fns.wide_on_device, target="v5e-8")
            rss = max(resource.getrusage(w).ru_maxrss
                      for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) * 1024
            s = plan.steps[0]
            print("RESULT " + json.dumps({"rss": rss, **{k: getattr(s, k) for k in (
                "parameters", "gradients", "optimizer", "peak", "argument", "output", "alias",
                "rows", "error")}}))
    """, timeout=600)
    width = 16384
    weights = 2 * (width * width + width) * 4  # by hand: two layers, float32, whole on each chip
    out = r.result
    assert out["error"] is None
    assert (out["parameters"], out["gradients"], out["optimizer"]) == (weights, weights, 2 * weights)
    assert out["argument"] >= 3 * weights  # the weights and both moments come in
    # and a layer's gradient at least is made (the compiler updates the second layer
    # before it makes the first's gradient, so both need not be alive at once)
    assert out["peak"] >= 3.5 * weights
    # The run's cut comes after the loop's zero_grad(): the gradients are not outputs, and
    # every output (weights, moments, the loss) updates an input's buffer in place.
    assert out["output"] - out["alias"] < 2 ** 20
    assert out["rows"] == 8 * 8  # the global batch, not a weight's leading size
    assert out["rss"] < 3 * 2 ** 30  # of the 8.6 GB the state would take


@jax_tests
def test_a_script_run_with_TPU_UTILITY_TARGET_plans_instead_of_training_and_ends(run_script):
    r = run_script("""
        import torch, tpu_utility as tu, plan_fns

        if __name__ == "__main__":
            tu.setup_tpu()
            out = tu.run(plan_fns.mlp, cores=8)
            print("AFTER RUN", out)
    """, timeout=300, TPU_UTILITY_TARGET="v6e-8")
    assert "tpu_utility plan for TPU v6e-8 (8 chips, 32 GiB HBM each)" in r.stdout
    assert "as written: fits" in r.stdout
    assert "planned, not trained (TPU_UTILITY_TARGET=v6e-8)" in r.stdout
    assert "AFTER RUN" not in r.stdout and r.returncode == 0


@jax_tests
def test_the_private_jax_calls_are_where_this_jax_has_them():
    from tpu_utility import tpu_compile
    assert tpu_compile.available() is None
    tpu_compile.check_api()


def test_a_target_or_core_count_named_wrong_is_refused_naming_the_choices(run_script):
    r = run_script("""
        import json, os, tpu_utility as tu

        def f():
            return 1

        def error(call):
            try:
                call()
            except ValueError as e:
                return str(e)

        if __name__ == "__main__":
            out = [error(lambda: tu.plan(f, target="v5e-9")),
                   error(lambda: tu.plan(f, target="v5e-8", cores=4))]
            os.environ["TPU_UTILITY_TARGET"] = "v7x"
            out.append(error(lambda: tu.run(f, cores=8)))
            print("RESULT " + json.dumps(out))
    """)
    wrong, cores, env = r.result
    assert "target='v5e-9'" in wrong and "v5e-8" in wrong and "v6e-1" in wrong
    assert "cores=4" in cores and "cores=1 or cores=8" in cores
    assert "TPU_UTILITY_TARGET='v7x'" in env


def test_without_jax_planning_says_how_to_install_it(run_script):
    r = run_script("""
        import json, sys
        sys.modules["jax"] = None  # as where jax is not installed
        import tpu_utility as tu

        def f():
            return 1

        if __name__ == "__main__":
            try:
                tu.plan(f, target="v5e-8")
            except RuntimeError as e:
                print("RESULT " + json.dumps(str(e)))
    """)
    assert 'pip install "jax[tpu]==0.10.2"' in r.result and "jax" in r.result


def test_the_buffers_a_plan_donates_are_the_ones_torch_xla_donates(run_script):
    # The reference: torch_xla's own compile of the same step counts the inputs it aliases.
    r = run_script("""
        import json, gc, torch, torch_xla
        import torch_xla.debug.metrics as met
        from tpu_utility import compat

        if __name__ == "__main__":
            dev = torch_xla.device()
            model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(dev)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            counts = []
            for step in range(3):
                loss = model(torch.randn(8, 16).to(dev)).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                live = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.device.type == "xla"]
                text, donors, inputs = compat.pending_program(compat.pending(live))
                torch_xla.sync()
                counts.append([len(donors), met.metric_data("InputOutputAliasCount")[2][-1][1]])
            print("RESULT " + json.dumps(counts))
    """)
    for ours, torch_xlas in r.result:
        assert ours == torch_xlas
    assert r.result[-1][0] == 3 * 4  # steady state: 4 weights and their 2 AdamW moments each


def test_on_a_tpu_the_compilers_refusal_for_hbm_names_the_fixes_and_the_plan(run_script):
    # On a TPU host the step's first compile is the TPU compiler's own, and it refuses a step
    # that does not fit before the step runs; torch_xla raises its words (as pytorch/xla
    # issues quote them). No TPU here: the replica's error carries those words. A refusal
    # for VMEM (a kernel's scratch memory) is not the model's size, and stays as it was.
    r = run_script("""
        import json
        import tpu_utility as tu

        HBM = ("Bad StatusOr access: RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran "
               "out of memory in memory space hbm. Used 21.95G of 15.48G hbm. Exceeded hbm "
               "capacity by 6.47G.\\n\\nTotal hbm usage >= 22.47G:")
        VMEM = "Bad StatusOr access: RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space vmem."

        def step(words):
            raise RuntimeError(words)

        if __name__ == "__main__":
            seen = []
            for words, cores in ((HBM, 1), (HBM, 8), (VMEM, 1)):
                try:
                    tu.run(step, cores=cores, args=(words,))
                except Exception as e:
                    seen.append([type(e).__name__, str(e)])
            print("RESULT " + json.dumps(seen))
    """, timeout=300)
    (one, one_text), (eight, eight_text), (vmem, vmem_text) = r.result
    assert one == eight == "MemoryError"
    for text in (one_text, eight_text):
        assert "the TPU's compiler refused the step before it ran" in text
        assert "Used 21.95G of 15.48G hbm. Exceeded hbm capacity by 6.47G." in text
        assert "Total hbm usage" not in text  # one sentence, not the compiler's whole report
        assert "tu.fsdp(model)" in text and "TPU_UTILITY_TARGET=" in text
    assert vmem == "RuntimeError" and "memory space vmem" in vmem_text
