"""IPython syntax in a notebook cell (`!cmd`, `%magic`, `%%cell`) masked so that `ast`
parses the cell: port reads cells as Python, and writes the magics back as they were."""
from __future__ import annotations

import re


def mask_magics(source: str) -> str:
    """A notebook cell's IPython lines (`!cmd`, `%magic`, `%%cell`) become `pass` lines ast
    parses; every other line is left as it is.

    A line is IPython syntax only where IPython reads it so: at the start of a statement,
    so never inside brackets, a string or after a backslash continuation. A `% (a, b))`
    that continues a `print("%.4f"` is Python's `%` operator. Source that Python parses
    comes back unchanged.

    Example:
        >>> print(mask_magics("%matplotlib inline\\nprint('%d'\\n      % 3)\\n"), end="")
        pass
        print('%d'
              % 3)
    """
    out = []
    depth, quote, continued = 0, "", False  # brackets open, the string open, a trailing `\`
    for line in re.findall(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$", source):  # ast's line breaks
        stripped = line.lstrip()
        if not depth and not quote and not continued and stripped[:1] in ("!", "%"):
            out.append(line[:len(line) - len(stripped)] + "pass" + ("\n" if line.endswith("\n") else ""))
            continue
        out.append(line)
        depth, quote, continued = _scan(line, depth, quote)
    return "".join(out)


def _scan(line: str, depth: int, quote: str):
    """(brackets open, string open, ends in a continuation) after `line`, from the state
    before it: the little of Python's tokenizer that says where a statement may start."""
    i, n = 0, len(line)
    while i < n:
        c = line[i]
        if quote:
            if c == "\\":
                i += 2
                continue
            if line.startswith(quote, i):
                i += len(quote)
                quote = ""
                continue
        elif c == "#":
            return depth, quote, False
        elif c in "\"'":
            quote = line[i:i + 3] if line[i:i + 3] in ('"""', "'''") else c
            i += len(quote)
            continue
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth = max(0, depth - 1)
        i += 1
    body = line.rstrip("\r\n")
    if quote in ("'", '"'):  # a one-line string goes on only after an escaped newline
        return depth, quote if body.endswith("\\") else "", False
    return depth, quote, not quote and body.endswith("\\")
