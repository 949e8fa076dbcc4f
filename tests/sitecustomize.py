"""Run at start-up by every Python process the tests start (tests/ is on their PYTHONPATH):
scripts, spawned replicas, the demo, the doctests, the notebook kernel.

A DeprecationWarning raised by tpu_utility's own code, or by a deprecated torch_xla call
that tpu_utility makes (torch_xla's `@deprecated` points the warning at its caller), is
an error. torch_xla's, torch's and jupyter's warnings about their own internals are not:
they are theirs to fix, and 2.8's killed MpDeviceLoader's thread when they were errors.
"""
import warnings

warnings.filterwarnings("error", category=DeprecationWarning, module=r"tpu_utility(\.|$)")
