"""Issue 48: port's notes are true and findable. Host reads beyond `.item()` in a training
loop are listed where they sit, a logging round with its reads counted; a read in a loop
that runs backward() is never called evaluation; every note that quotes code names the
line that holds it; a wrapped script's notes name the ported file's line too."""
import ast
import re
import textwrap
from pathlib import Path

from test_port_rules import CASES

from tpu_utility.port import port, port_source

ROOT = Path(__file__).resolve().parents[1]

TRAIN = textwrap.dedent("""\
    import torch


    def train(model, loader, optimizer, writer, epochs):
        for epoch in range(epochs):
            for step, (x, y) in enumerate(loader):
                loss = model(x, y)
                loss.backward()
                optimizer.step()
                writer.add_scalar('loss', loss, step)
                print('%.3f' % loss, f"{loss:.3f}", float(loss))
                if torch.isinf(loss).any():
                    print("inf")
                if step % 100 == 0:
                    for name, value in model.named_parameters():
                        writer.add_histogram(name, value.data.cpu().numpy(), step)
                        writer.add_histogram(name + '/grad', value.grad.data.cpu().numpy(), step)
                    print(loss.item(), loss.detach().cpu())
            print(loss.item())
    """)


def test_host_reads_beyond_item_are_listed_where_they_sit():
    result = port_source(TRAIN)
    notes = {}
    for line, what in result.todo:
        notes.setdefault(line, []).append(what)
    every_step = {line: [w.split("`")[1] for w in whats if "every training step" in w]
                  for line, whats in notes.items()}
    assert every_step[10] == ["writer.add_scalar('loss', loss, step)"]
    assert every_step[11] == ["'%.3f' % loss", 'f"{loss:.3f}"', "float(loss)"]
    assert every_step[12] == ["torch.isinf(loss).any()"]
    # the logging round: each read, and one note with their count per run
    assert any("`value.data.cpu().numpy()` reads the device once per parameter each time the "
               "logging round at line 14 runs" in w for w in notes[16])
    assert any("`value.grad.data.cpu().numpy()` reads the device once per parameter" in w
               for w in notes[17])
    # the round's loss.item(), the usual log point, is counted in the round, not listed
    assert [w.split("`")[1] for w in notes[18]] == ["loss.detach().cpu()"]
    [total] = notes[14]
    assert "reads the device 2 per parameter + 2 times each run (lines 16, 17, 18)" in total
    assert 19 not in notes  # once an epoch: not a per-step cost


def test_a_read_in_a_loop_that_runs_backward_is_never_called_evaluation():
    result = port_source(TRAIN)
    assert not [n for n in result.todo if "evaluation" in n[1]], result.todo
    # a loop of its own that runs no backward() still is evaluation
    evaluated = port_source("def valid(model, loader):\n    for x in loader:\n"
                            "        out = model(x).cpu().numpy()\n")
    assert [line for line, w in evaluated.todo if "evaluation" in w] == [3]


def _sources():
    """(name, source, script) of every script the port tests port: the rule cases, the
    corpus scripts and this file's own."""
    yield from ((c.rule, textwrap.dedent(c.before), c.script) for c in CASES)
    for path in sorted((ROOT / "tests" / "port_corpus").rglob("*.py")):
        yield path.name, path.read_text(), path.name != "config.py"
    yield "train", TRAIN, True


def test_every_note_that_quotes_code_names_the_line_that_holds_it():
    checked = 0
    for name, source, script in _sources():
        lines = source.splitlines()
        for line, what in port_source(source, script=script).todo:
            if not what.startswith("`"):
                continue  # a note about the line, quoting no code of it
            quoted = what.split("`")[1].splitlines()[0]
            assert quoted in lines[line - 1], (name, line, lines[line - 1], what)
            checked += 1
    assert checked >= 20


def test_a_wrapped_scripts_notes_name_the_ported_files_lines(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import torch
        import torch.nn as nn

        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            loss = model(torch.ones(2)).sum()
            loss.backward()
            opt.step()
            print(loss.item())
        """))
    result = port(str(script))
    ported = Path(result.output).read_text().splitlines()
    said = str(result)
    [(ported_line, original_line)] = [
        (int(a), int(b)) for a, b in re.findall(r"train_tpu\.py:(\d+), original line (\d+): `loss\.item\(\)`", said)]
    assert original_line == 10 and "loss.item()" in ported[ported_line - 1], (said, ported)
    for (line, what), at in zip(result.todo, result.ported_lines):
        if what.startswith("`"):
            assert what.split("`")[1] in ported[at - 1], (what, at)
    ast.parse("\n".join(ported))
