"""What a Python module's source says: its loops, backward loops, functions, optimizer names,
the models an optimizer takes the parameters of and the calls that move a model. `port` and
`report()` (which names the lines behind its hints) both ask it, so the two cannot classify
the same line differently."""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Set, Tuple

from .magics import mask_magics

LOOPS = (ast.For, ast.AsyncFor, ast.While)
# Every spelling of torch's GradScaler seen in scripts: `port` swaps each for tu.GradScaler
# and `report()` names each as the cause of the scaler's per-step host reads.
GRAD_SCALERS = frozenset({"torch.cuda.amp.GradScaler", "torch.amp.GradScaler", "GradScaler",
                          "amp.GradScaler", "cuda.amp.GradScaler"})
HOST_READS = ("cpu", "numpy", "tolist")  # methods that copy a tensor to the host
# Constructors whose result is an optimizer (so `name.step()` is an optimizer step, not a
# scheduler's): torch.optim's, and the usual third-party ones.
OPTIMIZER = re.compile(r"(^|\.)optim\.\w+$|(^|\.)(SGD|Adam\w*|RMSprop|Adagrad|Adadelta|Adamax|"
                       r"NAdam|RAdam|LBFGS|Lion|LAMB|Lamb|Adafactor)$")
# `.to()` of one of these converts a module's parameters in place; it moves nothing
_DTYPE = re.compile(r"torch\.(b?float\d*|half|double|u?int\d*|long|short|bool|complex\d*)")


@dataclass
class ModuleFacts:
    """The facts `module_facts` finds in one tree (a module, or any node of one).

    "Inside a loop" means run on every iteration: in the loop's body, or a `while` test.
    A `for` header's iterable and a loop's `else` run once, so they are not inside it.
    """

    tree: ast.AST
    loops: List[ast.AST] = field(default_factory=list)
    backward_loops: List[ast.AST] = field(default_factory=list)  # they call .backward()
    # the loops of training steps: their own body, outside loops nested in it, runs
    # backward() or the optimizer step (an epoch loop around them is a backward loop only)
    step_loops: List[ast.AST] = field(default_factory=list)
    other_loops: List[ast.AST] = field(default_factory=list)
    ifs_in_loops: List[ast.If] = field(default_factory=list)  # in backward loops
    functions: Dict[str, ast.FunctionDef] = field(default_factory=dict)  # the tree's own
    optimizers: Set[str] = field(default_factory=set)  # names assigned an optimizer
    assigned_to: Dict[int, str] = field(default_factory=dict)  # id(value) -> `name = value`
    alone: Set[int] = field(default_factory=set)  # ids of statements alone in their block
    parents: Dict[int, Tuple[ast.AST, str]] = field(default_factory=dict)  # id -> (node, field)

    def ancestors(self, node) -> Iterator[Tuple[ast.AST, str]]:
        """(parent, the parent's field that holds the child), innermost first; none for a
        node that is not in the tree."""
        while id(node) in self.parents:
            parent, name = self.parents[id(node)]
            yield parent, name
            node = parent

    def loops_around(self, node) -> List[ast.AST]:
        """The loops that run `node` on each of their iterations, innermost first."""
        return [parent for parent, name in self.ancestors(node)
                if isinstance(parent, LOOPS) and name in ("body", "test")]

    def inside_loop(self, node, loops=None) -> bool:
        """Whether `node` runs on every iteration of a loop (of one of `loops`, if given).

        Example:
            >>> tree = ast.parse("for x in dl.tolist():\\n    total += x.item()\\n")
            >>> facts = module_facts(tree)
            >>> [(c.func.attr, facts.inside_loop(c)) for c in ast.walk(tree) if isinstance(c, ast.Call)]
            [('tolist', False), ('item', True)]
        """
        around = self.loops_around(node)
        return bool(around) if loops is None else any(loop in loops for loop in around)

    def under_if_in_loop(self, node) -> bool:
        """Whether an `if` inside a backward loop holds `node`: a log point, not every step."""
        return any(isinstance(parent, ast.If) and parent in self.ifs_in_loops
                   for parent, _ in self.ancestors(node))


def module_facts(tree: ast.AST) -> ModuleFacts:
    """The facts about `tree`, found in one walk and kept for every question after.

    Example:
        >>> tree = ast.parse("opt = torch.optim.SGD(ps)\\nfor x in dl:\\n    f(x).backward()\\n")
        >>> facts = module_facts(tree)
        >>> sorted(facts.optimizers), len(facts.backward_loops), len(facts.other_loops)
        (['opt'], 1, 0)
    """
    facts = ModuleFacts(tree)
    for parent in ast.walk(tree):
        for name, value in ast.iter_fields(parent):
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, ast.AST):
                    facts.parents[id(child)] = (parent, name)
            # removing a statement alone in its block leaves `pass`, not an empty block
            if name in ("body", "orelse", "finalbody") and isinstance(value, list) \
                    and len(value) == 1 and parent is not tree:
                facts.alone.add(id(value[0]))
    facts.loops = [n for n in ast.walk(tree) if isinstance(n, LOOPS)]
    facts.backward_loops = [n for n in facts.loops if calls(n, "backward")]
    facts.other_loops = [n for n in facts.loops if n not in facts.backward_loops]
    facts.ifs_in_loops = [i for loop in facts.backward_loops for i in ast.walk(loop)
                          if isinstance(i, ast.If)]
    facts.functions = top_functions(tree)
    _assignments(tree, facts)
    facts.step_loops = [n for n in facts.backward_loops if _steps_itself(n, facts.optimizers)]
    return facts


def _steps_itself(loop, optimizers: Set[str]) -> bool:
    """Whether `loop`'s body, outside the loops and functions nested in it, calls backward()
    or an optimizer's step."""
    todo = list(loop.body) + ([loop.test] if isinstance(loop, ast.While) else [])
    while todo:
        node = todo.pop()
        if isinstance(node, LOOPS + (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Call) and (method(node) == "backward" or dotted(node.func).endswith(
                "optimizer_step") or method(node) == "step" and dotted(node.func.value) in optimizers):
            return True
        todo += list(ast.iter_child_nodes(node))
    return False


def _assignments(tree, facts: ModuleFacts) -> None:
    # Optimizer names are read from the whole tree before any `.step()` is: a
    # `def train(model, optimizer)` usually comes before the `optimizer = ...` in main().
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            facts.assigned_to[id(node.value)] = node.targets[0].id
        if isinstance(node.value, ast.Call) and OPTIMIZER.search(dotted(node.value.func)):
            facts.optimizers.update(t.id for t in node.targets if isinstance(t, ast.Name))


def moves_to_device(call) -> bool:
    """Whether a call moves what it is called on to a device: `m.cuda()`, `m.to(device)`,
    `m.to(device=d)`; not a conversion (`m.to(torch.float16)`) nor `m.to("cpu")`.

    Example:
        >>> [moves_to_device(ast.parse(c).body[0].value) for c in ("m.to(dev)", "m.cuda(0)",
        ...  "m.to(torch.bfloat16)", "m.to(dtype=torch.half)", "m.to('cpu')")]
        [True, True, False, False, False]
    """
    if not isinstance(call, ast.Call) or method(call) not in ("cuda", "to"):
        return False
    if method(call) == "cuda":
        return True
    target = call.args[0] if call.args else next(
        (k.value for k in call.keywords if k.arg == "device"), None)
    return target is not None and not _DTYPE.fullmatch(dotted(target)) and \
        not (isinstance(target, ast.Constant) and target.value == "cpu")


def parameter_owners(call: ast.Call) -> Set[str]:
    """The objects whose parameters a call takes (an optimizer's construction), by name.

    Example:
        >>> sorted(parameter_owners(ast.parse(
        ...     "Adam([{'params': net.body.parameters()}, {'params': self.head.parameters()}])").body[0].value))
        ['net.body', 'self.head']
    """
    return {dotted(n.func.value) for n in ast.walk(call) if isinstance(n, ast.Call)
            and method(n) in ("parameters", "named_parameters") and dotted(n.func.value)}


def chains(node, store: bool = False) -> Set[str]:
    """The names and attribute chains that `node` reads (with `store`: binds), each whole:
    `self.model.to(dev)` reads `self.model.to` and `dev`, not `self` on its own.

    Example:
        >>> sorted(chains(ast.parse("self.net = wrap(self.net.to(dev), x[0].y)")))
        ['dev', 'self.net.to', 'wrap', 'x']
    """
    out: Set[str] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        name = dotted(n) if isinstance(n, (ast.Name, ast.Attribute)) else ""
        if not name:
            todo += list(ast.iter_child_nodes(n))
        elif isinstance(n.ctx, (ast.Store, ast.Del)) == store:
            out.add(name)
    return out


def run_nodes(stmt) -> Iterator[ast.AST]:
    """The nodes of `stmt` that run when it runs: not the bodies of the functions and
    lambdas defined in it."""
    todo = [stmt]
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo += list(ast.iter_child_nodes(node))


def costly_calls(source: str) -> List[Tuple[str, int, str]]:
    """(kind, line, code) for the calls that cost host transfers or compiles on a TPU:
    "item" (`.item()` in a loop), "cpu" (`.cpu()`, `.numpy()`, `.tolist()`, `.to("cpu")` in
    a loop), "save" (`torch.save`) and "scaler" (torch's GradScaler). `report()` names
    these lines next to the counts that show what they cost.

    Example:
        >>> costly_calls("for x, y in dl:\\n    total += loss(x, y).item()\\n")
        [('item', 2, 'loss(x, y).item()')]
    """
    source = mask_magics(source)
    tree = ast.parse(source)
    facts = module_facts(tree)
    found = {}  # (kind, line) -> code: the outermost call, as `x.to("cpu").numpy()`
    for node in ast.walk(tree):
        kind = _costly_kind(node, facts) if isinstance(node, ast.Call) else None
        code = kind and (ast.get_source_segment(source, node) or dotted(node.func))
        if kind and len(code) > len(found.get((kind, node.lineno), "")):
            found[kind, node.lineno] = code
    return sorted(((kind, line, code) for (kind, line), code in found.items()),
                  key=lambda f: f[1])


def _costly_kind(node: ast.Call, facts: ModuleFacts):
    name, attr = dotted(node.func), method(node)
    if name == "torch.save":
        return "save"
    if name in GRAD_SCALERS:
        return "scaler"
    if not facts.inside_loop(node):
        return None
    if attr == "item" and not node.args:
        return "item"
    to_cpu = attr == "to" and node.args and isinstance(node.args[0], ast.Constant) \
        and node.args[0].value == "cpu"
    return "cpu" if to_cpu or attr in HOST_READS and not node.args else None


def dotted(node) -> str:
    """'torch.cuda.amp.autocast' for that attribute chain; '' if it is not one."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def call_name(call) -> str:
    """The name a call is known by when it may train: its dotted name (`loops.train`,
    `Loop.train`), or `Trainer().train` for a method called on the instance a class's call
    makes (`Trainer(model, opt).train(loader)`); '' for any other call.

    Example:
        >>> [call_name(ast.parse(c).body[0].value) for c in ("t.fit(x)", "T(m, o).fit(x)", "f()(x)")]
        ['t.fit', 'T().fit', '']
    """
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call) and dotted(func.value.func):
        return f"{dotted(func.value.func)}().{func.attr}"
    return dotted(func)


def method(call) -> str:
    """'item' for `x.item()`; '' for a call of a plain name or of an expression."""
    return call.func.attr if isinstance(call.func, ast.Attribute) else ""


def calls(node, attr: str) -> bool:
    """Whether `node` holds a call of a method named `attr` (as `loss.backward()`)."""
    return any(isinstance(n, ast.Call) and method(n) == attr for n in ast.walk(node))


def top_functions(tree) -> Dict[str, ast.FunctionDef]:
    """The functions a module (or any node with a body) defines at its top level."""
    body = getattr(tree, "body", None)  # a lambda's body is one expression, not a list
    return {s.name: s for s in body if isinstance(s, ast.FunctionDef)} if isinstance(body, list) else {}
