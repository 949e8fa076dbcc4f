"""Issue 60 §5, Hugging Face Accelerate scripts (transformers' `run_glue_no_trainer.py`,
`run_clm_no_trainer.py`, accelerate's `nlp_example.py`), each in a shape of our own:

- `DistributedType.TPU`, which accelerate 1.x no longer has, becomes `DistributedType.XLA`;
- an accelerator made either way (`Accelerator(log_with=...) if ... else Accelerator()`)
  is an accelerator: its uses are mapped, or it stays with one note at its line saying
  what that means on XLA and naming the first use port cannot map;
- a training loop over `active_dataloader`, the loader under another name, is fed by a
  loader: no "reads no DataLoader" note, no tu.sync();
- tu's read watch (reads.py: a TorchFunctionMode over each replica's second step) ran a
  script's wrapper of `Tensor.backward` twice in that step: one backward more than
  batches, the second loss twice. A port of tests/port_corpus/hf_accelerate_alias.py runs at
  8 SPMD devices with its backwards counted by such a wrapper, against its CPU original
  (run with a stand-in for the accelerate package, which the test stacks lack).
"""
import ast
import json
import sys
import textwrap

import pytest
import torch

from conftest import ROOT, run_process, run_python, script_env

CORPUS = ROOT / "tests" / "port_corpus"


def _port(source, script=False):
    from tpu_utility.port import port_source
    return port_source(textwrap.dedent(source), script=script)


def test_distributed_type_tpu_becomes_xla_where_the_script_uses_accelerate():
    result = _port('''\
        from accelerate import Accelerator, DistributedType


        def main(model):
            accelerator = Accelerator(gradient_accumulation_steps=2)
            if accelerator.distributed_type == DistributedType.TPU:
                model.tie_weights()
            return accelerate.utils.DistributedType.TPU
        ''')
    assert "accelerator.distributed_type == DistributedType.XLA:" in result.text
    assert "accelerate.utils.DistributedType.XLA" in result.text and ".TPU" not in result.text
    assert "accelerate.distributed-type" in {rule for _, rule in result.swap_rules}
    # a DistributedType of another library is left alone
    other = _port("from mylib import DistributedType\nx = DistributedType.TPU\n")
    assert "DistributedType.TPU" in other.text


def test_an_accelerator_made_either_way_is_mapped_and_goes():
    text = (CORPUS / "hf_accelerate_alias.py").read_text()
    result = _port(text, script=True)
    assert [rule for _, rule in result.note_rules] == ["accelerate.call"], result.todo  # gather's
    names = {n.id for n in ast.walk(ast.parse(result.text)) if isinstance(n, ast.Name)}
    assert "accelerator" not in names and "from accelerate" not in result.text, result.text
    assert "with contextlib.nullcontext():" in result.text and "import contextlib" in result.text
    assert 'if "no" != "no":' in result.text
    # the loop over the alias is fed by make_loader: no tu.sync() of a loop without one
    assert "tu.sync()" not in result.text and "active_dataloader = train_dataloader" in result.text


def test_a_kept_accelerator_has_one_note_at_its_line_naming_the_first_use_port_cannot_map():
    result = _port('''\
        def main(args, model, optimizer, train_dataloader):
            accelerator = (
                Accelerator(log_with=args.report_to) if args.with_tracking else Accelerator()
            )
            model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
            for epoch in range(3):
                if args.resume_step is not None and epoch == 0:
                    active_dataloader = accelerator.skip_first_batches(train_dataloader, args.resume_step)
                else:
                    active_dataloader = train_dataloader
                for step, batch in enumerate(active_dataloader):
                    accelerator.backward(model(**batch).loss)
                    optimizer.step()
                    optimizer.zero_grad()
                accelerator.save_state(f"epoch_{epoch}")
        ''')
    [(line, note)] = [n for n, (_, rule) in zip(result.todo, result.note_rules)
                      if rule.startswith("accelerate.")]
    assert line == 2 and note.startswith("`accelerator` stays"), result.todo
    assert "`accelerator.skip_first_batches(train_dataloader, args.resume_step)` (original line 8) " \
           "nor 1 other use" in note
    assert "stepped by torch_xla" in note and "engine='launch'" in note
    assert "accelerator.prepare(" in result.text and "tu.sync()" not in result.text
    # a setting that tu.run would drop keeps the accelerator too
    kept = _port("def main():\n    accelerator = Accelerator(mixed_precision='bf16')\n"
                 "    accelerator.print(accelerator.mixed_precision)\n")
    assert "Accelerator(mixed_precision='bf16')" in kept.text and "`mixed_precision='bf16'`" in kept.todo[0][1]


def test_the_read_watch_runs_a_wrapper_of_backward_once():
    from tpu_utility.reads import ReadWatch
    calls, original = [], torch.Tensor.backward

    def counted(self, *args, **kwargs):
        calls.append(float(self.detach()))
        return original(self, *args, **kwargs)

    torch.Tensor.backward = counted
    try:
        watch = ReadWatch()
        watch.after_step()  # the watched step begins
        assert watch.watching
        x = torch.ones(3, requires_grad=True)
        (x * 2).sum().backward()
        y = torch.ones(3, requires_grad=True)
        (y * 3).sum().backward(torch.tensor(2.0), retain_graph=True)
        watch.close()
    finally:
        torch.Tensor.backward = original
    assert calls == [6.0, 9.0]
    assert x.grad.tolist() == [2.0] * 3 and y.grad.tolist() == [6.0] * 3


# A stand-in for accelerate on one CPU process, for the original (the test stacks have no
# accelerate): what its Accelerator does there for the uses the script makes.
STANDIN = '''
import contextlib, torch
class Accelerator:
    device = torch.device("cpu")
    mixed_precision = "no"
    def __init__(self, **kwargs): pass
    def prepare(self, *objs): return objs
    def backward(self, loss): loss.backward()
    def main_process_first(self): return contextlib.nullcontext()
    def gather_for_metrics(self, x): return x
    def print(self, *a): print(*a)
'''

# the tester's count: a wrapper on Tensor.backward, printing each loss
DRIVER = '''
import json, os, runpy, sys, torch
jobs = json.loads(sys.argv[1])
count, original = [0], torch.Tensor.backward
def counted(self, *args, **kwargs):
    count[0] += 1
    print(f"BACKWARD {count[0]} {float(self.detach().cpu()):.6f}", flush=True)
    return original(self, *args, **kwargs)
torch.Tensor.backward = counted
for name, path, argv in jobs:
    count[0] = 0
    print(f"=== {name}", flush=True)
    sys.argv = [path] + argv
    runpy.run_path(path, run_name="__main__")
    sys.stdout.flush()
print("=== end", flush=True)
'''


def _by_job(stdout):
    out, job = {}, None
    for line in stdout.splitlines():
        if line.startswith("=== "):
            job = out.setdefault(line[4:], {"losses": [], "steps": None})
        elif job is not None and line.startswith("BACKWARD "):
            job["losses"].append(float(line.split()[2]))
        elif job is not None and line.startswith("STEPS "):
            job["steps"] = int(line.split()[1])
    return out


@pytest.mark.dev_stack  # see conftest.py: the default stack's suite only
def test_the_ported_alias_script_backs_once_a_batch_and_matches_its_cpu_original(tmp_path):
    from tpu_utility.port import port
    src = tmp_path / "hf_accelerate_alias.py"
    src.write_text((CORPUS / "hf_accelerate_alias.py").read_text())
    text = open(port(str(src)).output).read()
    ported = tmp_path / "alias_tpu_8.py"
    ported.write_text(text.replace("cores=8", "cores=8, start_method='fork'"))
    (tmp_path / "driver.py").write_text(DRIVER)
    (tmp_path / "standin" / "accelerate").mkdir(parents=True)
    (tmp_path / "standin" / "accelerate" / "__init__.py").write_text(STANDIN)
    proc = run_python([sys.executable, str(tmp_path / "driver.py"), json.dumps(
        [["alias:8", str(ported), ["--per_device_train_batch_size", "16"]]])],
        cwd=tmp_path, timeout=300, env=script_env())
    assert proc.returncode == 0 and "=== end" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    env = script_env()
    env["PYTHONPATH"] = str(tmp_path / "standin") + ":" + env["PYTHONPATH"]
    cpu = run_process([sys.executable, str(tmp_path / "driver.py"), json.dumps(
        [["alias:cpu", str(src), ["--per_device_train_batch_size", "128"]]])],
        cwd=tmp_path, timeout=120, env=env)
    assert cpu.returncode == 0 and "=== end" in cpu.stdout, cpu.stdout[-3000:] + cpu.stderr[-3000:]
    mine, want = _by_job(proc.stdout)["alias:8"], _by_job(cpu.stdout)["alias:cpu"]
    assert want["steps"] == 8 and len(want["losses"]) == 8, want
    # one backward a batch: the watched second step's loss is not there twice
    assert mine["steps"] == 8 and len(mine["losses"]) == 8, mine
    assert mine["losses"] == pytest.approx(want["losses"], rel=2e-3, abs=2e-4), (mine, want)
