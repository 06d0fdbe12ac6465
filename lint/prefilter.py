"""Second-stage pre-filter: CPython's ``ast`` tree of a file decides whether libcst must see it.

The textual pre-filter (``RuleSet.may_match``) passes files that merely mention a trigger word; this one
sends a file to the libcst check only when its tree holds something a rule could report.
"""
# It may over-approximate (send a file that ends up clean), never drop one with findings (the prefilter
# tests run the engine with and without it).
# What each rule needs to report, and what is looked for here:
# - call/positional/value contracts: a callee that resolves to a target. The resolver only follows
#   names, attributes, imports (with aliases) and instances made by a target's constructor, so a call
#   whose callee's last name is the target's short name (``TABLE[key](...)``: the table's), or an
#   import of the target under another name.
# - instance targets (nothing checks their construction): a call of what a construction in the file
#   was assigned to (``self.attn = VisionAttention(...)`` ... ``self.attn(...)``, ``.forward`` too) or
#   of the construction itself, that does not pass one keyword group of each contract whole (not None,
#   no splats); an instance target imported under another name sends the file.
# - dataclasses.replace(..., max_len=None, ...): a keyword named like a field of such a contract
#   (the callee is not looked at, so an aliased replace is covered).
# - GL104: .item()/.tolist() without arguments, or int(...) of one argument, whose expression reads a
#   sequence-length name, under a per-layer forward or a loop over layers (host_sync's contexts); or
#   whose value may derive from one in its function (``spans = cu_seqlens[1:] - ...``: the value
#   model's derivations, through the same operations, over every binding of the function in any order).
# A guard decorator only removes findings, so a file without any of the above has none either way.
from __future__ import annotations

import ast
import bisect
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from guardlint.contracts.catalog import HOST_SUFFIXES

from .registries import may_register, registered
from .patterns import (CASTS, CONTAINER_METHODS, DECLARED_CONTAINERS, DECLARED_HOST_TYPES, KEEP_BUILTINS, KEEP_METHODS,
                       LAYER_LOOP_NAME, MOVE_METHODS, PATTERNS, SAME_TENSOR_ATTRS, SYNC_METHODS, TORCH_COPIES,
                       TORCH_JOIN, TORCH_KEEP, is_layer_class, is_seqlen_name)
from .rules import RuleSet

HOST_SYNC = "GL104"


@dataclass(frozen=True)
class TreeFilter:
    """``names``: short names of targets; ``fields``: keywords of ``replace`` calls that can empty a
    contract; ``host_sync``: GL104 is selected; ``opaque``: a pattern rule this filter does not know
    (its files always go to libcst)."""

    names: frozenset
    fields: frozenset
    host_sync: bool
    opaque: bool
    # Short names of instance targets (nothing checks their construction) -> the keyword groups that
    # satisfy each of their contracts: only a call of an instance made in the file, passing none of
    # one contract's groups, can be reported.
    instances: tuple = ()

    @classmethod
    def from_rules(cls, rules: RuleSet) -> "TreeFilter":
        def short(q: str) -> str:
            return q.rsplit(".", 1)[-1].removesuffix("[]")

        names = {short(q) for q in (*rules.by_callee, *rules.by_instance)}
        fields = {n.split(".", 1)[0] for c in rules.replace_contracts for g in c.require for n in g}
        codes = {c.code for c in rules.patterns}
        callees = {short(q) for q in rules.by_callee}
        needs: dict[str, list] = {}
        for qual, contracts in rules.by_instance.items():
            name = short(qual)
            if name in callees or any(c.kind != "call" for c in contracts):
                continue
            # A contract counts as satisfied only by keywords it names whole (an attribute path such
            # as forward_metadata.packed_indptrs depends on how the value was built). One that applies
            # only when some arguments are passed (``when_passed``) is skipped for a call that passes
            # one of them neither by keyword nor at its position.
            qual = rules.canonical.get(qual, qual)
            for c in contracts:
                target = c.target(qual)
                params = c.params_for(qual)
                when = tuple((n, params.index(n) if n in params else None)
                             for n in (target.when_passed if target is not None else ()))
                groups = tuple(frozenset(g) for g in c.require if not any("." in n for n in g))
                needs.setdefault(name, []).append((groups, when))
        instances = tuple((name, tuple(groups)) for name, groups in sorted(needs.items()))
        return cls(frozenset(names - set(needs)), frozenset(fields), HOST_SYNC in codes,
                   bool(codes - {HOST_SYNC}), instances)

    def may_report(self, tree: ast.AST, data: bytes) -> bool:
        """False only when no rule can report anything in the file whose tree is ``tree``."""
        return self.may_report_bodies(lambda: (getattr(tree, "body", ()),), data)

    def may_report_bodies(self, bodies: Callable[[], Iterable], data: bytes) -> bool:
        """``may_report`` for a module given as consecutive runs of its top-level statements (a large
        file checked in chunks, ``chunks.py``): each call of ``bodies()`` yields the runs in order, and
        a pass over them is a pass over the module's body. Line numbers are the file's."""
        if self.opaque:
            return True
        # Only what the bytes mention can be in the tree, and only on the lines that mention it: the
        # walk goes down only into statements that span such a line (a full walk of every tree cost as
        # much as parsing it).
        names = {n for n in self.names if n.encode() in data}
        fields = {n for n in self.fields if n.encode() in data} if b"replace" in data else set()
        host_sync = self.host_sync and any(n in data for n in PATTERNS[HOST_SYNC].needles)
        instances = {n: groups for n, groups in self.instances if n.encode() in data}
        if not (names or fields or host_sync or instances):
            return False
        words = [*names, *instances, *fields, *(("replace",) if fields else ())]
        scan = _Scan(names, fields, host_sync, _lines_of(data, words),
                     _lines_of(data, _READ_WORDS) if host_sync else [], instances)
        scan.data = data
        if host_sync and may_register(data):
            scan.registered = registered(ast.Module(body=[s for body in bodies() for s in body], type_ignores=[]))
        if any(scan.block(body, False, None) for body in bodies()):
            return True
        if scan.replace_calls and any(
                f.attr == "replace" if type(f) is ast.Attribute else f.id in scan.replace_names
                for f in scan.replace_calls):
            return True
        if scan.made:
            # Calls of what the constructions were assigned to (``self.attn(...)``, ``attn.forward(...)``).
            calls = _Scan(set(), set(), False, _lines_of(data, scan.made), [], instances)
            calls.made_names = scan.made
            if any(calls.block(body, False, None) for body in bodies()):
                return True
        if scan.helpers:
            # A module-level helper that reads the host makes its callers suspects too (host_sync).
            helpers = scan.helpers
            scan = _Scan(set(), set(), False, [], _lines_of(data, helpers))
            scan.helper_names = helpers
            return any(scan.block(body, False, None) for body in bodies())
        return False


# Attribute and function names of the calls GL104's visitor looks at (``_host_read``), and the keywords
# of the tests it looks at (an ``if`` statement spans the line of its keyword).
_READ_WORDS = ("item", "tolist", "cpu", "any", "all", "int", "bool", "float", "if", "elif", "while")
_LINE_BREAK = re.compile(rb"\r\n|\r|\n")


def _lines_of(data: bytes, words) -> list[int]:
    """Sorted numbers of the lines (as CPython counts them) where one of ``words`` occurs as a word."""
    if not words:
        return []
    # The rest of the line is part of a match: one match a line at most, however common the words.
    pattern = re.compile(rb"\b(?:" + b"|".join(re.escape(w.encode()) for w in sorted(set(words))) + rb")\b[^\r\n]*")
    offsets = [m.start() for m in pattern.finditer(data)]
    if not offsets:
        return []
    if b"\r" in data:  # \r alone ends a line too
        breaks = [m.end() for m in _LINE_BREAK.finditer(data)]
        return sorted({bisect.bisect_right(breaks, o) + 1 for o in offsets})
    lines, line, at = [], 1, 0
    for o in offsets:
        line += data.count(b"\n", at, o)
        at = o
        lines.append(line)
    return lines


class _Scan:
    """One descent through the statements that span a line of interest, in per-layer context order."""

    def __init__(self, names: set, fields: set, host_sync: bool, name_lines: list[int], read_lines: list[int],
                 instances: Optional[dict] = None):
        self.names = names
        self.instances = instances or {}  # instance target -> keyword groups per contract
        # Names and attributes a construction of an instance target is assigned to -> those targets.
        self.made: dict[str, set] = {}
        self.made_names: dict[str, set] = {}  # in the second pass: the same
        self.fields = fields
        self.host_sync = host_sync
        # Lines naming a target or a field (looked at everywhere), and lines of host reads and tests
        # (looked at only where they can be reported: per-layer code and module-level helpers).
        self.name_lines = name_lines
        self.read_lines = read_lines
        self.replace_calls: list = []  # callees of calls that pass a field keyword
        self.replace_names = {"replace"}  # names bound to dataclasses.replace by an import
        self.helpers: set = set()  # module-level functions holding a host read
        self.helper_names: set = set()
        self._tainted: dict[int, Taint] = {}  # id(def) -> ``_tainted(def)``
        self.data: Optional[bytes] = None  # the file's bytes: a def whose lines name no metadata derives none
        self.registered: dict = {}  # defs registered in an attention registry (``registries``): per-layer code
        self._line_starts: Optional[list[int]] = None

    def tainted(self, func) -> Callable[[], "Taint"]:
        """``_tainted(func)``, computed when first asked for."""
        def get() -> Taint:
            if func is None:
                return _NO_TAINT
            got = self._tainted.get(id(func))
            if got is None:
                got = self._tainted[id(func)] = _tainted(func) if self._names_metadata(func) else _NO_TAINT
            return got
        return get

    def _names_metadata(self, func) -> bool:
        """The lines of ``func`` hold a needle of GL104 (where the value model's seeds come from)."""
        data = self.data
        if data is None:
            return True
        starts = self._line_starts
        if starts is None:
            breaks = _LINE_BREAK.finditer(data) if b"\r" in data else re.finditer(b"\n", data)
            starts = self._line_starts = [0, *(m.end() for m in breaks)]
        first, last = func.lineno - 1, func.end_lineno
        if first >= len(starts):
            return True
        end = starts[last] if last < len(starts) else len(data)
        return PATTERNS[HOST_SYNC].needle_pattern.search(data, starts[first], end) is not None

    @staticmethod
    def _spans(node, lines: list[int]) -> bool:
        if not lines:
            return False
        start = getattr(node, "lineno", None)
        if start is None:  # match_case: no position of its own
            return True
        decorators = getattr(node, "decorator_list", None)
        if decorators:
            start = min(start, *(d.lineno for d in decorators))
        i = bisect.bisect_left(lines, start)
        return i < len(lines) and lines[i] <= node.end_lineno

    def block(self, stmts, context: bool, owner, suspects: Optional[list] = None, reads: bool = False,
              func=None) -> bool:
        """Any reportable node in ``stmts``; ``context``: they run per layer; ``owner``: the class (node) whose
        body they are directly in; ``suspects``: a host read was seen (None: module level, where each
        function is a possible helper); ``reads``: a host read here matters (inside a module-level
        function, which may be a helper); ``func``: the innermost def around them."""
        for node in stmts:
            named = self._spans(node, self.name_lines)
            if not named and not self._spans(node, self.read_lines):
                continue
            seen = [False] if suspects is None else suspects
            t = type(node)
            inner_context, inner_owner, inner_reads, inner_func = context, owner, reads, func
            if t is ast.ClassDef:
                inner_owner = node
            elif t is ast.FunctionDef or t is ast.AsyncFunctionDef:
                inner_owner, inner_func = None, node
                inner_reads = reads or (suspects is None and t is ast.FunctionDef)
                if owner is not None and (node.name == "forward" or node.name.startswith("forward_")) \
                        and is_layer_class(owner.name, [b for b in map(_dotted, owner.bases) if b]):
                    # (``forward_*``: what a dispatching forward may run; the visitor reads which it does)
                    inner_context = True
                elif node.name in self.registered:
                    inner_context = True
            elif (t is ast.For or t is ast.AsyncFor) and _loops_over_layers(node.iter):
                inner_context = True
            elif (t is ast.If or t is ast.While) and self.host_sync and (_tensor_truth(node.test) or _truth_read(
                    node.test, self.tainted(func) if context and func is not None else None)):
                # (A test's derivation counts only per layer: a helper is a function whose calls read.)
                if context:
                    return True
                seen[0] = True
            # Expressions are walked where a name can be found or a read can count; statements are
            # always gone down into (a loop over layers may be anywhere).
            look = named or inner_context or inner_reads
            blocks = [v for _, v in ast.iter_fields(node)
                      if type(v) is list and v and isinstance(v[0], _BLOCK_ITEMS)]
            # Reads of derived values count where reads count: per layer and in module-level functions.
            derived = func if inner_context or inner_reads else None
            if not blocks:
                if look and self.expr(node, inner_context, seen, derived):
                    return True
            else:
                for _, value in ast.iter_fields(node):
                    if type(value) is list and value and isinstance(value[0], _BLOCK_ITEMS):
                        if self.block(value, inner_context, inner_owner, seen, inner_reads, inner_func):
                            return True
                        continue
                    if not look:
                        continue
                    for item in (value if type(value) is list else (value,)):
                        if isinstance(item, ast.AST) and self.expr(item, inner_context, seen, derived):
                            return True
            if suspects is None and seen[0] and t is ast.FunctionDef:
                self.helpers.add(node.name)
        return False

    def _constructs(self, call: ast.Call) -> Optional[str]:
        """The instance target ``call`` makes: ``VisionAttention(...)``, ``m.VisionAttention(...)``,
        ``QKV_BACKEND_IMPL[key](...)``."""
        func = call.func
        if type(func) is ast.Subscript:
            func = func.value
        name = func.id if type(func) is ast.Name else func.attr if type(func) is ast.Attribute else None
        return name if name in self.instances else None

    def _calls_instance(self, call: ast.Call):
        """The instance targets whose instance (or its ``.forward``) the engine may resolve this call to."""
        func = call.func
        if type(func) is ast.Attribute and func.attr == "forward":
            func = func.value
        if type(func) is ast.Call:
            made = self._constructs(func)
            return {made} if made else None
        name = func.id if type(func) is ast.Name else func.attr if type(func) is ast.Attribute else None
        return self.made_names.get(name)

    def _satisfied(self, call: ast.Call, targets) -> bool:
        """Every contract of ``targets`` has a group passed whole as keywords with values other than
        None, and nothing is splatted (the checker would not know what is passed)."""
        if any(type(a) is ast.Starred for a in call.args) or any(k.arg is None for k in call.keywords):
            return False
        passed = {k.arg for k in call.keywords if not (type(k.value) is ast.Constant and k.value.value is None)}
        positional = len(call.args)
        for t in targets:
            for groups, when in self.instances[t]:
                if any(n not in passed and (at is None or positional <= at) for n, at in when):
                    continue  # the contract does not apply to this call
                if not any(g <= passed for g in groups):
                    return False
        return True

    def expr(self, root, context: bool, suspects: list, func=None) -> bool:
        """Any reportable node in ``root``; ``func``: the def whose derived values its reads may read
        (None: names only)."""
        names, fields = self.names, self.fields
        tainted = self.tainted(func) if func is not None else None
        for node in ast.walk(root):
            t = type(node)
            if t is ast.Assign or t is ast.AnnAssign:
                made = self._constructs(node.value) if self.instances and type(node.value) is ast.Call else None
                if made:
                    for target in (node.targets if t is ast.Assign else (node.target,)):
                        name = target.id if type(target) is ast.Name else \
                            target.attr if type(target) is ast.Attribute else None
                        if name:
                            self.made.setdefault(name, set()).add(made)
            elif t is ast.Call:
                if names:
                    func = node.func
                    if type(func) is ast.Subscript:  # a registry: TABLE[key](...)
                        func = func.value
                    if (func.id if type(func) is ast.Name else func.attr if type(func) is ast.Attribute
                            else None) in names:
                        return True
                if self.instances:
                    targets = self._calls_instance(node)
                    if targets and not self._satisfied(node, targets):
                        return True
                if fields and any(k.arg in fields for k in node.keywords) and type(node.func) in _CALLEES:
                    self.replace_calls.append(node.func)
                if self.host_sync and _host_read(node, tainted):
                    if context:
                        return True
                    suspects[0] = True
                elif self.helper_names and context and type(node.func) is ast.Name \
                        and node.func.id in self.helper_names:
                    return True
            elif t is ast.Import or t is ast.ImportFrom:
                # A target imported under another name (``import m.f as g``, ``from m import C as D``):
                # its calls are not looked for under the new name.
                if any(a.asname and (_last(a.name) in names or _last(a.name) in self.instances)
                       for a in node.names):
                    return True
                if fields:
                    self.replace_names.update(a.asname for a in node.names if a.asname and (
                        a.name == "replace" or a.name.endswith(".replace")))
        return False


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)
_BLOCK_ITEMS = (ast.stmt, ast.excepthandler, ast.match_case)
_CALLEES = (ast.Name, ast.Attribute)


def _last(dotted: str) -> str:
    return dotted.rsplit(".", 1)[-1]


def _reads_seqlen(expr: ast.AST) -> bool:
    for node in ast.walk(expr):
        t = type(node)
        if t is ast.Name:
            name = node.id
        elif t is ast.Attribute:
            name = node.attr
        elif t is ast.keyword:
            name = node.arg
        else:
            continue
        if name and is_seqlen_name(name):
            return True
    return False


def _host_read(call: ast.Call, tainted: Optional[Callable[[], Taint]] = None) -> bool:
    """Could GL104's visitor report this call (context aside)? ``tainted``: the names the enclosing def
    binds from sequence-length metadata (``_tainted``), where derived values count."""
    func = call.func
    if type(func) is ast.Attribute:
        if func.attr in SYNC_METHODS and not call.args and not call.keywords or _copies_to_host(call):
            return _reads_seqlen(func.value) or (tainted is not None and _derives(func.value, tainted))
        return False
    if type(func) is ast.Name and func.id in CASTS and len(call.args) + len(call.keywords) == 1:
        return _reads_seqlen(call) or (tainted is not None and bool(call.args) and _derives(call.args[0], tainted))
    return False


def _copies_to_host(call: ast.Call) -> bool:
    """``t.cpu()``, ``t.to("cpu")``, ``t.to(device=torch.device("cpu"))``: host_sync's ``bare_copy``, taken
    wider (any ``non_blocking``)."""
    func = call.func
    if func.attr == "cpu":
        return not call.args
    if func.attr != "to":
        return False
    for value in (*call.args[:1], *(k.value for k in call.keywords if k.arg == "device")):
        if type(value) is ast.Call and value.args:
            value = value.args[0]  # torch.device("cpu")
        if type(value) is ast.Constant and isinstance(value.value, str) and value.value.startswith("cpu"):
            return True
    return False


def _tensor_truth(test: ast.AST) -> bool:
    """``if (a > b).any():``, ``if mask.all():`` as a whole test: host_sync's ``_tensor_truth``."""
    if type(test) is not ast.Call or test.args or test.keywords:
        return False
    func = test.func
    if type(func) is not ast.Attribute or func.attr not in ("any", "all"):
        return False
    base = func.value
    return type(base) is ast.Compare or (type(base) is ast.Name and not base.id.endswith(HOST_SUFFIXES))


def _truth_read(test: ast.AST, tainted: Optional[Callable[[], Taint]] = None) -> bool:
    """Could GL104's visitor report this ``if``/``while`` test (``if seq_lens:``), context aside? The
    shapes host_sync's ``_metadata_truth`` looks at: names, attributes and subscripts reading a
    sequence-length name (or, with ``tainted``, whose value may derive from one), alone or compared
    (not by ``is``/``in``); compared calls and arithmetic only by derivation."""
    if type(test) is ast.UnaryOp and type(test.op) is ast.Not:
        test = test.operand
    t = type(test)
    if t is ast.BoolOp:
        return any(_truth_read(v, tainted) for v in test.values)
    if t is ast.Compare:
        if any(type(op) in (ast.Is, ast.IsNot, ast.In, ast.NotIn) for op in test.ops):
            return False
        return any(_operand(operand, tainted) for operand in (test.left, *test.comparators))
    return (t is ast.Name or t is ast.Attribute or t is ast.Subscript) and _operand(test, tainted)


def _operand(node: ast.AST, tainted: Optional[Callable[[], Taint]]) -> bool:
    t = type(node)
    if t is ast.Name or t is ast.Attribute or t is ast.Subscript:
        return _reads_seqlen(node) or (tainted is not None and _derives(node, tainted))
    return (t is ast.Call or t is ast.BinOp or t is ast.UnaryOp) and tainted is not None and _derives(node, tainted)


def _derives(expr: ast.AST, tainted: Callable[[], Taint]) -> bool:
    """``expr``'s value may derive from metadata: it carries (``_carriers``) a sequence-length name (not
    one declared host data) or a name bound from one."""
    carried = _carriers(expr)
    if not carried:
        return False
    bound, host = tainted()
    return any(n in bound or _seed(n, host) for n in carried)


_BINDS = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor, ast.comprehension, ast.NamedExpr)
_REBINDS = (ast.withitem, ast.ExceptHandler, ast.Delete, ast.Global, ast.Nonlocal, ast.Import, ast.ImportFrom,
            ast.MatchAs, ast.MatchStar)
# (names bound from metadata, sequence-length names that are parameters declared host data)
Taint = tuple
_NO_TAINT: Taint = (frozenset(), frozenset())


def _tainted(func: ast.AST, seeds: frozenset = frozenset()) -> Taint:
    """The names (and attribute names: ``self.x = ...``) ``func`` binds, at any remove, to values that
    may derive from metadata (``_carriers``): every binding in it, nested ones too, in any order; and its
    parameters named like metadata but declared host data (``seq_lens: list[int]``) and never bound
    again, which derive nothing (as in the value model). ``seeds``: parameters that are metadata by a fact, not
    a name (``kernel_facts.offset_params``). A superset of what the value model (``values.py``) finds derived
    from metadata there."""
    binds = []
    rebound: set = set()
    for node in ast.walk(func):
        t = type(node)
        if t in _REBINDS:  # what else binds or unbinds a name (a parameter named there is no longer its own)
            if t is ast.withitem:
                rebound |= _names(node.optional_vars) if node.optional_vars is not None else set()
            elif t is ast.Delete:
                rebound |= {n for target in node.targets for n in _names(target)}
            elif t is ast.Global or t is ast.Nonlocal:
                rebound.update(node.names)
            elif t is ast.Import or t is ast.ImportFrom:
                rebound.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif node.name:  # except ... as name, match captures
                rebound.add(node.name)
            continue
        if t not in _BINDS:
            continue
        if t is ast.Assign:
            targets, read = node.targets, _carriers(node.value)
        elif t is ast.For or t is ast.AsyncFor or t is ast.comprehension:
            targets, read = [node.target], _carriers(node.iter)
        elif t is ast.AugAssign:
            targets, read = [node.target], _carriers(node.target) | _carriers(node.value)
        elif node.value is None:  # x: int
            continue
        else:
            targets, read = [node.target], _carriers(node.value)
        stored = {n for target in targets for n in _names(target)}
        rebound |= stored
        if read:
            binds.append((stored, read))
    host = frozenset(_host_params(func) - rebound)
    tainted: set = set(seeds)
    changed = bool(binds)
    while changed:
        changed = False
        for stored, read in binds:
            if not stored <= tainted and any(n in tainted or _seed(n, host) for n in read):
                tainted |= stored
                changed = True
    return frozenset(tainted), host


def _host_params(func: ast.AST) -> set:
    """``func``'s parameters named like metadata whose declared type is host data (``values.declared_value``:
    ints, lists of ints, numpy arrays, optional or not)."""
    args = getattr(func, "args", None)
    if args is None:
        return set()
    return {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)
            if a.annotation is not None and _seqlen(a.arg) and _host_data(a.annotation)}


def _host_data(annotation: ast.AST) -> bool:
    """The declared type is host data all the way down (``values.declared_value`` says HOST, no
    elements of unknown place)."""
    t = type(annotation)
    if t is ast.Constant:
        return annotation.value is None
    if t is ast.BinOp:
        return type(annotation.op) is ast.BitOr and _host_data(annotation.left) and _host_data(annotation.right)
    if t is ast.Name or t is ast.Attribute:
        return (annotation.id if t is ast.Name else annotation.attr) in DECLARED_HOST_TYPES
    if t is not ast.Subscript:
        return False
    base = annotation.value
    name = base.id if type(base) is ast.Name else base.attr if type(base) is ast.Attribute else None
    args = list(annotation.slice.elts) if type(annotation.slice) is ast.Tuple else [annotation.slice]
    if name in ("Optional", "Union"):
        return all(_host_data(a) for a in args)
    if name == "Annotated":
        return _host_data(args[0])
    if name in ("NDArray", "ndarray"):
        return True
    if name in DECLARED_CONTAINERS:
        args = [a for a in args if not (type(a) is ast.Constant and a.value is Ellipsis)]
        return bool(args) and all(_host_data(a) for a in args)
    return False


def _seed(name: str, host: frozenset) -> bool:
    """``name`` (``.attr`` for an attribute) holds metadata by its name, as the value model seeds it: a
    sequence-length name, but for a parameter declared host data."""
    return _seqlen(name[1:]) if name[0] == "." else _seqlen(name) and name not in host


def _names(target: ast.AST) -> set:
    """The names a binding target binds (``.x`` for the attribute of ``self.x``), and those it reads."""
    return {node.id if type(node) is ast.Name else "." + node.attr for node in ast.walk(target)
            if type(node) is ast.Name or type(node) is ast.Attribute}


_CARRYING_METHODS = KEEP_METHODS | set(MOVE_METHODS) | set(CONTAINER_METHODS)
_ELEMENT_BUILTINS = frozenset({*KEEP_BUILTINS, "enumerate", "zip", "iter"})
_TORCH_PREFIXES = ("torch", "torch.nn.functional", "F", "torch.special", "torch.linalg")


def _carriers(expr: ast.AST) -> frozenset:
    """The names (``.attr`` for attributes and ``getattr`` strings) whose metadata the value of ``expr`` may
    derive from, through the operations the value model follows (``patterns.KEEP_METHODS`` and the rest):
    names, attributes, subscripts, arithmetic, comparisons, displays, comprehensions, those methods,
    torch functions and builtins. Other calls give values that derive from nothing here."""
    out: set = set()
    stack = [expr]
    while stack:
        node = stack.pop()
        t = type(node)
        if t is ast.Name:
            out.add(node.id)
        elif t is ast.Attribute:
            out.add("." + node.attr)
            if node.attr in SAME_TENSOR_ATTRS:
                stack.append(node.value)
        elif t is ast.Subscript:
            stack.append(node.value)
        elif t is ast.BinOp:
            stack += (node.left, node.right)
        elif t is ast.UnaryOp:
            if type(node.op) is not ast.Not:
                stack.append(node.operand)
        elif t is ast.BoolOp:
            stack += node.values
        elif t is ast.Compare:
            stack += (node.left, *node.comparators)
        elif t is ast.IfExp:
            stack += (node.body, node.orelse)
        elif t is ast.Tuple or t is ast.List or t is ast.Set:
            stack += node.elts
        elif t is ast.Dict:
            stack += [v for v in node.values if v is not None]
        elif t is ast.Starred or t is ast.NamedExpr:
            stack.append(node.value)
        elif t is ast.ListComp or t is ast.SetComp or t is ast.GeneratorExp:
            stack.append(node.elt)
        elif t is ast.DictComp:
            stack.append(node.value)
        elif t is ast.Call:
            func = node.func
            positional = [a.value if type(a) is ast.Starred else a for a in node.args]
            if type(func) is ast.Name:
                if func.id in _ELEMENT_BUILTINS:
                    stack += positional
                elif func.id == "getattr" and len(node.args) >= 2 and type(node.args[1]) is ast.Constant \
                        and type(node.args[1].value) is str:
                    out.add("." + node.args[1].value)
            elif type(func) is ast.Attribute:
                owner = _dotted(func.value)
                if owner in _TORCH_PREFIXES:
                    if func.attr in TORCH_KEEP or func.attr in TORCH_JOIN or func.attr in TORCH_COPIES:
                        stack += positional
                elif func.attr in _CARRYING_METHODS:
                    stack.append(func.value)
    return frozenset(out)


def _dotted(expr: ast.AST) -> Optional[str]:
    parts = []
    while type(expr) is ast.Attribute:
        parts.append(expr.attr)
        expr = expr.value
    if type(expr) is not ast.Name:
        return None
    parts.append(expr.id)
    return ".".join(reversed(parts))


_SEQLEN: dict[str, bool] = {}


def _seqlen(name: str) -> bool:
    got = _SEQLEN.get(name)
    if got is None:
        if len(_SEQLEN) > 4096:
            _SEQLEN.clear()
        got = _SEQLEN[name] = is_seqlen_name(name)
    return got


def _loops_over_layers(iterable: ast.AST) -> bool:
    for node in ast.walk(iterable):
        t = type(node)
        name = node.id if t is ast.Name else node.attr if t is ast.Attribute else \
            node.arg if t is ast.keyword else None
        if name and LAYER_LOOP_NAME.search(name):
            return True
    return False


_FILTERS: dict = {}


def tree_filter(rules: RuleSet) -> TreeFilter:
    """The filter of ``rules``, built once per rule set (one per worker process)."""
    cached = _FILTERS.get(id(rules))
    if cached is None or cached[0] is not rules:
        cached = (rules, TreeFilter.from_rules(rules))
        _FILTERS.clear()
        _FILTERS[id(rules)] = cached
    return cached[1]
