"""Issue 60 (round 4): what port did on published scripts and hostile cases. (a) The
optimizer and a schedule made before the model moves inside a trainer made over two
lines (pytorch-ddpm's shape): the model now moves before the optimizer. (b) Training
reached through `Trainer(model, opt, device).train(loader)`, a staticmethod or a
classmethod called on its class, with `self.opt.step()` swapped where a call of the class
passes it an optimizer and listed where not, names resolved by import (two modules' classes
of one name are two classes). (c) A local module that does not parse is named, with its
line. The ported shapes run in test_port_corpus.py's shared run (trainer_chained,
diffusion_absl)."""
import textwrap

from tpu_utility.port import main, port, port_source


def _project(tmp_path, files: dict, entry: str = "main.py"):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return port(str(tmp_path / entry))


def _notes(result) -> list:
    return [what for _, what in result.todo]


# (a) ----------------------------------------------------------------------------------

DDPM = '''\
    def train():
        net_model = UNet(T=FLAGS.T, ch=FLAGS.ch)
        ema_model = copy.deepcopy(net_model)
        optim = torch.optim.Adam(net_model.parameters(), lr=FLAGS.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda=warmup_lr)
        trainer = GaussianDiffusionTrainer(
            net_model, FLAGS.beta_1, FLAGS.beta_T, FLAGS.T).to(device)
        net_sampler = GaussianDiffusionSampler(
            net_model, FLAGS.beta_1, FLAGS.beta_T, FLAGS.T).to(device)
        for step in range(FLAGS.total_steps):
            optim.zero_grad()
            loss = trainer(next(datalooper).to(device)).mean()
            loss.backward()
            optim.step()
            sched.step()
    '''


def test_a_model_moved_in_a_trainer_made_over_two_lines_after_optimizer_and_schedule_moves_first():
    """Neither the move (it makes the trainer) nor the optimizer (the schedule reads it)
    can go to the other: the model moves on a line of its own before the optimizer, after
    the EMA copy, and the trainer's move finds it there."""
    result = port_source(textwrap.dedent(DDPM))
    lines = [line.strip() for line in result.text.splitlines()]
    at = lines.index("net_model.to(tu.get_device())")
    assert lines[at - 1] == "ema_model = copy.deepcopy(net_model)", result.text
    assert lines[at + 1].startswith("optim = torch.optim.Adam(net_model.parameters()")
    assert lines[at + 3] == "trainer = GaussianDiffusionTrainer("  # left where it was
    assert not [w for w in _notes(result) if "is made before" in w], result.todo
    assert ("order.move-before-optimizer" in [r for _, r in result.swap_rules])


def test_the_model_does_not_move_first_where_a_statement_between_uses_it_or_binds_the_device():
    uses = port_source(textwrap.dedent(DDPM).replace(
        "    sched = ", "    print(sum(p.numel() for p in net_model.parameters()))\n    sched = "))
    binds = port_source(textwrap.dedent(DDPM).replace("    sched = ", "    device = pick()\n    sched = "))
    for result in (uses, binds):
        assert "net_model.to(tu.get_device())" not in result.text
        assert [w for w in _notes(result) if "`optim` is made before" in w], result.todo


# (b) ----------------------------------------------------------------------------------

ENGINE = textwrap.dedent('''\
    import torch


    class Trainer:
        def __init__(self, model, opt, device):
            self.model = model
            self.opt = opt
            self.device = device

        def train(self, loader):
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(self.model(x.to(self.device)), y.to(self.device))
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
    ''')


def test_a_chained_call_of_a_class_in_another_module_is_run_through_tu_run_and_its_step_swapped(tmp_path):
    result = _project(tmp_path, {"engine.py": ENGINE, "main.py": '''\
        import torch
        from engine import Trainer


        def main():
            model = torch.nn.Linear(4, 1).cuda()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            Trainer(model, opt, torch.device("cuda")).train(loader)


        if __name__ == "__main__":
            main()
        '''})
    text = open(result.output).read()
    assert "    tu.run(main, cores=8)" in text.splitlines() and "from engine_tpu import Trainer" in text
    ported = (tmp_path / "engine_tpu.py").read_text()
    assert "            tu.optimizer_step(self.opt)" in ported.splitlines(), ported
    [engine] = result.modules
    assert ("steps.optimizer-step" in [r for _, r in engine.swap_rules]) and not engine.todo


STATIC = '''\
    import torch


    class Loop:
        @staticmethod
        def train(model, optimizer, loader):
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

        @classmethod
        def fit(cls, model, optimizer, loader, epochs):
            for _ in range(epochs):
                cls.train(model, optimizer, loader)


    def main():
        model = torch.nn.Linear(4, 1).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        Loop.{call}(model, opt, loader{more})


    if __name__ == "__main__":
        main()
    '''


def test_training_in_a_staticmethod_or_a_classmethod_called_on_its_class_is_run_through_tu_run():
    for call, more in (("train", ""), ("fit", ", 3")):
        result = port_source(textwrap.dedent(STATIC.format(call=call, more=more)), script=True)
        assert "    tu.run(main, cores=8)" in result.text.splitlines(), (call, result.text)
        # `optimizer` names no optimizer port saw made (main's is `opt`): listed, with its fix
        [note] = [w for w in _notes(result) if "`optimizer.step()` after backward()" in w]
        assert "tu.optimizer_step(optimizer)" in note


def test_a_chained_call_under_the_main_guard_is_wrapped_with_it():
    result = port_source(ENGINE + textwrap.dedent('''\


        if __name__ == "__main__":
            Trainer(model, opt, device).train(loader)
        '''), script=True)
    assert "    tu.run(train_fn, cores=8)" in result.text.splitlines(), result.text
    assert "    Trainer(model, opt, device).train(loader)" in result.text.splitlines()


def test_self_opt_step_in_a_class_of_the_same_file_is_swapped_or_listed():
    made = '''\
        class Runner:
            def __init__(self, model, lr, helper):
                self.model = model
                self.optimizer = torch.optim.Adam(model.parameters(), lr=lr)
                self.helper = helper
                self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, 10)

            def step(self, loss):
                loss.backward()
                self.optimizer.step()
                self.scheduler.step()
                self.helper.step()
        '''
    result = port_source(textwrap.dedent(made))
    lines = result.text.splitlines()
    assert "        tu.optimizer_step(self.optimizer)" in lines and "        self.scheduler.step()" in lines
    # a step outside any loop, after the method's backward(): `self.helper` is no optimizer
    # port knows, and nothing calls Runner with one: listed, with its fix
    [note] = _notes(result)
    assert note.startswith("`self.helper.step()` after backward(): port does not know self.helper")
    # the same class called with an optimizer where `helper` goes: swapped
    called = port_source(textwrap.dedent(made) + "\n\nopt = torch.optim.SGD(ps, lr=0.1)\n"
                         "runner = Runner(model, 0.1, helper=opt)\n")
    assert "        tu.optimizer_step(self.helper)" in called.text.splitlines() and not called.todo


SAME_NAME = textwrap.dedent('''\
    import torch


    class Trainer:
        def __init__(self, model, opt):
            self.model, self.opt = model, opt

        def fit(self, loader):
            for x in loader:
                self.model(x).sum().backward()
                self.opt.step()
    ''')


def test_two_modules_classes_of_the_same_name_are_resolved_by_import(tmp_path):
    """fast.Trainer is called with an optimizer (main imports it): its step is swapped.
    slow.Trainer, the same text, is called only by slow.py, with a schedule: its step is
    listed, not swapped."""
    result = _project(tmp_path, {
        "fast.py": SAME_NAME,
        "slow.py": SAME_NAME + textwrap.dedent('''\


            def legacy(model, loader, schedule):
                Trainer(model, schedule).fit(loader)
            '''),
        "main.py": '''\
            import torch
            import slow
            from fast import Trainer


            def main():
                model = torch.nn.Linear(4, 1).cuda()
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                Trainer(model, opt).fit(loader)
                slow.legacy(model, loader, None)


            if __name__ == "__main__":
                main()
            '''})
    assert "    tu.run(main, cores=8)" in open(result.output).read().splitlines()
    fast = (tmp_path / "fast_tpu.py").read_text().splitlines()
    slow = next(m for m in result.modules if m.output.endswith("slow_tpu.py"))
    assert "            tu.optimizer_step(self.opt)" in fast
    assert "            self.opt.step()" in slow.text.splitlines()
    assert [w for w in _notes(slow) if w.startswith("`self.opt.step()` after backward()")], slow.todo


def test_a_method_of_another_modules_class_of_the_same_name_does_not_make_main_train(tmp_path):
    """main trains a tokenizer with tokens.Trainer; engine.py's own `trainer.train(loader)`
    trains a model, through its Trainer: main's `trainer.train(files)` is not that call."""
    result = _project(tmp_path, {
        "tokens.py": '''\
            class Trainer:
                def __init__(self, vocab):
                    self.vocab = vocab

                def train(self, files):
                    return sorted(set(files))[:self.vocab]
            ''',
        "engine.py": ENGINE + textwrap.dedent('''\


            def run(model, opt, loader):
                trainer = Trainer(model, opt, "cuda")
                trainer.train(loader)
            '''),
        "main.py": '''\
            import engine
            from tokens import Trainer


            def main():
                trainer = Trainer(100)
                trainer.train(["a.txt"])


            if __name__ == "__main__":
                main()
            '''})
    assert "tu.run" not in open(result.output).read()


def test_a_module_whose_only_news_are_notes_is_written_and_imported(tmp_path):
    """A static method steps `optimizer`, a name port saw made nowhere: the module changes
    in nothing, yet its note is listed, on the copy the ported entry imports."""
    result = _project(tmp_path, {"loops.py": STATIC.split("\n\n\n    def main")[0] + "\n", "main.py": '''\
        import torch
        from loops import Loop


        def main():
            model = torch.nn.Linear(4, 1).cuda()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            Loop.train(model, opt, loader)


        if __name__ == "__main__":
            main()
        '''})
    text = open(result.output).read()
    assert "from loops_tpu import Loop" in text and "    tu.run(main, cores=8)" in text.splitlines()
    [loops] = result.modules
    assert [w for w in _notes(loops) if w.startswith("`optimizer.step()` after backward()")]


# (c) ----------------------------------------------------------------------------------

def test_a_local_module_that_does_not_parse_is_named_with_its_line(tmp_path, capsys):
    (tmp_path / "train.py").write_text("import torch\nfrom model import Net\n\n\ndef main():\n"
                                       "    Net().cuda()\n\n\nif __name__ == '__main__':\n    main()\n")
    (tmp_path / "model.py").write_text("import torch\n\nclass Net(torch.nn.Module:\n    pass\n")
    assert main([str(tmp_path / "train.py")]) == 2
    said = capsys.readouterr().out.strip()
    assert "model.py, which train.py imports, does not parse (line 3: " in said, said
    assert "train.py does not parse" not in said and "Traceback" not in said
    assert said.endswith("then port train.py again") and "py_compile" in said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.py", "train.py"]
