"""Issue 48: port never changes what a script means in silence. Each swap inside a condition,
a precision or a device name is checked by running the ported code's own expressions (one
XLA:CPU process for all of them, PJRT_DEVICE=CPU), not only by its text; and port's output
always parses, or port says the fault is its own and names the rule."""
import json
import textwrap

import pytest

from tpu_utility.port import main, port_source


def ported(source: str) -> str:
    return port_source(textwrap.dedent(source)).text


# (name, CUDA source, the names whose values the ported code leaves, what they must be on
# an XLA host: the branch or value the CUDA script means there)
RUN_CASES = [
    ("autocast-disabled", """\
        amp = False
        with torch.cuda.amp.autocast(enabled=amp):
            dtype = str((torch.ones(2, 2, device=tu.get_device()) @ torch.ones(2, 2, device=tu.get_device())).dtype)
        """, "dtype", "torch.float32"),
    ("autocast-enabled", """\
        amp = True
        with torch.autocast("cuda", enabled=amp):
            dtype = str((torch.ones(2, 2, device=tu.get_device()) @ torch.ones(2, 2, device=tu.get_device())).dtype)
        """, "dtype", "torch.bfloat16"),
    ("scaler-disabled", """\
        scaler = torch.cuda.amp.GradScaler(enabled=False)
        t = torch.ones(2)
        state = [scaler.is_enabled(), scaler.scale(t) is t]
        """, "state", [False, True]),
    ("torchrun-rank", """\
        ddp = int(os.environ.get('RANK', -1)) != -1
        """, "ddp", False),
    ("torchrun-world", """\
        multi = int(os.environ.get("WORLD_SIZE", 1)) > 1
        """, "multi", False),
    ("bf16-supported", """\
        dtype = 'bfloat16' if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else 'float16'
        """, "dtype", "bfloat16"),
    ("cuda-available", """\
        where = "gpu" if torch.cuda.is_available() else "cpu"
        """, "where", "gpu"),
    ("string-device", """\
        device = 'cuda'
        device_type = 'cuda' if 'cuda' in device else 'cpu'
        x = torch.ones(2).to(device)
        state = [isinstance(device, str), device_type, x.device.type]
        """, "state", [True, "cpu", "xla"]),
    ("cuda-device-context", """\
        with torch.cuda.device(0):
            y = torch.ones(2, device=tu.get_device()).sum().item()
        """, "y", 2.0),
    ("compile", """\
        model = torch.nn.Linear(2, 1).to(tu.get_device())
        model = torch.compile(model)
        fast = torch.compile(model, mode="max-autotune")
        state = [type(model).__name__, type(fast).__name__]
        """, "state", ["Linear", "Linear"]),
    # a loss in a module without a loader, its labels from the settings' batch size: under
    # SPMD a step's batch holds every core's rows (8 x 4 here), alone it holds 4
    ("batch-size-labels", """\
        class Settings:
            batch_size = 4
        def info_nce_labels(features, args=Settings()):
            return torch.cat([torch.arange(args.batch_size) for i in range(2)], dim=0)
        rows = len(info_nce_labels(None))
        """, "rows", {"8": 64, "top": 8}),
]


def test_the_ported_expressions_mean_on_xla_what_they_meant_on_cuda(run_script):
    # at a script's top level, and inside tu.run at 8 SPMD devices (where tu.world_size()
    # is 8: `WORLD_SIZE > 1` swapped for it would take the torchrun branch)
    cases = {name: (ported(src), var) for name, src, var, _ in RUN_CASES}
    proc = run_script(f"""
        import contextlib, json, os, torch
        import tpu_utility as tu
        os.environ.pop("RANK", None); os.environ.pop("WORLD_SIZE", None)

        def evaluate():
            out = {{}}
            for name, (code, var) in json.loads({json.dumps(json.dumps(cases))}).items():
                space = {{"torch": torch, "tu": tu, "os": os, "contextlib": contextlib}}
                try:
                    exec(code, space)
                    out[name] = space[var]
                except Exception as e:
                    out[name] = f"raised {{type(e).__name__}}: {{e}}"
            return out

        if __name__ == "__main__":
            inside = tu.run(evaluate, cores=8, start_method="fork", timeout=300)
            print("RESULT " + json.dumps({{"8": inside, "top": evaluate()}}))
        """)
    want = {where: {name: want[where] if isinstance(want, dict) else want
                    for name, _, _, want in RUN_CASES} for where in ("8", "top")}
    assert proc.result == want, (proc.result, {n: c for n, (c, _) in cases.items()})


def test_autocast_and_grad_scaler_keep_their_arguments():
    assert ported("""\
        def main(args, amp, model, x):
            scaler = torch.cuda.amp.GradScaler(enabled=amp)
            other = torch.amp.GradScaler("cuda", 1024.0, enabled=False)
            with autocast(enabled=args.fp16_precision):
                y = model(x)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                y = model(x)
        """) == textwrap.dedent("""\
        def main(args, amp, model, x):
            scaler = tu.GradScaler(enabled=amp)
            other = tu.GradScaler(init_scale=1024.0, enabled=False)
            with tu.autocast(enabled=args.fp16_precision):
                y = model(x)
            with tu.autocast(enabled=amp):
                y = model(x)
        """)


def test_an_autocast_dtype_that_may_be_float32_is_listed():
    result = port_source("def main(model, x, ptdtype):\n"
                         "    with torch.amp.autocast(device_type='cuda', dtype=ptdtype):\n"
                         "        y = model(x)\n")
    assert "with tu.autocast():" in result.text
    [(line, note)] = result.todo
    assert line == 2 and "ptdtype" in note and "enabled=False" in note


def test_a_device_read_as_a_string_stays_one_and_is_listed():
    result = port_source("device = 'cuda'\nif device == 'cuda':\n    pass\n")
    assert result.text.startswith("device = str(tu.get_device())\n")
    assert any("stays a string" in note for _, note in result.todo)
    # a config read through globals() keeps its strings: the configurator checks their types
    assert port_source("device = 'cuda'\nkeys = [k for k in globals()]\n").text.startswith(
        "device = str(tu.get_device())")
    assert port_source("def f():\n    device = 'cuda'\n    return device\n").text == \
        "def f():\n    device = tu.get_device()\n    return device\n"


def test_removals_that_empty_a_block_leave_pass_and_the_output_compiles(tmp_path, capsys):
    src = textwrap.dedent("""\
        import torch.nn as nn
        from torch.distributed import init_process_group, destroy_process_group


        def main(FLAGS, net, ema, disc):
            if FLAGS.parallel:
                net = nn.DataParallel(net)
                ema = nn.DataParallel(ema)
                disc = nn.DataParallel(disc)
            if FLAGS.ddp:
                init_process_group(backend="nccl")
                torch.backends.cudnn.benchmark = True
            else:
                torch.cuda.empty_cache()
                torch.cuda.set_device(0)
            train(net)
            destroy_process_group()
        """)
    text = port_source(src).text
    assert "    if FLAGS.parallel:\n        pass\n    if FLAGS.ddp:\n        pass\n    else:\n" \
           "        pass\n    train(net)\n" in text
    assert "    init_process_group(" not in text and "    destroy_process_group()" not in text
    compile(text, "ported", "exec")
    script = tmp_path / "main.py"
    script.write_text(src)
    assert main([str(script)]) == 0
    compile((tmp_path / "main_tpu.py").read_text(), "main_tpu.py", "exec")


def test_output_that_does_not_parse_is_called_ports_fault_and_names_the_rule():
    from tpu_utility.port.edits import Edits, split_lines
    from tpu_utility.port.pipeline import check_parses
    source = "if flag:\n    x = DataParallel(x)\n"
    edits = Edits(split_lines(source))
    edits.rule = "distributed.wrapper-line"
    edits.add((2, 0, 3, 0, ""))  # a removal that empties the block, as before issue 48
    with pytest.raises(ValueError) as e:
        check_parses(source, "if flag:\n", edits, wrapped=False)
    said = str(e.value)
    assert "port's" in said and "`distributed.wrapper-line`" in said and "not your file" in said


def test_a_file_that_does_not_parse_is_still_called_so(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n    pass\n")
    assert main([str(bad)]) == 2
    assert "bad.py does not parse" in capsys.readouterr().out


def test_cuda_runtime_calls_go_or_are_swapped():
    assert ported("""\
        \"\"\"doc\"\"\"
        import torch


        @torch.compile
        def fused(x):
            return x * 2


        def main(args, model, loader):
            model = torch.compile(model)
            fast = torch.compile(model, mode="max-autotune")
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
            with torch.cuda.device(args.gpu_index):
                for x in loader:
                    fast(x).sum().backward()
        """) == textwrap.dedent("""\
        \"\"\"doc\"\"\"
        import torch
        import contextlib


        def fused(x):
            return x * 2


        def main(args, model, loader):
            fast = model
            with contextlib.nullcontext():
                for x in loader:
                    fast(x).sum().backward()
        """)
