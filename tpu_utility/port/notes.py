"""What needs a person, by line: every advisory port gives, each recorded with the id of
the rule that gave it. The texts that more than one rule gives live here."""
from __future__ import annotations

from typing import List, Tuple

from .edits import Edits, inside, span
from .facts import HOST_READS, ModuleFacts
from .sites import read_site, times


class Notes:
    """The advisories of one piece of source. `edits.rule` names the rule at work."""

    def __init__(self, edits: Edits, facts: ModuleFacts):
        self.edits = edits
        self.facts = facts
        self.todo: List[Tuple[int, str]] = []
        self.rules: List[str] = []  # the rule id of each of `todo`
        self.fixes: List[list] = []  # each note's fix, where it is code: [(span, code)]
        self.noted_loops: set = set()  # evaluation loops whose host reads are listed
        self.reads: list = []  # the spans of the training-loop host reads listed
        self.rounds: dict = {}  # id(if) -> (the if, [(line, code, how often)]): logging rounds

    def add(self, line: int, what: str, fix=()) -> None:
        """A note on `line`; `fix`, where the fix is code: (node, the code for it) pairs."""
        self.todo.append((line, what))
        self.rules.append(self.edits.rule)
        self.fixes.append([(span(node), code) for node, code in fix])

    def top_level_device(self, line: int) -> None:
        self.add(line, "the device is chosen at the top level, which starts the XLA runtime "
                 "in this process: run(cores=8) then refuses; call tu.get_device() inside "
                 "the training function instead")

    def top_level_move(self, line: int, attr: str) -> None:
        call = ".cuda()" if attr == "cuda" else '.to("cuda")'
        self.add(line, f"`{call}` at the top level was removed: tensors stay on the CPU "
                 f"(make_loader moves each batch to the device); move a model inside the "
                 f"training function, with .to(tu.get_device())")

    def device_from_setting(self, node) -> None:
        self.add(node.lineno, f"`{self.edits.source(node)}` takes the device from a setting: "
                 f"where it names cuda, use tu.get_device()", fix=[(node, "tu.get_device()")])

    def host_read(self, node, attr: str) -> None:
        """A tensor read on the host in a loop: every training step, or batch by batch in
        an evaluation loop (where under engine="launch" each replica sees only its own share)."""
        if node.args:
            return
        facts, code = self.facts, self.edits.source(node)
        if attr == "item" and facts.inside_loop(node, facts.step_loops) and \
                facts.under_if_in_loop(node):  # under an `if`: a log point, not every step
            self.training_read(node, quiet=True)
        elif attr == "item" and facts.inside_loop(node, facts.step_loops):
            self.add(node.lineno, f"`{code}` reads the device every step (a host transfer): "
                     f"sum on the device and read once per epoch")
        elif attr in HOST_READS and facts.inside_loop(node, facts.backward_loops):
            # a loop that runs backward() trains: `value.data.cpu()` for a histogram there is
            # a read of the training loop, not evaluation
            self.training_read(node)
        elif attr in HOST_READS and facts.inside_loop(node, facts.other_loops) and \
                self._first_read_in_loop(node):
            self.add(node.lineno, f"`{code}` collects evaluation results on the host batch by "
                     f"batch: each read waits for the device, and at cores=8 (SPMD) compiles "
                     f"a program that gathers the split batch (with engine='launch', each "
                     f"replica has only its own share); collect on the device and use "
                     f"tu.gather(torch.cat(outputs), loader), then tu.to_cpu once")
        elif attr == "item" and facts.inside_loop(node, facts.other_loops):
            self.add(node.lineno, f"`{code}` sums an evaluation batch by batch: a host "
                     f"transfer each (and with engine='launch', each replica sums only its "
                     f"own share of the data); collect the outputs and targets and use "
                     f"tu.gather(torch.cat(outputs), loader), then read once")

    def training_read(self, node, quiet: bool = False) -> None:
        """A host read in a step loop (`float(loss)`, `'%.3f' % loss`, `x.cpu()`): listed
        where it runs every step, and where it runs in a logging round (one note a line).
        `quiet`: a logging round's `loss.item()`, the usual log point: counted in its
        round's note, not listed on its own (a round of only such reads gets no note)."""
        site, round_if = read_site(self.facts, node)
        if not site or any(inside(span(node), done) for done in self.reads):
            return  # `x.cpu()` of `x.cpu().numpy()`: one read, listed once
        self.reads.append(span(node))
        code = self.edits.source(node)
        if site == "step":
            self.add(node.lineno, f"`{code}` reads the device every training step (a host "
                     f"transfer that waits for the step): keep it on the device, read once "
                     f"per epoch or under a logging `if`")
            return
        often = times(self.facts, node, round_if)
        self.rounds.setdefault(id(round_if), (round_if, []))[1].append((node.lineno, quiet, often))
        if not quiet:
                self.add(node.lineno, f"`{code}` reads the device {often + ' ' if often else ''}"
                     f"each time the logging round at line {round_if.lineno} runs (a host "
                     f"transfer that waits for the step)")

    def round_totals(self) -> None:
        """One note per logging round: its host reads, counted per run where countable."""
        for round_if, reads in self.rounds.values():
            if all(quiet for _, quiet, _ in reads):
                continue
            fixed = sum(int(o.split()[0]) if o and o.split()[0].isdigit() else 1
                        for _, _, o in reads if " per " not in o)
            per = sorted({o.split(" per ", 1)[1] for _, _, o in reads if " per " in o})
            count = " + ".join([
                f"{sum(1 for _, _, o in reads if o.endswith(' per ' + p))} per {p}" for p in per]
                + [str(fixed)] * bool(fixed))
            lines = ", ".join(str(line) for line in sorted({line for line, _, _ in reads}))
            self.add(round_if.lineno, f"this logging round reads the device {count} times "
                     f"each run (lines {lines}); each read waits for the device: run it less "
                     f"often, or stack the values on the device and read them once with "
                     f"tu.to_cpu")

    def _first_read_in_loop(self, node) -> bool:
        """One note per evaluation loop: `x.cpu().numpy()` and its neighbours are one fix."""
        loop = next(n for n in self.facts.loops_around(node) if n in self.facts.other_loops)
        if loop in self.noted_loops:
            return False
        self.noted_loops.add(loop)
        return True
