"""The text edits: spans of the original source (1-based lines, 0-based utf-8 byte columns,
as `ast` gives them) and what goes there, spliced in at the end. Splicing keeps comments,
blank lines and layout, which an `ast.unparse` round trip would lose. Each swap made is
recorded with the id of the rule that made it."""
from __future__ import annotations

import ast
import re
from typing import List, Tuple


_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$")


def split_lines(text: str) -> List[str]:
    """`text`'s lines, with their ends, where Python's parser breaks them (\\n, \\r\\n,
    \\r): not at a form feed or the other breaks `str.splitlines` also takes, or the
    spans `ast` gives would land on the wrong lines."""
    return _LINE.findall(text)


def span(node) -> Tuple[int, int, int, int]:
    return (node.lineno, node.col_offset, node.end_lineno, node.end_col_offset)


def inside(inner, outer) -> bool:
    return (inner[0], inner[1]) >= (outer[0], outer[1]) and \
        (inner[2], inner[3]) <= (outer[2], outer[3])


def output_line(edits, line: int) -> int:
    """The line of the spliced text where line `line` of the source lands."""
    out = line
    for start, col, end, end_col, new in edits:
        if start < line and end <= line or (start, col, end, end_col) == (line, 0, line, 0):
            out += new.count("\n") - (end - start)
    return out


def apply(source: str, edits) -> str:
    """Splice the edits ((line, col, end_line, end_col, new), as `span`) into source."""
    lines = split_lines(source)
    for line, col, end_line, end_col, new in sorted(edits, reverse=True):
        head = lines[line - 1].encode()[:col].decode()
        tail = lines[end_line - 1].encode()[end_col:].decode()
        lines[line - 1:end_line] = [head + new + tail]
    return "".join(lines)


class Edits:
    """The spans spliced into the source and the swaps they make; a span inside one already
    replaced is left alone, so a rule that matches inside another's result does nothing.
    `rule` is the id of the rule at work (set by the rules' walk), recorded with each swap."""

    def __init__(self, lines: List[str]):
        self.lines = lines
        self.text = "".join(lines)
        self.edits: List[Tuple[int, int, int, int, str]] = []
        self.edit_rules: dict = {}  # each of `edits` -> the id of the rule that made it
        self.deleted: dict = {}  # id(statement) -> the edit that deletes its lines
        self.swaps: List[Tuple[int, str]] = []
        self.swap_rules: List[str] = []  # the rule id of each of `swaps`
        self.replaced: set = set()
        self.rule = ""

    def add(self, edit: Tuple[int, int, int, int, str]) -> None:
        """One splice, recorded with the rule at work."""
        self.edits.append(edit)
        self.edit_rules.setdefault(edit, self.rule)

    def source(self, node) -> str:
        return ast.get_source_segment(self.text, node)

    def swap(self, line: int, what: str) -> None:
        self.swaps.append((line, what))
        self.swap_rules.append(self.rule)

    def taken(self, node, where=None) -> bool:
        return any(inside(where or span(node), done) for done in self.replaced)

    def replace(self, node, new: str, what: str, where=None) -> bool:
        where = where or span(node)
        if self.taken(node, where):
            return False
        self.replaced.add(where)
        self.add((*where, new))
        self.swap(node.lineno, what)
        return True

    def owns_lines(self, stmt) -> bool:
        """Whether no other code shares a line with `stmt` (a comment after it may)."""
        first, last = self.lines[stmt.lineno - 1], self.lines[stmt.end_lineno - 1]
        return not (first.encode()[:stmt.col_offset].strip() or
                    last.encode()[stmt.end_col_offset:].split(b"#")[0].strip())

    def lines_end(self, last: int) -> Tuple[int, int]:
        """Where deleting whole lines up to line `last` ends: the next line's start."""
        return (last + 1, 0) if last < len(self.lines) else (last, len(self.lines[-1].encode()))

    def remove(self, stmt, what: str, alone: bool) -> bool:
        """Delete a statement's lines; `pass` where it is `alone` in its block or shares a line
        (`fill_emptied` puts `pass` where deletions empty a block of several)."""
        if alone or not self.owns_lines(stmt):
            return self.replace(stmt, "pass", what)
        if not self.replace(stmt, "", what, where=(stmt.lineno, 0, *self.lines_end(stmt.end_lineno))):
            return False
        self.deleted[id(stmt)] = self.edits[-1]
        return True

    def fill_emptied(self, blocks) -> None:
        """`pass` for each of `blocks` (statement lists) whose every statement was deleted:
        rule `distributed.wrapper-line` deleting the three `x = nn.DataParallel(x)` lines
        under `if FLAGS.parallel:` must not leave the `if` without a body."""
        for block in blocks:
            if all(self.deleted.get(id(stmt)) in self.edits for stmt in block):
                first = block[0]
                old = self.deleted[id(first)]
                indent = self.lines[first.lineno - 1].encode()[:first.col_offset].decode()
                new = (*old[:4], f"{indent}pass\n")
                self.edits[self.edits.index(old)] = new
                self.edit_rules[new] = self.edit_rules[old]

    def insert_line(self, stmt, code: str, before: bool) -> bool:
        """`code` on a line of its own before or after `stmt`, at its indentation; False
        where `stmt` shares its line with other code (`with torch.no_grad(): w -= ...`)."""
        lines = self.lines
        indent = lines[stmt.lineno - 1].encode()[:stmt.col_offset].decode()
        after = lines[stmt.end_lineno - 1].encode()[stmt.end_col_offset:].decode()
        if indent.strip() or after.split("#")[0].strip():
            return False
        if before:
            self.add((stmt.lineno, 0, stmt.lineno, 0, f"{indent}{code}\n"))
        elif stmt.end_lineno < len(lines):
            self.add((stmt.end_lineno + 1, 0, stmt.end_lineno + 1, 0, f"{indent}{code}\n"))
        else:
            end = len(lines[-1].encode())
            self.add((stmt.end_lineno, end, stmt.end_lineno, end,
                               ("" if lines[-1].endswith("\n") else "\n") + f"{indent}{code}\n"))
        return True

    def rewrite_call(self, node, func: str, dropped: list, added: str) -> None:
        """The callee becomes `func`, the `dropped` arguments go with their commas and
        `added` is appended: small edits, so a call laid out over lines keeps its layout
        and comments. The call's span is not taken: its arguments may still be swapped."""
        arguments = sorted(node.args + node.keywords, key=lambda a: (a.lineno, a.col_offset))
        kept = [a for a in arguments if a not in dropped]
        self.add((*span(node.func), func))
        i = 0
        while i < len(arguments):  # each run of dropped arguments goes with its commas
            if arguments[i] in kept:
                i += 1
                continue
            j = i
            while j + 1 < len(arguments) and arguments[j + 1] not in kept:
                j += 1
            if j + 1 < len(arguments):  # up to the next kept argument
                cut = (*span(arguments[i])[:2], arguments[j + 1].lineno, arguments[j + 1].col_offset)
            elif i > 0:  # the last ones: from the end of the kept one before
                cut = (*span(arguments[i - 1])[2:], *span(arguments[j])[2:])
            else:
                cut = (*span(arguments[i])[:2], *span(arguments[j])[2:])
            self.add((*cut, ""))
            i = j + 1
        if added:
            end = span(kept[-1])[2:] if kept else span(node)[2:]
            self.add((*end, *end, f", {added}" if kept else added))
