"""`port` where training is reached through other files and classes (issue 48): a method
of a class in another local module, absl's `app.run(main)`, a module of a local package;
an optimizer made before its model moves as a submodule or inside a class's `__init__`;
and scripts that sample their own batch rows."""
import ast
import textwrap

from tpu_utility.port import port, port_source


def _project(tmp_path, files: dict):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return port(str(tmp_path / "main.py"))


TRAINER = '''\
    import torch


    class Trainer:
        def __init__(self, model, optimizer, args):
            self.model, self.optimizer, self.args = model, optimizer, args

        def train(self, loader):
            for epoch in range(self.args.epochs):
                self.epoch(loader)

        def epoch(self, loader):
            for x, y in loader:
                x, y = x.to(self.args.device), y.cuda()
                loss = torch.nn.functional.mse_loss(self.model(x), y)
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
    '''


def test_a_method_of_a_class_in_another_module_that_trains_is_run_through_tu_run(tmp_path):
    result = _project(tmp_path, {"trainer.py": TRAINER, "main.py": '''\
        import torch
        from trainer import Trainer


        def main():
            model = torch.nn.Linear(4, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            trainer = Trainer(model, optimizer, args)
            trainer.train(loader)


        if __name__ == "__main__":
            main()
        '''})
    text = open(result.output).read()
    assert "    tu.run(main, cores=8)" in text.splitlines() and "from trainer_tpu import Trainer" in text
    ported = (tmp_path / "trainer_tpu.py").read_text()
    assert "y.to(tu.get_device())" in ported, ported


def test_a_method_of_a_class_of_the_script_itself_that_trains_is_run_through_tu_run():
    source = textwrap.dedent(TRAINER) + textwrap.dedent('''\


        def main():
            runner = Trainer(model, optimizer, args)
            runner.train(loader)


        if __name__ == "__main__":
            main()
        ''')
    text = port_source(source, script=True).text
    assert "    tu.run(main, cores=8)" in text.splitlines(), text


ABSL = '''\
    import torch
    from absl import app, flags

    flags.DEFINE_integer("{flag}", 1, "steps")
    FLAGS = flags.FLAGS


    def train():
        for _ in range(FLAGS.{flag}):
            loss = model(x).sum()
            loss.backward()


    def main(argv):
        train()


    if __name__ == "__main__":
        app.run(main)
    '''


def test_absl_app_run_of_a_training_main_becomes_tu_run_that_parses_the_flags_and_returns():
    """The entry port writes runs: it parses the flags in the replica (spawn starts one
    afresh) and returns main's result where app.run would have exited with it."""
    from absl import flags
    result = port_source(textwrap.dedent(ABSL.format(flag="reach_steps_a")), script=True)
    text = result.text
    assert "app.run" not in {ast.unparse(n.func) for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Call)}
    assert "    tu.run(main_tpu, cores=8, args=(sys.argv,))" in text.splitlines()
    assert text.startswith("import sys\n")
    space = {"__name__": "ported"}
    exec(compile(text, "ported.py", "exec"), space)
    seen = []
    space["main"] = lambda argv: seen.append(argv) or "main's result"
    assert space["main_tpu"](["prog", "--reach_steps_a=3", "rest"]) == "main's result"
    assert seen == [["prog", "rest"]] and flags.FLAGS.reach_steps_a == 3
    assert [rule for _, rule in result.swap_rules].count("entry.absl-app-run") == 1


def test_absl_app_run_inside_the_wrapped_top_level_is_a_call_that_returns():
    """A module-level device makes port wrap the script from there: app.run(main) lands in
    train_fn, which tu.run already runs, so it is called, not run (no sys.exit)."""
    source = textwrap.dedent(ABSL.format(flag="reach_steps_b")).replace(
        "FLAGS = flags.FLAGS\n", 'FLAGS = flags.FLAGS\ndevice = torch.device("cuda")\n')
    text = port_source(source, script=True).text
    tree = ast.parse(text)
    train_fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train_fn")
    assert "main(app.parse_flags_with_usage(sys.argv))" in ast.unparse(train_fn), text
    assert "app.run(" not in text and "    tu.run(train_fn, cores=8)" in text.splitlines()


def test_a_module_of_a_local_package_is_ported_too(tmp_path):
    result = _project(tmp_path, {
        "models/__init__.py": "",
        "models/unet.py": '''\
            import torch


            class UNet(torch.nn.Module):
                def forward(self, x):
                    return x * torch.ones(1).cuda()
            ''',
        "main.py": '''\
            import torch
            from models.unet import UNet


            def main():
                model = UNet().cuda()
                for x in loader:
                    model(x).sum().backward()


            if __name__ == "__main__":
                main()
            '''})
    text = open(result.output).read()
    assert "from models.unet_tpu import UNet" in text
    assert "tu.get_device()" in (tmp_path / "models" / "unet_tpu.py").read_text()


def test_an_optimizer_made_before_its_model_moves_as_a_submodule_goes_after_the_move():
    source = textwrap.dedent('''\
        def train(net, device):
            optim = torch.optim.Adam(net.parameters(), lr=1e-3)
            trainer = Wrapper(net, 0.1).to(device)
            for x in loader:
                trainer(x).backward()
                optim.step()


        def train_2(net, device):
            optim = torch.optim.Adam(net.parameters(), lr=1e-3)
            wrapper = Wrapper(net)
            wrapper.to(device)
            for x in loader:
                wrapper(x).backward()
                optim.step()
        ''')
    result = port_source(source)
    lines = [line.strip() for line in result.text.splitlines()]
    for move in ("trainer = Wrapper(net, 0.1).to(device)", "wrapper.to(device)"):
        at = lines.index(move)
        assert lines[at + 1] == "optim = torch.optim.Adam(net.parameters(), lr=1e-3)", result.text
    assert [rule for _, rule in result.swap_rules].count("order.move-before-optimizer") == 2


INIT_MOVES = '''\
    class SimCLR:
        def __init__(self, *args, **kwargs):
            self.args = kwargs["args"]
            self.model = kwargs["model"].to(self.args.device)
            self.optimizer = kwargs["optimizer"]

        def train(self, loader):
            for x in loader:
                self.model(x).sum().backward()
                self.optimizer.step()
    '''


def test_a_model_moved_in_a_class_init_after_its_optimizer_moves_before_it(tmp_path):
    result = _project(tmp_path, {"simclr.py": INIT_MOVES, "main.py": '''\
        import torch
        from simclr import SimCLR


        def main():
            model = Encoder()
            # the optimizer
            optimizer = torch.optim.Adam(model.parameters(), 3e-4)
            simclr = SimCLR(model=model, optimizer=optimizer, args=args)
            simclr.train(loader)


        if __name__ == "__main__":
            main()
        '''})
    lines = open(result.output).read().splitlines()
    at = lines.index("    model.to(tu.get_device())")
    assert lines[at + 1:at + 3] == ["    # the optimizer",
                                    "    optimizer = torch.optim.Adam(model.parameters(), 3e-4)"]
    assert "    tu.run(main, cores=8)" in lines


def test_a_model_moved_in_a_class_init_where_port_cannot_move_it_is_listed():
    source = textwrap.dedent(INIT_MOVES) + textwrap.dedent('''\


        def main():
            optimizer = torch.optim.Adam(model.parameters(), 3e-4)
            if args.contrastive:
                simclr = SimCLR(model=model, optimizer=optimizer, args=args)
        ''')
    result = port_source(source)
    line = source.splitlines().index("    optimizer = torch.optim.Adam(model.parameters(), 3e-4)") + 1
    notes = dict(result.todo)
    assert "SimCLR(model=model, optimizer=optimizer, args=args)" in notes[line], result.todo
    assert "create the optimizer after model.to(device)" in notes[line]


def test_a_batch_sampled_with_randint_is_named_where_it_is_sampled():
    source = textwrap.dedent('''\
        import torch
        data = torch.randint(16, (4096,))


        def get_batch():
            ix = torch.randint(len(data) - block_size, (batch_size,))
            return torch.stack([data[i:i + block_size] for i in ix]).cuda()


        def train():
            for it in range(10):
                loss = model(get_batch())
                loss.backward()
                optimizer.step()
        ''')
    result = port_source(source)
    notes = dict(result.todo)
    assert "no make_loader splits them" in notes[6] and "tu.make_loader(dataset, batch_size // 8)" in notes[6]
    assert [rule for line, rule in result.note_rules if line == 6] == ["loaders.sampled-batch"]
    # a batch read through a loader says nothing of it (torch.randint of noise, say)
    fed = port_source(source.replace("for it in range(10):", "for x in loader:"))
    assert 6 not in dict(fed.todo)


def test_an_endless_generator_over_a_loader_feeds_the_loop():
    """`next(datalooper)` where datalooper loops over a DataLoader: make_loader splits the
    batches, so port neither says every core computes the same batches nor adds tu.sync."""
    source = textwrap.dedent('''\
        def infiniteloop(dataloader):
            while True:
                for x, y in iter(dataloader):
                    yield x, y


        def train():
            optim = torch.optim.SGD(model.parameters(), lr=0.1)
            dataloader = DataLoader(ds, batch_size=32, shuffle=True, drop_last=True)
            datalooper = infiniteloop(dataloader)
            it = iter(DataLoader(ds, batch_size=32, shuffle=True))
            for step in range(100):
                x, y = next(datalooper)
                loss = model(x, y)
                loss.backward()
                optim.step()
        ''')
    result = port_source(source)
    assert "tu.sync()" not in result.text and not any("reads no DataLoader" in n for _, n in result.todo)
    unfed = port_source(source.replace("next(datalooper)", "make_batch()"))
    assert "tu.sync()" in unfed.text


def test_a_model_moved_in_a_class_init_under_a_with_block_moves_before_its_optimizer():
    source = textwrap.dedent(INIT_MOVES) + textwrap.dedent('''\


        def main():
            optimizer = torch.optim.Adam(model.parameters(), 3e-4)
            with torch.cuda.device(args.gpu_index):
                simclr = SimCLR(model=model, optimizer=optimizer, args=args)
                simclr.train(loader)
        ''')
    lines = port_source(source).text.splitlines()
    at = lines.index("    model.to(tu.get_device())")
    assert lines[at + 1] == "    optimizer = torch.optim.Adam(model.parameters(), 3e-4)"


def test_a_package_init_that_would_change_is_listed_not_written(tmp_path):
    result = _project(tmp_path, {
        "models/__init__.py": "from .unet import UNet\n",
        "models/unet.py": "import torch\n\n\nclass UNet(torch.nn.Module):\n    def forward(self, x):\n"
                          "        return x.cuda()\n",
        "main.py": "import torch\nfrom models import UNet\n\n\ndef main():\n    model = UNet()\n"
                   "    for x in loader:\n        model(x).sum().backward()\n\n\nif __name__ == '__main__':\n"
                   "    main()\n"})
    assert (tmp_path / "models" / "unet_tpu.py").exists()
    assert not list(tmp_path.rglob("__init___tpu.py"))
    assert "from models import UNet" in open(result.output).read()
    assert any("the package models's __init__.py needs port's changes" in what for _, what in result.todo)
