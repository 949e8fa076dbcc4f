"""`python -m tpu_utility port SCRIPT.py|NOTEBOOK.ipynb ...`: port each file, write it next
to the original, print the diff and what was left."""
from __future__ import annotations

import difflib
import json
import os
import re
import sys
from typing import List

from ..files import atomic_write
from .magics import mask_magics
from .notebook import add_import, code_lines, port_notebook
from .pipeline import PortResult, parse
from .project import local_modules, port_project, read_source, source_encoding

HELP = """\
usage: python -m tpu_utility port [--force] SCRIPT.py|NOTEBOOK.ipynb|PROJECT_FOLDER ...

Writes SCRIPT_tpu.py (or NOTEBOOK_tpu.ipynb) next to each file, which it never edits,
prints the diff, and lists by line what it could not do safely, with the fix. The local
modules a script imports are ported with it (MODULE_tpu.py); a folder is its one script
with an `if __name__ == "__main__":` guard. An output that exists and differs from what
port writes now is replaced only with --force; a read-only one never.

It swaps: the device for tu.get_device(); DataLoader(...) for tu.make_loader(...);
opt.step() for tu.optimizer_step(opt); autocast and GradScaler for tu's; torch.save for
tu.save; torch.cuda.synchronize() for tu.sync(). A manual update of p.data from p.grad
gets tu.average_gradients(...) before it, and a step no make_loader feeds ends with
tu.sync(). A model's .to(device) after its optimizer is made goes up, before it (on
XLA .to() makes new parameters). A script's training at the top level becomes a
function, train_fn, run on every core by tu.run(train_fn, cores=8).

Run the ported file with python as before. docs/porting.md has the details."""


def port(path: str, *, write: bool = True, force: bool = False) -> PortResult:
    """Port a .py script or a .ipynb notebook; write `<name>_tpu.<ext>` next to it.

    The original is never edited. A notebook is ported cell by cell (line numbers in the
    report count from each cell's first line, as "line M: cell N"). Nothing is written
    unless every file port would write compiles, and an output that exists and differs
    from what port writes now (edited by hand, or from another version of the original)
    is replaced only with `force=True`.
    A script with a coding line (`# -*- coding: latin-1 -*-`) is read as Python reads it,
    and its ported file is written in the same encoding, the line kept.

    Args:
        path: the script or notebook.
        write: whether to write the ported file (its path is then the result's `output`).
        force: replace outputs that exist and differ (the command's `--force`).

    Raises:
        ValueError: with one sentence, where `path` is not text in the encoding Python
            reads it in (UTF-8, or what its coding line says) or not a notebook, an output
            would not compile, or an output differs and `force` is False.

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
    base, ext = os.path.splitext(path)
    encoding = "utf-8"
    try:
        if ext == ".ipynb":  # JSON: UTF-8
            with open(path, encoding="utf-8-sig") as f:  # a BOM, which Python accepts, too
                original = f.read()
        else:  # as Python reads a script: its coding line, a BOM, else UTF-8
            encoding = source_encoding(path)
            original = read_source(path)
    except UnicodeDecodeError as e:
        text = "UTF-8 text" if encoding in ("utf-8", "utf-8-sig") else f"{encoding} text, as its coding line says"
        raise ValueError(f"port: {path} is not {text} (byte {e.start}): port reads Python "
                         f"scripts and notebooks; nothing written") from None
    except SyntaxError as e:  # a coding line naming no encoding Python knows
        raise ValueError(f"port: {path} cannot be read as Python reads it ({e.msg}); "
                         f"nothing written") from None
    if ext == ".ipynb":
        try:
            json.loads(original)
        except ValueError as e:
            raise ValueError(f"port: {path} is not a notebook: its JSON breaks at line "
                             f"{getattr(e, 'lineno', '?')} ({getattr(e, 'msg', e)}); nothing written") from None
        result = port_notebook(original)
    else:
        parse(original)  # a SyntaxError here is the file's own: the command says so
        try:
            result = port_project(path, original)
            for ported in [result] + result.modules:
                before, ported.text = ported.text, add_import(ported.text)
                if before != ported.text:  # the notes' lines below the import move down
                    ported.shift(after=_first_difference(before, ported.text))
        except SyntaxError as e:
            local_modules(path)  # a module beside it that does not parse is the user's too
            raise ValueError(f"port: its own output for {path} does not parse (line {e.lineno}: "
                             f"{e.msg}): the fault is port's, not your file's (which parses); "
                             f"nothing written: please report it with your file") from None
    result.output = f"{base}_tpu{ext}"
    outputs = [result] + result.modules
    for ported in outputs:
        _check_compiles(ported.text, ported.output, path)
    if write:
        data = {ported.output: _encoded(ported.text, ported.output) for ported in outputs}
        for ported in outputs:
            _check_replaceable(ported.output, data[ported.output], force)
        for ported in outputs:
            atomic_write(ported.output, lambda f, b=data[ported.output]: f.write(b))
    return result


def _first_difference(before: str, after: str) -> int:
    """How many lines `before` and `after` share at their start."""
    old, new = before.splitlines(), after.splitlines()
    return next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), len(old))


def _encoded(text: str, output: str) -> bytes:
    """A ported file's bytes: a script in the encoding its coding line declares (kept from
    the original, so it runs and reads as the original did), anything else UTF-8."""
    if output.endswith(".ipynb"):
        return text.encode("utf-8")
    import io
    import tokenize
    encoding = tokenize.detect_encoding(io.BytesIO(text.encode("utf-8")).readline)[0]
    return text.encode(encoding)


def _check_compiles(text: str, output: str, path: str) -> None:
    """Every file port writes compiles (a notebook: each code cell, IPython lines masked)."""
    sources = [text] if not output.endswith(".ipynb") else [
        mask_magics("".join(c["source"]) if isinstance(c["source"], list) else c["source"])
        for c in json.loads(text).get("cells", []) if c.get("cell_type") == "code"]
    for source in sources:
        try:
            compile(source, output, "exec")
        except SyntaxError as e:
            raise ValueError(f"port: what it would write as {output} does not compile (line "
                             f"{e.lineno}: {e.msg}), so nothing was written; this is port's "
                             f"fault: please report it with {path}") from None


def _check_replaceable(output: str, data: bytes, force: bool) -> None:
    """An output that exists is replaced only where it is what port writes, or with force."""
    if not os.path.isfile(output) or force:
        return
    with open(output, "rb") as f:
        if f.read() == data:
            return
    raise ValueError(f"port: {output} exists and differs from what port writes now (edited "
                     f"by hand, or ported from another version); nothing written: move it "
                     f"away, or pass --force to replace it")


def result_name(path: str) -> str:
    base, ext = os.path.splitext(path)
    return f"{base}_tpu{ext}"


def entry_scripts(folder: str) -> List[str]:
    """The scripts of `folder` that run as a program: a `__main__` guard (not ported ones)."""
    found = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py") and not name.endswith("_tpu.py"):
            try:
                text = read_source(os.path.join(folder, name))
            except (SyntaxError, UnicodeDecodeError):  # not a script Python could run
                continue
            if re.search(r"^if __name__ == ['\"]__main__['\"]\s*:", text, re.M):
                found.append(name)
    return found


def main(argv: List[str]) -> int:
    """The command: port each file, print the diff and the list; 0, or 2 on bad use."""
    if not argv or argv[0] in ("-h", "--help"):
        print(HELP if argv else HELP.split("\n\n")[0], file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    force = "--force" in argv
    for path in [a for a in argv if a != "--force"]:
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
        try:
            result = port(path, force=force)
        except SyntaxError as e:
            print(f"port: {path} does not parse (line {e.lineno}: {e.msg}); nothing written")
            return 2
        except ValueError as e:
            print(e)
            return 2
        except OSError as e:
            print(f"port: cannot write {e.filename or result_name(path)}: {e.strerror or e}; "
                  f"pick a folder it can write, or make the file writable")
            return 2
        if path.endswith(".ipynb"):
            with open(path, encoding="utf-8-sig") as f:
                before = f.read()
        else:
            before = read_source(path)
        print("".join(difflib.unified_diff(code_lines(before, path), code_lines(result.text, path),
                                           path, result.output)))
        print(f"wrote {result.output}: {result}")
        for module in result.modules:
            original = module.output[:-len("_tpu.py")] + ".py"
            print("".join(difflib.unified_diff(read_source(original).splitlines(keepends=True),
                                               module.text.splitlines(keepends=True),
                                               original, module.output)))
            print(f"wrote {module.output}: {module}")
    return 0
