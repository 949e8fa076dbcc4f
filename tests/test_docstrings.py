"""Every public function's docstring example runs (in a fresh process: they use XLA)."""
import sys

import tpu_utility
from conftest import ROOT, run_process


def test_public_api_has_docstring_examples():
    for name in tpu_utility.__all__:
        assert ">>>" in (getattr(tpu_utility, name).__doc__ or ""), name


def test_the_public_names_are_sorted_and_every_return_type_is_among_them():
    import inspect
    import typing
    assert tpu_utility.__all__ == sorted(tpu_utility.__all__)
    missing = []
    for name in tpu_utility.__all__:
        obj = getattr(tpu_utility, name)
        if not inspect.isfunction(obj):
            continue
        returned = typing.get_type_hints(obj, None, {"torch": __import__("torch"), **vars(typing)}).get("return")
        for cls in (returned, *typing.get_args(returned)):
            if (inspect.isclass(cls) and cls.__module__.startswith("tpu_utility.")
                    and getattr(tpu_utility, cls.__name__, None) is not cls):
                missing.append(f"{name} -> {cls.__name__}")
    assert missing == [], missing


def test_docstring_examples_run():
    proc = run_process([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "--doctest-modules", "tpu_utility"], cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " passed" in proc.stdout
