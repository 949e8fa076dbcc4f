"""`python -m tpu_utility port`: the project's own CUDA script, an AMP Kaggle-style loop and a
top-level notebook, each written the way such scripts are written."""
import json
import sys
import textwrap

import pytest

from conftest import ROOT, run_process, run_python, script_env

AMP_SCRIPT = '''\
import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def train_one_epoch(model, loader, optimizer, scheduler, scaler):
    model.train()
    running = 0.0
    for step, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        with torch.cuda.amp.autocast():
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        running += loss.item()  # for the progress bar
    scheduler.step()
    return running / len(loader)


def valid(model, loader, bs):
    model.eval()
    preds = np.zeros((len(loader.dataset), 4))
    with torch.no_grad():
        for i, (x, y) in enumerate(loader):
            preds[i * bs:(i + 1) * bs] = model(x.cuda()).float().cpu().numpy()
    return preds


def run_training(epochs=2, bs=32):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 20, generator=g)
    y = torch.randint(0, 4, (256,), generator=g)
    train_loader = DataLoader(TensorDataset(x, y), batch_size=bs, shuffle=True, num_workers=0)
    valid_loader = DataLoader(TensorDataset(x, y), batch_size=bs, shuffle=False)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    scaler = torch.cuda.amp.GradScaler()
    losses = []
    for epoch in range(epochs):
        losses.append(train_one_epoch(model, train_loader, optimizer, scheduler, scaler))
        torch.save(model.state_dict(), f"model_{epoch}.pt")
        torch.cuda.empty_cache()
    return {"losses": losses, "preds": valid(model, valid_loader, bs).shape}


if __name__ == "__main__":
    print(run_training())
'''


def port(path, cwd):
    return run_process([sys.executable, "-m", "tpu_utility", "port", str(path)], cwd=cwd,
                       timeout=120)


def test_port_of_the_project_script_gives_the_swapped_script(tmp_path):
    original = (ROOT / "examples" / "cuda_train.py").read_text()
    src = tmp_path / "cuda_train.py"
    src.write_text(original)
    proc = port(src, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "cuda_train_tpu.py").read_text() == (ROOT / "examples" / "tpu_train.py").read_text()
    assert src.read_text() == original  # never edits the original
    assert "-            opt.step()" in proc.stdout and "+            tu.optimizer_step(opt)" in proc.stdout
    assert "5 swaps made" not in proc.stdout and "4 swaps made" in proc.stdout


def test_port_of_an_amp_loop_swaps_what_is_safe_and_lists_the_rest(tmp_path):
    src = tmp_path / "baseline.py"
    src.write_text(AMP_SCRIPT)
    proc = port(src, tmp_path)
    assert proc.returncode == 0, proc.stderr
    ported = (tmp_path / "baseline_tpu.py").read_text()
    for line in ('def train_fn():\n    global device\n    device = tu.get_device()\n\n    print(run_training())\n',
                 'if __name__ == "__main__":\n    tu.run(train_fn, cores=8)\n',
                 'with tu.autocast():',
                 'scaler = tu.GradScaler()',
                 'train_loader = tu.make_loader(TensorDataset(x, y), batch_size=bs, num_workers=0)',
                 'valid_loader = tu.make_loader(TensorDataset(x, y), batch_size=bs, train=False)',
                 'model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)).to(tu.get_device())',
                 'tu.save(model.state_dict(), f"model_{epoch}.pt")',
                 'preds[i * bs:(i + 1) * bs] = model(x.to(tu.get_device())).float().cpu().numpy()',
                 'import tpu_utility as tu'):
        assert line in ported, line
    assert "scaler.step(optimizer)" in ported  # the AMP swap keeps the loop as it was
    assert "scheduler.step()" in ported  # a scheduler is not an optimizer
    # a statement with no meaning on a TPU goes with its line
    assert "torch.cuda.empty_cache()" not in ported and "pass" not in ported
    assert '        tu.save(model.state_dict(), f"model_{epoch}.pt")\n    return {' in ported
    # the device chosen at the top level (it would start XLA in the caller) and the call of
    # the training function now run inside train_fn, on every core
    todo = proc.stdout.split("could not do safely:", 1)[1]
    assert "top level" not in todo and "scaler" not in todo
    assert "line 20: `loss.item()` reads the device every step" in todo
    assert "line 30: results indexed by batch size" in todo and "tu.gather" in todo
    # The ported script runs on XLA (one core here: its valid() still indexes by batch size).
    run = run_process([sys.executable, "-c", ported.replace("cores=8", "cores=1, start_method='fork'")],
                      cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "'preds': (256, 4)" in run.stdout
    assert sorted(p.name for p in tmp_path.glob("model_*.pt")) == ["model_0.pt", "model_1.pt"]


NOTEBOOK_CELLS = [
    "%%time\n!pip install -q timm\n%matplotlib inline\nimport torch, torch.nn as nn",
    "x = torch.randn(128, 8).cuda()\ny = (x.sum(1) > 0).long().cuda()\nmodel = nn.Linear(8, 2).cuda()\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)",
    "for epoch in range(3):\n    opt.zero_grad()\n    loss = nn.functional.cross_entropy(model(x), y)\n"
    "    loss.backward()\n    opt.step()\n    print(loss.item())",
    # a Kaggle kernel's shape: the training function in one cell, called at the top of another
    "def train_model(model, x, y, bs=32):\n    opt = torch.optim.Adam(model.parameters())\n"
    "    for i in range(0, len(x), bs):\n        nn.functional.cross_entropy(model(x[i:i + bs]), y[i:i + bs]).backward()\n"
    "        opt.step()\n    preds = torch.zeros(len(x), 2)\n    for i in range(len(x) // bs):\n"
    "        preds[i * bs:(i + 1) * bs, :] = model(x[i * bs:(i + 1) * bs]).detach().cpu()\n    return preds",
    "all_preds = []\nfor seed in range(2):\n    m = nn.Linear(8, 2)\n    m.cuda()\n"
    "    all_preds.append(train_model(m, x, y))",
]


def test_port_of_a_top_level_notebook_wraps_its_training_for_run(tmp_path):
    # (issue 34: notebooks were ported cell by cell, so they could only ever use one core)
    notebook = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": ["# Title"]}] +
                [{"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
                  "source": textwrap.dedent(c).splitlines(keepends=True)} for c in NOTEBOOK_CELLS],
                "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    src = tmp_path / "notebook.ipynb"
    src.write_text(json.dumps(notebook))
    proc = port(src, tmp_path)
    assert proc.returncode == 0, proc.stderr
    cells = ["".join(c["source"]) for c in json.loads((tmp_path / "notebook_tpu.ipynb").read_text())["cells"]]
    assert cells[0] == "# Title"
    # the import goes below the cell magic, which must stay first
    assert cells[1].startswith("%%time\nimport tpu_utility as tu\n!pip install -q timm\n%matplotlib inline\n")
    assert "\n-x = torch.randn(128, 8).cuda()\n" in proc.stdout  # the code cells' diff
    # from the first cell that touches the device, the code is train_fn, run from a last cell;
    # the function the cells define stays at the top (a model of its class still pickles)
    assert cells[2].startswith("def train_model(model, x, y, bs=32):\n")
    assert "\n\n\ndef train_fn():\n    global all_preds, epoch, loss, m, model, opt, seed, x, y\n" \
           "    x = torch.randn(128, 8).to(tu.get_device())\n" in cells[2]
    assert "    # from cell 4\n    for epoch in range(3):\n" in cells[2]
    assert "        m.to(tu.get_device())\n        all_preds.append(train_model(m, x, y))" in cells[2]
    assert cells[-1] == "tu.run(train_fn, cores=8)" and len(cells) == 4
    # no device is chosen at the top of the kernel, where it would stop run(cores=8)
    assert all(line.startswith(" ") for c in cells for line in c.splitlines() if "get_device" in line)
    # batches sliced from tensors: no make_loader cuts the step, so tu.sync() does
    assert "        tu.optimizer_step(opt)\n        tu.sync()\n" in cells[2]
    assert "line 6: cell 4: `loss.item()` reads the device every step" in proc.stdout
    assert "line 8: cell 5: results indexed by batch size" in proc.stdout
    assert "line 8: cell 5: `model(x[i * bs:(i + 1) * bs]).detach().cpu()` collects evaluation results" in proc.stdout
    assert proc.stdout.count("reads no DataLoader") == 2 and "trains at the top level" not in proc.stdout
    assert "5 things port could not do safely" in proc.stdout
    assert json.loads(src.read_text()) == notebook


# The shape of pytorch/examples' MNIST (train() and test() before main(), the device from
# torch.accelerator, loader options in dicts filled only with an accelerator), written here.
TUTORIAL_SCRIPT = '''\
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader


def train(model, loader, optimizer):
    for i, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        loss = F.nll_loss(model(x), y)
        loss.backward()
        optimizer.step()
        if i % 10 == 0:
            print(loss.item())  # a log point, not every step: not listed


def test(model, loader):
    total = 0
    with torch.no_grad():
        for x, y in loader:
            total += F.nll_loss(model(x), y, reduction="sum").item()
    return total / len(loader.dataset)


def main(ds, net):
    use_accel = torch.accelerator.is_available()
    if use_accel:
        device = torch.accelerator.current_accelerator()
    else:
        device = torch.device("cpu")
    train_kwargs, test_kwargs = {"batch_size": 8}, {"batch_size": 8}
    if use_accel:
        train_kwargs.update({"shuffle": True, "pin_memory": True})
    train_loader = DataLoader(ds, **train_kwargs)
    test_loader = DataLoader(ds, **test_kwargs)
    model = net.to(device)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    train(model, train_loader, optimizer)
    return test(model, test_loader)
'''


def test_port_of_a_tutorial_loop_finds_what_the_names_hide():
    from tpu_utility.port import port_source
    result = port_source(TUTORIAL_SCRIPT)
    lines = TUTORIAL_SCRIPT.splitlines()

    def at(text):
        return next(i for i, line in enumerate(lines, 1) if text in line)
    # the optimizer is a parameter of train(), bound to one only later, in main()
    assert "        tu.optimizer_step(optimizer)\n" in result.text
    # the whole if/else choosing the device becomes one line
    assert "    else:\n" not in result.text and 'torch.device("cpu")' not in result.text
    assert "    device = tu.get_device()\n    train_kwargs" in result.text
    # whether a loader shuffles is hidden in a dict: the loops that read it tell (train()'s
    # calls backward(), test()'s does not)
    assert "    train_loader = tu.make_loader(ds, **train_kwargs)\n" in result.text
    assert "    test_loader = tu.make_loader(ds, **test_kwargs, train=False)\n" in result.text
    todo = dict(result.todo)
    # (issue 34) the check is the accelerator's, so the loader options it guards are kept
    assert "    use_accel = tu.has_accelerator()\n" in result.text
    assert "batch by batch: a host transfer each" in todo[at("total += ")] and "tu.gather" in todo[at("total += ")]
    assert len(result.todo) == 1, result.todo
    compile(result.text, "ported", "exec")
    # a loader read in a function that also evaluates another one is still told apart
    both = port_source("def fit(model, opt, train_dl, valid_dl):\n    for x, y in train_dl:\n"
                       "        model(x).sum().backward()\n    for x, y in valid_dl:\n        model(x)\n"
                       "a = DataLoader(ds, **kw)\nb = DataLoader(ds, **kw)\nfit(m, o, a, valid_dl=b)\n")
    assert "a = tu.make_loader(ds, **kw)\nb = tu.make_loader(ds, **kw, train=False)\n" in both.text
    assert both.todo == [(8, "fit() trains at the top level: move this code into a function (def "
                              "train_fn(): ...) and call tu.run(train_fn, cores=8); notebooks too")]
    # no loop is seen reading it: evaluation's safe choice (nothing dropped), and a note
    unknown = port_source("loader = DataLoader(ds, **kwargs)\ntrainer.fit(model, loader)\n")
    assert unknown.text.startswith("loader = tu.make_loader(ds, **kwargs, train=False)\n")
    assert "cannot see whether it is for training" in unknown.todo[0][1]


def test_port_keeps_a_loader_laid_out_over_lines():
    from tpu_utility.port import port_source
    source = ("train_loader = torch.utils.data.DataLoader(\n    train_ds,\n    batch_size=16,\n"
              "    shuffle=True,        \n    drop_last=False,\n    num_workers=2,\n"
              "    #sampler=BalanceClassSampler(labels, mode='downsampling')\n)\n"
              "valid_loader = DataLoader(valid_ds, batch_size=16,\n    shuffle=False)\n")
    result = port_source(source)
    assert result.text == ("train_loader = tu.make_loader(\n    train_ds,\n    batch_size=16,\n"
                           "    drop_last=False,\n    num_workers=2,\n"
                           "    #sampler=BalanceClassSampler(labels, mode='downsampling')\n)\n"
                           "valid_loader = tu.make_loader(valid_ds, batch_size=16, train=False)\n")
    assert [line for line, _ in result.todo] == [1]  # drop_last=False on a training loader


# A loop's iterable is read once, before the first batch; a one-line loop's body runs every
# batch. port's notes and report()'s named lines (costly_calls) must draw the line alike.
HEADER_SCRIPT = '''\
import sys
from tpu_utility.reporting import caller_code


def evaluate(model, batches):
    outputs, total = [], 0.0
    for x in batches.cpu():  # once: not a read per batch
        outputs.append(model(x).tolist())
    for x in batches: total += model(x).sum().item()
    return outputs, total


def sites():
    evaluate  # report() reads the functions its caller names
    return caller_code(sys._getframe())[0]
'''


def test_port_and_report_agree_on_what_a_loop_runs_every_batch(tmp_path):
    import importlib.util
    from tpu_utility.port import port_source
    from tpu_utility.port.facts import costly_calls
    lines = HEADER_SCRIPT.splitlines()

    def at(text):
        return next(i for i, line in enumerate(lines, 1) if text in line)
    every_batch = [at(".tolist()"), at(".item()")]
    assert sorted(line for line, _ in port_source(HEADER_SCRIPT).todo) == every_batch
    assert [(kind, line) for kind, line, _ in costly_calls(HEADER_SCRIPT)] == \
        [("cpu", every_batch[0]), ("item", every_batch[1])]
    # report()'s own path to those lines: the caller's source, read back from its file
    path = tmp_path / "header_script.py"
    path.write_text(HEADER_SCRIPT)
    spec = importlib.util.spec_from_file_location("header_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert [where for _, where, _ in module.sites()] == [f"header_script.py:{n}" for n in every_batch]


def test_port_and_report_know_every_spelling_of_torch_grad_scaler():
    from tpu_utility.port import port_source
    from tpu_utility.port.facts import costly_calls
    source = ("import torch\nfrom torch import cuda\n\n\ndef scalers():\n"
              "    a = torch.cuda.amp.GradScaler()\n    b = cuda.amp.GradScaler()\n    return a, b\n")
    result = port_source(source)
    assert "    a = tu.GradScaler()\n    b = tu.GradScaler()\n" in result.text
    assert result.swaps == [(6, "GradScaler -> tu.GradScaler"), (7, "GradScaler -> tu.GradScaler")]
    assert [(kind, line) for kind, line, _ in costly_calls(source)] == [("scaler", 6), ("scaler", 7)]


def test_source_facts_answer_for_any_node_not_only_a_module():
    import ast
    from tpu_utility.port.rules import Finder as _Finder
    from tpu_utility.port.facts import module_facts
    source = ("def fit(model, dl, opt):\n    for x in dl:\n        model(x).sum().backward()\n"
              "        seen = x.item()\n    torch.cuda.empty_cache()\n")
    fn = ast.parse(source).body[0]
    facts = module_facts(fn)  # a function, as a notebook tool or a test holds one
    item = next(n for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "item")
    assert facts.inside_loop(item, facts.backward_loops) and not facts.under_if_in_loop(item)
    assert not facts.inside_loop(ast.parse("x.item()"))  # a node from elsewhere: in no loop
    finder = _Finder(source.splitlines(keepends=True), facts, set())
    finder.visit(fn)  # the rules read the facts they were given: no pre-scan to miss
    assert [line for line, _ in finder.notes.todo] == [4]
    assert finder.edits.swaps == [(5, "torch.cuda.empty_cache() has no meaning on a TPU: removed")]


# -- A model moved after its optimizer is made ------------------------------------------------
# On CUDA .to() keeps the Parameter objects, so the order does not matter; on XLA it makes
# new ones and an optimizer made before the move keeps the old CPU tensors: it trains nothing.

def test_port_moves_a_model_move_up_before_the_optimizer_made_from_it():
    from tpu_utility.port import port_source
    # `model = model.cuda()` in a function (port's own .to(tu.get_device()) goes with it),
    # with the comment right above it; the schedule made from the optimizer stays after it
    source = textwrap.dedent('''\
        def main(net):
            model = net
            # the optimizer and its schedule
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, 10)
            # to the GPU
            model = model.cuda()
            train(model, opt, sched)
        ''')
    result = port_source(source)
    assert result.text == textwrap.dedent('''\
        def main(net):
            model = net
            # to the GPU
            model = model.to(tu.get_device())
            # the optimizer and its schedule
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, 10)
            train(model, opt, sched)
        ''')
    assert (7, "`model = model.cuda()` moved up, before `opt` is made: on XLA .to() makes new "
               "parameters, and an optimizer made before it would train nothing") in result.swaps
    assert result.todo == []
    # two nets, each moved before its own optimizer: `.cuda()` in a function, `.to(device)`
    # at the top of a cell (a notebook's `.to(device)` stays: the device is tu.get_device())
    gan = port_source(textwrap.dedent('''\
        def build():
            netG, netD = G(), D()
            optG = optim.Adam(netG.parameters(), lr=2e-4)
            optD = optim.Adam(netD.parameters(), lr=2e-4)
            netG.cuda()
            netD.cuda()
            return netG, netD, optG, optD
        model = Net()
        optimizer = optim.Adam([{"params": model.body.parameters()},
                                {"params": model.head.parameters(), "lr": 1e-4}], lr=1e-3)
        model.to(device)
        '''))
    assert gan.text == textwrap.dedent('''\
        def build():
            netG, netD = G(), D()
            netG.to(tu.get_device())
            optG = optim.Adam(netG.parameters(), lr=2e-4)
            netD.to(tu.get_device())
            optD = optim.Adam(netD.parameters(), lr=2e-4)
            return netG, netD, optG, optD
        model = Net()
        model.to(device)
        optimizer = optim.Adam([{"params": model.body.parameters()},
                                {"params": model.head.parameters(), "lr": 1e-4}], lr=1e-3)
        ''')
    assert [line for line, what in gan.swaps if "moved up" in what] == [5, 6, 11]
    assert gan.todo == []


def test_port_lists_a_model_moved_after_its_optimizer_where_moving_could_change_the_script():
    from tpu_utility.port import port_source
    source = textwrap.dedent('''\
        def resume(model, ckpt):
            opt = torch.optim.Adam(model.parameters())
            opt.load_state_dict(ckpt["optimizer"])
            model.to(device)
            return opt

        def fine_tune(head, use_cuda):
            opt = torch.optim.SGD(head.parameters(), lr=0.1)
            if use_cuda:
                head.to(device)
            return opt
        ''')
    result = port_source(source)
    assert result.text == source and result.swaps == []
    fix = ("create the optimizer after model.to(device): on XLA .to() makes new parameters, "
           "and this optimizer would keep the old ones (the run refuses to step it)")
    assert result.todo == [
        (2, "`opt` is made before `model.to(device)` moves its model (`opt.load_state_dict("
            "ckpt[\"optimizer\"])` between them depends on it, so port kept the order): " + fix),
        (8, "`opt` is made before `head.to(device)` moves its model (they are in different "
            "blocks, so port kept the order): " + fix)]
    # (issue 34) a DataParallel wrapper goes, so it no longer holds the move back
    wrapped = port_source("def wrapped(model):\n    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                          "    model = nn.DataParallel(model)\n    model.to(device)\n    return opt\n")
    assert wrapped.text == ("def wrapped(model):\n    model.to(device)\n"
                            "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n    return opt\n")
    assert wrapped.todo == []


ORDER_CELLS = [
    "import torch\nimport torch.nn as nn\ndevice = torch.device('cuda' if torch.cuda.is_available() else 'cpu')",
    "model = nn.Linear(8, 2)\noptimizer = torch.optim.Adam(model.parameters())\ncriterion = nn.CrossEntropyLoss()",
    "model.to(device)",
    # in one cell the move goes up, as in a script
    "model2 = nn.Linear(8, 2)\noptimizer2 = torch.optim.Adam(model2.parameters())\nmodel2.to(device)",
]


def test_port_of_a_wrapped_notebook_moves_the_move_up_across_cells(tmp_path):
    # (issue 34) it was listed, "made in an earlier cell": every notebook that makes an
    # optimizer at its top level is now wrapped whole, so the cells share one block
    from tpu_utility.port import port
    notebook = {"cells": [{"cell_type": "code", "metadata": {}, "execution_count": None,
                           "outputs": [], "source": c.splitlines(keepends=True)} for c in ORDER_CELLS],
                "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    src = tmp_path / "order.ipynb"
    src.write_text(json.dumps(notebook))
    result = port(str(src))
    cells = ["".join(c["source"]) for c in json.loads((tmp_path / "order_tpu.ipynb").read_text())["cells"]]
    # the cells from the device's choice on are one train_fn: there the move can go up
    assert "    model = nn.Linear(8, 2)\n    # from cell 3\n    model.to(device)\n" \
           "    optimizer = torch.optim.Adam(model.parameters())\n" in cells[0]
    assert cells[1] == "tu.run(train_fn, cores=8)" and len(cells) == 2 and result.todo == []
    assert [line for line, what in result.swaps if "moved up" in what] == [1, 3]


def test_port_leaves_an_optimizer_made_after_the_move_or_from_another_model():
    from tpu_utility.port import port_source
    source = textwrap.dedent('''\
        model = Net().to(device)
        optimizer = torch.optim.Adam(model.parameters())
        model.to(device)  # already on the device: the same parameters
        enc_opt = torch.optim.Adam(encoder.parameters())
        decoder.to(device)
        half_opt = torch.optim.SGD(half.parameters(), lr=0.1)
        half.to(torch.bfloat16)  # a conversion in place keeps the Parameter objects
        def main(net):
            net.to(device)
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            net = Net()  # another model: moving it leaves opt's alone
            net.to(device)
            return opt
        ''')
    result = port_source(source)
    assert result.text == source and result.swaps == [] and result.todo == []


# The shape of a public tutorial notebook, as a script: the model built, its optimizer and
# schedule made, then `model.to(device)`, and the training at the top level. Ported before
# port moved the move, it trained at ln(3) every epoch on XLA.
ORDER_SCRIPT = '''\
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
g = torch.Generator().manual_seed(0)
x = torch.randn(256, 10, generator=g)
y = (x @ torch.randn(10, 3, generator=g)).argmax(1)
# one batch an epoch: make_loader's order is its own, and a whole batch's loss is not
loader = DataLoader(TensorDataset(x, y), batch_size=256, shuffle=True)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
optimizer = torch.optim.Adam(model.parameters(), lr=5e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
criterion = nn.CrossEntropyLoss()
# to the GPU
model.to(device)

for epoch in range(6):
    model.train()
    for xb, yb in loader:
        xb, yb = xb.to(device), yb.to(device)
        optimizer.zero_grad()
        loss = criterion(model(xb), yb)
        loss.backward()
        optimizer.step()
    scheduler.step()
    print(f"EPOCH {epoch} LOSS {loss.item():.6f}")
'''


def test_a_ported_script_with_its_optimizer_made_before_the_move_trains(tmp_path):
    from test_port_corpus import DRIVER, _losses  # the corpus test's driver and reader
    from tpu_utility.port import port
    src = tmp_path / "order.py"
    src.write_text(ORDER_SCRIPT)
    result = port(str(src))
    text = (tmp_path / "order_tpu.py").read_text()
    assert "    # to the GPU\n    model.to(device)\n    optimizer = torch.optim.Adam(" in text
    assert any("moved up" in what for _, what in result.swaps)
    ported = tmp_path / "order_tpu_1.py"
    ported.write_text(text.replace("cores=8", "cores=1, start_method='fork'"))
    # one process: the port (its replica forked before this process runs autograd, whose
    # engine, started on the CPU alone, would have no queue for XLA), then the original
    jobs = [["order:1", str(ported), [], {}], ["order:cpu", str(src), [], {}]]
    (tmp_path / "driver.py").write_text(DRIVER)
    proc = run_python([sys.executable, str(tmp_path / "driver.py"), json.dumps(jobs)],
                       cwd=tmp_path, timeout=300, env=script_env())
    assert proc.returncode == 0 and "=== end" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = _losses(proc.stdout, {"order": (None, None, None, r"EPOCH \d+ LOSS (\S+)")})
    want, got = losses["order:cpu"], losses["order:1"]
    assert len(want) == 6 and want[-1] < 0.7 * want[0], want
    assert got == pytest.approx(want, rel=2e-3, abs=2e-4), (got, want)


PROJECT = {
    "main.py": '''\
import torch
import loops
from nets import Net
import settings


def main():
    model = Net().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=settings.LR)
    loops.fit(model, opt)


if __name__ == "__main__":
    main()
''',
    "loops.py": '''\
import torch


def fit(model, opt):
    for step in range(3):
        x = torch.randn(4, 2).cuda()
        model(x).sum().backward()
        opt.step()
''',
    "nets.py": '''\
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 1)

    @torch.cuda.amp.autocast()
    def forward(self, x):
        return self.fc(x)
''',
    "settings.py": "LR = 0.1\n",
}


def test_port_of_a_script_ports_the_local_modules_it_imports(tmp_path):
    # (issue 34) each file was ported alone: the entry trained through loops.fit on one
    # core, and imported the unported modules
    from tpu_utility.port import port
    for name, text in PROJECT.items():
        (tmp_path / name).write_text(text)
    result = port(str(tmp_path / "main.py"))
    main = (tmp_path / "main_tpu.py").read_text()
    # the training reached through loops.fit counts: main() runs on every core
    assert '    tu.run(main, cores=8)\n' in main
    assert "import loops_tpu as loops\nfrom nets_tpu import Net\nimport settings\nimport tpu_utility as tu\n" in main
    assert "        tu.optimizer_step(opt)\n" in (tmp_path / "loops_tpu.py").read_text()
    assert "    @tu.autocast()\n" in (tmp_path / "nets_tpu.py").read_text()
    assert not (tmp_path / "settings_tpu.py").exists()  # nothing to change: imported as it is
    assert sorted(m.output for m in result.modules) == [str(tmp_path / "loops_tpu.py"),
                                                        str(tmp_path / "nets_tpu.py")]
    for name, text in PROJECT.items():  # the originals are never edited
        assert (tmp_path / name).read_text() == text
    for ported in tmp_path.glob("*_tpu.py"):
        compile(ported.read_text(), str(ported), "exec")


def test_port_of_a_project_folder_ports_its_one_entry_script(tmp_path, capsys):
    from tpu_utility.port import main
    for name, text in PROJECT.items():
        (tmp_path / name).write_text(text)
    assert main([str(tmp_path)]) == 0
    assert "    tu.run(main, cores=8)\n" in (tmp_path / "main_tpu.py").read_text()
    assert (tmp_path / "loops_tpu.py").exists()
    (tmp_path / "other.py").write_text('if __name__ == "__main__":\n    pass\n')
    assert main([str(tmp_path)]) == 2  # two scripts: it names them, and writes nothing
    assert "has 2 scripts" in capsys.readouterr().out
