"""torch_xla 2.8 and 2.9 through tpu_utility/compat.py: what the suite treats as an error,
and the per-batch noise that must not reach a run's log."""
import importlib.util

import pytest
from tpu_utility.compat import supports_gpu


def test_own_deprecations_are_errors_torch_xlas_are_not(run_script):
    # tests/sitecustomize.py sets the filter in every process the tests start.
    proc = run_script("""
        import json, logging, types
        import torch_xla.core.xla_model as xm
        code = "import torch_xla.core.xla_model as xm\\ndef call():\\n    return xm.xla_device()\\n"
        out = {}
        for name in ("tpu_utility._probe", "someone_else"):
            module = types.ModuleType(name)
            exec(compile(code, name, "exec"), module.__dict__)
            try:
                module.call()  # deprecated since 2.7: torch_xla.device() replaces it
                out[name] = "ran"
            except DeprecationWarning as e:
                out[name] = "DeprecationWarning: " + str(e)
        try:
            logging.warn("inside torch_xla 2.8, per batch")  # deprecated, attributed to its caller
            out["logging.warn"] = "ran"
        except DeprecationWarning:
            out["logging.warn"] = "error"
        print("RESULT", json.dumps(out))
    """)
    r = proc.result
    assert r["tpu_utility._probe"].startswith("DeprecationWarning") and "torch_xla.device" in r["tpu_utility._probe"]
    assert r["someone_else"] == "ran" and r["logging.warn"] == "ran"


@pytest.mark.skipif(importlib.util.find_spec("jax") is not None,
                    reason="the path without jax: the Kaggle and Colab suites run it (the "
                           "development stack has jax for tu.plan's TPU compile)")
def test_no_import_jax_per_batch_or_per_sharding(run_script):
    proc = run_script("""
        import json, sys, torch, tpu_utility as tu

        class Recorder:  # sees every attempt to import jax, and lets it fail as usual
            tries = 0
            def find_spec(self, name, path=None, target=None):
                if name == "jax":
                    Recorder.tries += 1
                return None

        def probe():
            sys.meta_path.insert(0, Recorder())
            engine = tu.replica.current().engine
            loader = tu.make_loader(torch.utils.data.TensorDataset(torch.arange(64.)), batch_size=8,
                                    num_workers=0)
            for _ in loader:  # the first epoch may look for jax once
                pass
            engine.zeros((3,))
            before = Recorder.tries
            for epoch in range(2):  # then 2 x 8 (1 core) or 2 x 1 (8 cores) batches ...
                for _ in loader:
                    pass
            engine.zeros((3,)), engine.zeros((2,))  # ... and two mark_sharding under SPMD
            after = Recorder.tries
            from torch_xla._internal.jax_workarounds import maybe_get_jax
            maybe_get_jax()  # torch_xla's own probe, untouched: the recorder does see it
            return {"later": after - before, "direct": Recorder.tries - after}

        if __name__ == "__main__":
            print("RESULT", json.dumps({c: tu.run(probe, cores=c, start_method="fork") for c in (1, 8)}))
    """)
    for cores in ("1", "8"):
        assert proc.result[cores] == {"later": 0, "direct": 1}, proc.result


def test_gpu_support_by_version():
    assert supports_gpu("2.8.0") and supports_gpu("2.8.1+cu121")
    assert not supports_gpu("2.9.0") and not supports_gpu(None) and not supports_gpu("unknown")


def test_real_warnings_still_reach_the_log(run_script):
    proc = run_script("""
        import logging, warnings, torch, tpu_utility as tu
        import tpu_train

        def noisy():
            warnings.warn("a real warning from train_fn")
            logging.getLogger("user").error("a real error logged by train_fn")
            return tpu_train.train_fn(epochs=1)

        if __name__ == "__main__":
            tu.run(noisy, cores=8, start_method="fork")  # SPMD on XLA:CPU, XLA's C++ turned down
    """)
    assert "UserWarning: a real warning from train_fn" in proc.stderr
    assert "a real error logged by train_fn" in proc.stderr
    assert len(proc.stderr.splitlines()) <= 4, proc.stderr
