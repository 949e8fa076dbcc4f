"""What a rule is, and what it works with. A rule looks at one kind of node (a call, an
`if`, an assignment, ...) or at the whole module (a pass after the walk), and makes its
swaps through `Context.edits` and its advisories through `Context.notes`; both record the
rule's id, so a test can tell which rule fired."""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Callable, List, Optional

from ..edits import Edits
from ..facts import ModuleFacts, dotted, method
from ..notes import Notes

DEVICE = "tu.get_device()"


@dataclass
class Context:
    """One piece of source being ported: its edits, notes and facts, the names bound to
    optimizers and the training functions (a notebook's cells share both), and where the
    walk is (`scopes`, the function definitions around it; `depth`, their nesting: device
    work at depth 0 runs before tu.run forks)."""

    edits: Edits
    notes: Notes
    facts: ModuleFacts
    optimizers: set = field(default_factory=set)
    train_fns: set = field(default_factory=set)
    scopes: List[ast.AST] = field(default_factory=list)
    depth: int = 0
    memo: dict = field(default_factory=dict)  # what a rule found once for the whole module
    init_moves: dict = field(default_factory=dict)  # class -> the arguments its __init__ moves
    class_optimizers: dict = field(default_factory=dict)  # class -> its optimizer attributes

    @classmethod
    def of(cls, lines: List[str], facts: ModuleFacts, **kw) -> "Context":
        edits = Edits(lines)
        return cls(edits, Notes(edits, facts), facts, **kw)

    def scope(self) -> ast.AST:
        """The innermost function definition around the walk, or the module."""
        return self.scopes[-1] if self.scopes else self.facts.tree

    def device(self, node, what: str, new: str = DEVICE) -> None:
        """`node` becomes the device; at the top level that starts the runtime: noted."""
        if self.edits.replace(node, new, what) and self.depth == 0:
            self.notes.top_level_device(node.lineno)

    def remove(self, stmt, what: str) -> bool:
        return self.edits.remove(stmt, what, alone=id(stmt) in self.facts.alone)


@dataclass(frozen=True)
class Rule:
    """One swap or advisory of port. `node`: the kind of node the rule looks at, each one
    the walk meets (ast.Module: one pass over the whole module after the walk; None: the
    wrap of a script's top-level training, which the pipeline runs before the walk). The
    first rule of the table whose `matches` is true for a node applies; the walk goes on
    into that node only if `inside`."""

    id: str  # "device.cuda-string", "loaders.dataloader"
    description: str  # one line: docs/porting.md's table is made from these
    node: Optional[type]
    matches: Callable[[Context, ast.AST], bool]
    apply: Callable[[Context, ast.AST], None]
    inside: bool = True


def called(*names: str) -> Callable[[Context, ast.AST], bool]:
    """A matcher of calls of the dotted `names` (`torch.save`)."""
    return lambda ctx, node: dotted(node.func) in names


def method_called(*attrs: str) -> Callable[[Context, ast.AST], bool]:
    """A matcher of calls of a method named one of `attrs` (`x.cuda()`)."""
    return lambda ctx, node: method(node) in attrs


def always(ctx: Context, node: ast.AST) -> bool:
    return True
