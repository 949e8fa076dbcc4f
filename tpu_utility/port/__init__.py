"""`python -m tpu_utility port SCRIPT.py|NOTEBOOK.ipynb`: the swaps, done for you.

The standard library's `ast` finds what to change (with exact line and column spans) and
the edits are spliced into the original text, so comments, blank lines and formatting
stay as they were: an `ast.unparse` round trip would lose them, and a rewriting library
would be a dependency for what a few dozen lines do. Only swaps that cannot change what
the script computes are made; everything else is listed with its line and the fix.

The files: cli.py (the command, `port(path)`), project.py (a script with the local modules
it imports), notebook.py, magics.py (a cell's IPython lines), pipeline.py (`port_source`),
facts.py (what a script says, which `report()` asks too), edits.py, notes.py, wrap.py (a
script's top-level training into a function), and rules/, one table of rules by concern.
"""
from .cli import main, port
from .pipeline import PortResult, port_source

__all__ = ["main", "port", "port_source", "PortResult"]
