"""Run at start-up by every Python process the tests start (tests/ is on their PYTHONPATH):
scripts, spawned replicas, the demo, the doctests, the notebook kernel.

A DeprecationWarning raised by tpu_utility's own code, or by a deprecated torch_xla call
that tpu_utility makes (torch_xla's `@deprecated` points the warning at its caller), is
an error. torch_xla's, torch's and jupyter's warnings about their own internals are not:
they are theirs to fix, and 2.8's killed MpDeviceLoader's thread when they were errors.
"""
import faulthandler
import signal
import warnings

# conftest.run_process sends SIGUSR1 to a process group that hangs: every thread's stack to
# stderr, and the process goes on until it is killed.
faulthandler.register(signal.SIGUSR1, all_threads=True)
warnings.filterwarnings("error", category=DeprecationWarning, module=r"tpu_utility(\.|$)")
