"""`python -m tpu_utility port SCRIPT.py|NOTEBOOK.ipynb ...`: port each file, write it next
to the original, print the diff and what was left."""
from __future__ import annotations

import difflib
import os
import re
import sys
from typing import List

from ..files import atomic_write
from .notebook import add_import, code_lines, port_notebook
from .pipeline import PortResult
from .project import port_project

HELP = """\
usage: python -m tpu_utility port SCRIPT.py|NOTEBOOK.ipynb|PROJECT_FOLDER ...

Writes SCRIPT_tpu.py (or NOTEBOOK_tpu.ipynb) next to each file, which it never edits,
prints the diff, and lists by line what it could not do safely, with the fix. The local
modules a script imports are ported with it (MODULE_tpu.py); a folder is its one script
with an `if __name__ == "__main__":` guard.

It swaps: the device for tu.get_device(); DataLoader(...) for tu.make_loader(...);
opt.step() for tu.optimizer_step(opt); autocast and GradScaler for tu's; torch.save for
tu.save; torch.cuda.synchronize() for tu.sync(). A manual update of p.data from p.grad
gets tu.average_gradients(...) before it, and a step no make_loader feeds ends with
tu.sync(). A model's .to(device) after its optimizer is made goes up, before it (on
XLA .to() makes new parameters). A script's training at the top level becomes a
function, train_fn, run on every core by tu.run(train_fn, cores=8).

Run the ported file with python as before. docs/porting.md has the details."""


def port(path: str, *, write: bool = True) -> PortResult:
    """Port a .py script or a .ipynb notebook; write `<name>_tpu.<ext>` next to it.

    The original is never edited. A notebook is ported cell by cell (line numbers in the
    report count from each cell's first line, as "line M: cell N").

    Args:
        path: the script or notebook.
        write: whether to write the ported file (its path is then the result's `output`).

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "train.py")
        >>> _ = open(path, "w").write("import torch\\ndef ones():\\n    return torch.ones(2).cuda()\\n")
        >>> print(open(port(path).output).read())
        import torch
        import tpu_utility as tu
        def ones():
            return torch.ones(2).to(tu.get_device())
        <BLANKLINE>
    """
    with open(path, encoding="utf-8") as f:
        original = f.read()
    base, ext = os.path.splitext(path)
    if ext == ".ipynb":
        result = port_notebook(original)
    else:
        result = port_project(path, original)
        for ported in [result] + result.modules:
            ported.text = add_import(ported.text)
    if write:
        result.output = f"{base}_tpu{ext}"
        for ported in [result] + result.modules:
            atomic_write(ported.output, lambda f, text=ported.text: f.write(text.encode("utf-8")))
    return result


def entry_scripts(folder: str) -> List[str]:
    """The scripts of `folder` that run as a program: a `__main__` guard (not ported ones)."""
    found = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py") and not name.endswith("_tpu.py"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                text = f.read()
            if re.search(r"^if __name__ == ['\"]__main__['\"]\s*:", text, re.M):
                found.append(name)
    return found


def main(argv: List[str]) -> int:
    """The command: port each file, print the diff and the list; 0, or 2 on bad use."""
    if not argv or argv[0] in ("-h", "--help"):
        print(HELP if argv else HELP.split("\n\n")[0], file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    for path in argv:
        if os.path.isdir(path):  # a project: its one entry script, with its modules
            entries = entry_scripts(path)
            if len(entries) != 1:
                print(f"port: {path} has {len(entries)} scripts with an `if __name__ == "
                      f"\"__main__\":` guard ({', '.join(entries) or 'none'}): name the one "
                      f"to port, as `port {os.path.join(path, 'main.py')}`")
                return 2
            path = os.path.join(path, entries[0])
        if not os.path.isfile(path) or os.path.splitext(path)[1] not in (".py", ".ipynb"):
            print(f"port: {path} is not a .py or .ipynb file, nor a folder of one project")
            return 2
        with open(path, encoding="utf-8") as f:
            before = f.read()
        try:
            result = port(path)
        except SyntaxError as e:
            print(f"port: {path} does not parse (line {e.lineno}: {e.msg}); nothing written")
            return 2
        print("".join(difflib.unified_diff(code_lines(before, path), code_lines(result.text, path),
                                           path, result.output)))
        print(f"wrote {result.output}: {result}")
        for module in result.modules:
            original = module.output[:-len("_tpu.py")] + ".py"
            with open(original, encoding="utf-8") as f:
                print("".join(difflib.unified_diff(f.read().splitlines(keepends=True),
                                                   module.text.splitlines(keepends=True),
                                                   original, module.output)))
            print(f"wrote {module.output}: {module}")
    return 0
