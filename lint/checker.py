"""Checking calls against contracts: each call the collector listed is resolved to its target and
its arguments bound to the target's parameters; a contract not met is a ``RawFinding`` (still on libcst
nodes), with what a fix needs to know about the call.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Optional

import libcst as cst

from guardlint.contracts import Contract

from .findings import Severity, message
from .names import ClassInfo, FuncInfo, Resolver, Scope, dotted, is_none
from .rules import REPLACE_FUNCTIONS, RuleSet
from .scopes import Collector


@dataclass
class BoundArgs:
    """A call's arguments bound to parameter names (by keyword, and by position through ``params``)."""

    values: dict
    positional: int = 0
    star: bool = False
    double_star: bool = False

    @property
    def splat(self) -> str:
        return " and ".join(s for s, on in (("*args", self.star), ("**kwargs", self.double_star)) if on)

    def present(self) -> set[str]:
        return {k for k, v in self.values.items() if not is_none(v)}

    def explicit_none(self) -> set[str]:
        return {k for k, v in self.values.items() if is_none(v)}


def bind_args(call: cst.Call, params: tuple[str, ...]) -> BoundArgs:
    bound = BoundArgs({})
    index = 0
    for arg in call.args:
        if arg.star == "*":
            bound.star = True
        elif arg.star == "**":
            bound.double_star = True
        elif arg.keyword is not None:
            bound.values[arg.keyword.value] = arg.value
        else:
            bound.positional += 1
            # After *args the position of what follows is unknown.
            if not bound.star and index < len(params):
                bound.values[params[index]] = arg.value
            index += 1
    return bound


@dataclass
class RawFinding:
    """A finding as the checker makes it, on the file's libcst nodes: positions, suppressions and the
    fix are added from it. It never leaves the process."""

    node: cst.Call
    contract: Contract
    message: str
    severity: Severity
    # Index into ``node.args`` when the finding is about one argument (reported at that argument).
    arg: Optional[int] = None
    # What a fixer needs: how the call was checked ("call", "replace", "positional"; None: no fix),
    # its bound arguments, where it is made (scope, seq) and how it is named in messages.
    how: Optional[str] = None
    bound: Optional[BoundArgs] = None
    scope: Optional[Scope] = None
    seq: int = 0
    label: str = ""
    indent: str = ""
    qual: str = ""  # the target the callee resolved to (derivations are chosen by it)
    per_layer: str = ""  # why the call runs once per layer ("" when it does not, as far as is known)
    note: str = ""  # the longer text behind the message (``Finding.note``)
    # The engine definition the call was judged by (``engine_defs.Judgement``): the keywords it takes (None: the
    # catalog's), its positional parameters, and the source named in the note.
    takes: Optional[frozenset] = None
    params: Optional[tuple] = None
    judged: str = ""


def _gaps(require, present: set) -> Optional[tuple]:
    """``Contract.missing_groups`` over ``require``: None when some group is complete, else the fewest gaps."""
    if not require:
        return None
    best: Optional[tuple] = None
    for group in require:
        gaps = tuple(n for n in group if n not in present)
        if not gaps:
            return None
        if best is None or len(gaps) < len(best):
            best = gaps
    return best


def _constants(expr: Optional[cst.BaseExpression]) -> Optional[set]:
    """The strings ``expr`` can be: one constant, or a tuple, list or set (or ``frozenset(...)``) of them."""
    if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Name) and expr.func.value in ("set", "frozenset",
                                                                                              "tuple") \
            and len(expr.args) == 1:
        expr = expr.args[0].value
    if isinstance(expr, cst.SimpleString):
        value = expr.evaluated_value
        return {value} if isinstance(value, str) else None
    if isinstance(expr, (cst.Tuple, cst.List, cst.Set)):
        found: set = set()
        for e in expr.elements:
            got = _constants(e.value) if isinstance(e, cst.Element) else None
            if got is None or len(got) != 1:
                return None
            found |= got
        return found
    return None


def _statements(block):
    """The statements of a block (a def's body), into compound statements but not into nested defs or classes."""
    for stmt in getattr(block, "body", ()):
        if isinstance(stmt, cst.SimpleStatementLine):
            yield from stmt.body
        elif not isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            yield from _compound(stmt)


def _compound(stmt):
    yield stmt
    for name in ("body", "orelse", "finalbody"):
        part = getattr(stmt, name, None)
        if isinstance(part, cst.If):  # elif
            yield from _compound(part)
        elif isinstance(part, (cst.Else, cst.Finally)):
            yield from _statements(part.body)
        elif isinstance(part, cst.BaseSuite):
            yield from _statements(part)
    for handler in getattr(stmt, "handlers", ()):
        yield from _statements(handler.body)


def _required(stmt, name: str) -> Optional[set]:
    """The constants ``stmt`` makes ``name`` one of, or the function stops: ``assert name in (...)``,
    ``assert name == "c"``, ``if name not in (...): raise ...``, ``if name != "c": raise ...``."""
    raising: tuple[type, type]
    if isinstance(stmt, cst.Assert):
        test, raising = stmt.test, (cst.In, cst.Equal)
    elif isinstance(stmt, cst.If) and any(isinstance(s, cst.Raise) for s in _statements(stmt.body)):
        test, raising = stmt.test, (cst.NotIn, cst.NotEqual)
    else:
        return None
    if not isinstance(test, cst.Comparison) or len(test.comparisons) != 1:
        return None
    left, comparison = test.left, test.comparisons[0]
    if not (isinstance(left, cst.Name) and left.value == name and isinstance(comparison.operator, raising)):
        return None
    found = _constants(comparison.comparator)
    if found is None or (isinstance(comparison.operator, (cst.Equal, cst.NotEqual)) and len(found) != 1):
        return None
    if isinstance(comparison.operator, (cst.Equal, cst.NotEqual)) and not isinstance(comparison.comparator,
                                                                                      cst.SimpleString):
        return None
    return found


def _join(items, last: str) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f" {last} {items[-1]}"


def lacks(c: Contract, groups, nones) -> str:
    """What a call lacks, in the line's words: ``without sequence_lengths``, ``without max_len or seg_lens``,
    ``passes forward_metadata=None and no sequence_lengths``. ``groups``: the any-of groups the target
    takes; ``nones``: their names passed as None (a keyword passed as None is as missing as an absent one,
    and the line says which were passed so). Only the contract's ``subject`` is named as absent."""
    subject = set(c.subject)
    items = ["+".join(g) for g in groups if not subject or any(n in subject for n in g)] \
        or ["+".join(g) for g in groups]
    absent = [i for i in items if not all(_top(n) in nones for n in i.split("+"))]
    if not nones:
        return f"without {_join(absent or items, 'or')}"
    passed = f"passes {_join([f'{n}=None' for n in nones], 'and')}"
    return f"{passed} and no {_join(absent, 'or')}" if absent else passed


def _stem(text: str) -> str:
    """A diagnosis message as a sentence of a note (``... or seg_lens.`` -> ``... or seg_lens``)."""
    return text.rstrip(" .")


def _line(c: Contract, facts: str) -> str:
    return message(facts, c.diagnosis.headline)


def contract_note(c: Contract, target_message: str = "") -> str:
    """The kernel's own words for the problem, for the note (a user contract's are its headline already)."""
    if c.user_defined:
        return ""
    return _stem(target_message or c.diagnosis.message) + "."


def _top(name: str) -> str:
    return name.split(".", 1)[0]


def _code(node: cst.CSTNode) -> str:
    if isinstance(node, (cst.Integer, cst.Float, cst.Name)):
        return node.value
    return cst.Module([]).code_for_node(node)


def _literal_equal(node: cst.BaseExpression, literal: str) -> bool:
    text = _code(node).strip()
    try:
        a, b = ast.literal_eval(text), ast.literal_eval(literal)
        return type(a) is type(b) and a == b
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text == literal.strip()


def known_targets(rules: RuleSet) -> set[str]:
    return {*rules.by_callee, *rules.by_instance, *REPLACE_FUNCTIONS}


def callable_names(bindings: dict, known) -> set[str]:
    """Names of ``bindings`` (a scope's) that may name a target: an instance made by a call, or an
    import of a target."""
    return {n for n, bs in bindings.items()
            if any(b.kind == "call" or (b.kind == "import" and b.value in known) for b in bs)}


class Checker:
    def __init__(self, rules: RuleSet, collector: Collector, strict: bool = False,
                 module_names: Optional[set[str]] = None, path: Optional[str] = None):
        """``module_names``: what ``callable_names`` gives for the module scope, when the caller keeps
        it (a file checked in chunks would otherwise look through every module binding per chunk).
        ``path``: the file's, where an engine's own source is looked for (``engine_defs``)."""
        self.rules = rules
        self.c = collector
        self.strict = strict
        self.path = path
        self._judged: dict = {}
        known = known_targets(rules)
        self.resolver = Resolver(collector.module, rules.by_instance, known)
        # Only calls whose last name is one of these can reach a contract; the rest are not resolved.
        names = {q.rsplit(".", 1)[-1] for q in known} | {"forward"}
        self._attr_names: set[str] = set()
        for scope_bindings in self._all_bindings(collector.module if module_names is not None else None):
            names.update(callable_names(scope_bindings, known))
        if module_names is not None:
            names.update(module_names)
        self._names = names

    def _all_bindings(self, skip: Optional[Scope] = None):
        seen = set() if skip is None else {id(skip)}
        for _, scope, _, _, _ in self.c.sites:
            s: Optional[Scope] = scope
            while s is not None and id(s) not in seen:
                seen.add(id(s))
                yield s.bindings
                if isinstance(s.info, ClassInfo):
                    self._attr_names.update(s.info.attrs)
                s = s.parent

    def run(self) -> list[RawFinding]:
        out: list[RawFinding] = []
        names = self._names
        for node, scope, seq, func, indent in self.c.sites:
            f = node.func
            last = f.attr.value if isinstance(f, cst.Attribute) else f.value if isinstance(f, cst.Name) else None
            if last is not None and last not in names and last not in self._attr_names:
                continue
            ref = self.resolver.resolve(f, scope, seq)
            if ref is None:
                continue
            if ref.kind == "qual":
                if ref.qual in REPLACE_FUNCTIONS and self.rules.replace_contracts:
                    first = len(out)
                    self._check_replace(node, scope, seq, out)
                    for r in out[first:]:
                        r.indent = indent
                contracts = self.rules.by_callee.get(ref.qual, ())
                label = ref.qual.rsplit(".", 1)[-1] + "(...)"
            elif ref.kind == "inst" and ref.method in ("", "forward"):
                contracts = self.rules.by_instance.get(ref.qual, ())
                short = ref.qual.rsplit(".", 1)[-1].replace("[]", "[...]")
                label = f"{short}.forward(...)" if ref.method else f"{short}(...)"
            else:
                continue
            if not contracts:
                continue
            guarded = ref.guarded or self.resolver.inside_guarded(func)
            first = len(out)
            qual = self.rules.canonical.get(ref.qual, ref.qual)  # per-target data is keyed by the target's name
            for contract in contracts:
                self._check(contract, node, scope, seq, label, guarded, out, qual)
            for r in out[first:]:
                r.indent = indent
                r.qual = qual
                r.per_layer = self.c.per_layer.get(id(node), "")
        return out

    def _check(self, c: Contract, node, scope, seq, label, guarded, out, qual: str = "") -> None:
        judged = self._judge(c, qual, node, scope, seq) if c.kind in ("call", "positional") else None
        if judged is not None and not judged.reachable:
            return  # the engine's table here has no entry for the target: the call cannot reach it
        params = judged.params if judged is not None and judged.params is not None else c.params_for(qual)
        bound = bind_args(node, params)
        target = c.target(qual)
        if target is not None and target.when_passed and not set(target.when_passed) <= bound.present():
            return
        note = contract_note(c, target.message if target is not None else "")
        found = dict(takes=judged.takes, params=judged.params, judged=judged.label) if judged is not None else {}
        if judged is not None:
            note = "\n".join(part for part in (note, f"Judged against {judged.label}.") if part)
        if c.kind == "call":
            if guarded:  # the guard derives what is missing at runtime
                return
            require = c.require
            if judged is not None and judged.takes is not None:
                # Only what the definition this call reaches takes is advice that can be followed.
                require = tuple(g for g in c.require if all(_top(n) in judged.takes for n in g))
                if not require:
                    return
            missing = self._missing(c, self._present(c, bound, scope, seq), node, scope, seq, require)
            if missing is None:
                return
            if bound.star or bound.double_star:
                self._unknown(c, node, label, bound, out)
                return
            # A target with its own parameter list names only the alternatives it takes (vLLM's
            # MMEncoderAttention has no forward_metadata).
            own = set(target.params) if target is not None and target.params else None
            groups = [g for g in require if own is None or all(_top(n) in own for n in g)] or list(require)
            nones = list(dict.fromkeys(_top(n) for g in groups for n in g if _top(n) in bound.explicit_none()))
            if c.subject and len(groups) > 1:  # the line names the subject only: the note, every way out
                note += f"\nIt takes {_join(['+'.join(g) for g in groups], 'or')} (not None)."
            out.append(RawFinding(node, c, _line(c, f"{label} {lacks(c, groups, nones)}"), c.severity,
                                  how="call", bound=bound, scope=scope, seq=seq, label=label, note=note, **found))
        elif c.kind == "positional":
            if bound.positional:
                n = bound.positional
                out.append(RawFinding(node, c, _line(c, f"{label} passes {n} positional argument"
                                                        f"{'s' if n != 1 else ''}"), c.severity,
                                      how="positional", bound=bound, scope=scope, seq=seq, label=label,
                                      note=note, **found))
            elif bound.star:
                self._unknown(c, node, label, bound, out)
        elif c.kind == "value":
            for name, literal in c.forbidden_values:
                value = bound.values.get(name)
                if value is not None and _literal_equal(value, literal):
                    if c.satisfied_by_later_assignment and self._overwritten(node, scope, seq, name, literal):
                        continue
                    arg = next(i for i, a in enumerate(node.args) if a.value is value)
                    out.append(RawFinding(node, c, _line(c, f"{label} passes {name}={literal}"), c.severity, arg,
                                          note=note))

    def _present(self, c: Contract, bound: BoundArgs, scope, seq) -> set[str]:
        """Names passed and not None; an attribute path (``forward_metadata.packed_indptrs``) counts as
        present unless its object is provably built without it (``METADATA_BUILDERS``)."""
        present = bound.present()
        paths = {n for g in c.require for n in g if "." in n and _top(n) in present}
        for path in paths:
            top, attr = path.split(".", 1)
            fields = self._built_fields(bound.values[top], scope, seq)
            if fields is None or attr in fields:
                present.add(path)
        return present

    def _built_fields(self, expr, scope, seq) -> Optional[set]:
        """The fields a metadata value certainly has, when it is built by a known builder in this
        function (``meta = prepare_...(...)`` before the call, or inline); None when unknown."""
        from guardlint.contracts.catalog import METADATA_BUILDERS

        call = expr if isinstance(expr, cst.Call) else None
        if isinstance(expr, cst.Name):
            b = self.resolver.lookup(scope, expr.value, seq)
            fn = scope.function_scope()
            binds = fn.bindings.get(expr.value, [])
            if b is None or b.kind != "call" or not isinstance(b.value, tuple) or len(b.value) < 4 or len(binds) != 1:
                return None  # rebound (a branch per backend) or not built here: trusted
            call, s, sq = b.value[3], b.value[1], b.value[2]
            scope, seq = s, sq
        if call is None:
            return None
        ref = self.resolver.resolve(call.func, scope, seq)
        if ref is None or ref.kind != "qual" or ref.qual not in METADATA_BUILDERS:
            return None
        if any(a.star for a in call.args):
            return None
        fields = set(METADATA_BUILDERS[ref.qual])
        fields.update(a.keyword.value for a in call.args if a.keyword is not None and not is_none(a.value))
        return fields

    def _overwritten(self, node, scope: Scope, seq: int, name: str, literal: str) -> bool:
        """The record built by ``node`` is kept (``self.buf = C(...)`` / ``x = C(...)``) and its field
        ``name`` is stored with another value: in any method of the class for ``self.buf``, later in the
        function for a local name (directly or through ``alias = self.buf``)."""
        target = self.c.assigned.get(id(node))
        if target is None:
            return False
        fn = scope.function_scope()
        owner = fn.info.def_scope.info if isinstance(fn.info, FuncInfo) else None
        for cls, store_fn, sq, obj, attr, value in self.c.stores:
            if attr != name or obj != target or is_none(value) or _literal_equal(value, literal):
                continue
            if target.startswith("self.") and isinstance(owner, ClassInfo) and cls is owner:
                return True
            if store_fn is fn and sq > seq:
                return True
        return False

    def _missing(self, c: Contract, present: set[str], node, scope, seq, require=None):
        """The gaps of the group closest to complete (None: one is), over ``require`` (the contract's groups,
        or those the definition the call reaches takes)."""
        require = c.require if require is None else require
        items = {n for g in require for n in g if n in present or ("." not in n and _top(n) in present)}
        missing = _gaps(require, items)
        if missing is not None and c.satisfied_by_later_assignment:
            later = self._stored_later(node, scope, seq)
            if later:
                items |= {n for g in require for n in g if _top(n) in later}
                missing = _gaps(require, items)
        return missing

    # -- the definition a call reaches (engine_defs) -----------------------------------------------------
    def _judge(self, c: Contract, qual: str, node: cst.Call, scope: Scope, seq: int):
        """``engine_defs.judge`` of the call's target (None for a target of no pinned engine), once per target,
        keywords and the backends the call's layer may pick."""
        from guardlint.contracts.catalog import LAYER_BACKENDS

        from . import engine_defs

        if not qual or engine_defs.engine_of(qual) is None:
            return None
        target = c.target(qual)
        kind = target.kind if target is not None else "instance"
        keywords = tuple(dict.fromkeys(_top(n) for g in c.require for n in g))
        backends = self._backends(qual, node, scope, seq) if qual in LAYER_BACKENDS else None
        key = (qual, kind, keywords, backends)
        if key not in self._judged:
            self._judged[key] = engine_defs.judge(qual, kind, keywords, self.path, backends)
        return self._judged[key]

    def _constructions(self, node: cst.Call, scope: Scope, seq: int, qual: str):
        """The calls that built the instance ``node`` calls (``self.attn = C(...)`` in any method of the class,
        ``attn = C(...)`` before it), with their scope and seq; None where they cannot be told."""
        f = node.func
        if isinstance(f, cst.Attribute) and f.attr.value == "forward":
            f = f.value
        made: list = []
        if isinstance(f, cst.Call):
            made = [(f, scope, seq)]
        elif isinstance(f, cst.Name):
            b = self.resolver.lookup(scope, f.value, seq)
            if b is None or b.kind != "call" or not isinstance(b.value, tuple) or len(b.value) < 4:
                return None
            made = [(b.value[3], b.value[1], b.value[2])]
        elif isinstance(f, cst.Attribute) and isinstance(f.value, cst.Name):
            b = self.resolver.lookup(scope, f.value.value, seq)
            if b is None or b.kind != "self" or not isinstance(b.value, ClassInfo):
                return None
            made = [(call, s, sq) for _, s, sq, call in b.value.attrs.get(f.attr.value, ())]
        made = [m for m in made if self._makes(m, qual)]
        return made or None

    def _makes(self, made, qual: str) -> bool:
        call, s, sq = made
        ref = self.resolver.resolve(call.func, s, sq)
        return ref is not None and ref.kind == "qual" and self.rules.canonical.get(ref.qual, ref.qual) == qual

    def _backends(self, qual: str, node: cst.Call, scope: Scope, seq: int) -> Optional[frozenset]:
        """The backend keys the layer's constructions allow: a constant ``qkv_backend="sdpa"``, or a name its
        constructor only lets hold some constants (assigned only those, or refused unless one of them: ``if
        backend not in ("sdpa",): raise``). None: any (absent or None picks the platform's default)."""
        from guardlint.contracts.catalog import LAYER_BACKENDS

        from . import engine_defs

        keyword = LAYER_BACKENDS[qual][0]
        made = self._constructions(node, scope, seq, qual)
        if not made:
            return None
        keys: set = set()
        for call, s, _ in made:
            if any(a.star for a in call.args):
                return None
            arg = next((a.value for a in call.args if a.keyword is not None and a.keyword.value == keyword), None)
            positional = [a.value for a in call.args if a.keyword is None]
            if arg is None and positional:
                params = engine_defs.parameters(qual, "__init__", self.path)
                if params is None:
                    return None
                if keyword in params and params.index(keyword) < len(positional):
                    arg = positional[params.index(keyword)]
            allowed = _constants(arg) if arg is not None else None
            if allowed is None and isinstance(arg, cst.Name):
                allowed = self._allowed(arg.value, s)
            if allowed is None:
                return None
            keys |= allowed
        return frozenset(keys)

    def _allowed(self, name: str, scope: Scope) -> Optional[set]:
        """The constants a name can hold in the function that builds the layer: those it is assigned (when it
        is no parameter and only constants are assigned to it), narrowed by the ones the function refuses to
        run without (``assert name in (...)``, ``if name not in (...): raise``); None when unknown."""
        fn = scope.function_scope()
        node = getattr(self.c, "defs", {}).get(id(fn.info)) if isinstance(fn.info, FuncInfo) else None
        if node is None:
            return None
        p = node.params
        is_param = any(x.name.value == name for x in (*p.posonly_params, *p.params, *p.kwonly_params))
        assigned: Optional[set] = None if is_param else set()
        allowed: Optional[set] = None
        for stmt in _statements(node.body):
            if isinstance(stmt, (cst.Assign, cst.AnnAssign, cst.AugAssign)) and assigned is not None:
                targets = [t.target for t in stmt.targets] if isinstance(stmt, cst.Assign) else [stmt.target]
                if any(isinstance(t, cst.Name) and t.value == name for t in targets):
                    value = _constants(stmt.value) if isinstance(stmt, cst.Assign) and len(targets) == 1 else None
                    assigned = None if value is None else assigned | value
            required = _required(stmt, name)
            if required is not None:
                allowed = required if allowed is None else allowed & required
        if assigned:  # a local assigned only constants
            return assigned if allowed is None else assigned & allowed
        return allowed

    def _stored_later(self, node, scope: Scope, seq: int) -> set[str]:
        """Attributes set to a non-None value on the call's result, later in the same function."""
        target = self.c.assigned.get(id(node))
        if target is None:
            return set()
        return {attr for sq, obj, attr, none, _ in scope.function_scope().attr_stores
                if obj == target and sq > seq and not none}

    def _unknown(self, c: Contract, node, label, bound: BoundArgs, out) -> None:
        if self.strict:
            out.append(RawFinding(node, c, _line(c, f"{label} could not be checked: it passes {bound.splat}"),
                                  "warning", note=contract_note(c)))

    def _check_replace(self, node: cst.Call, scope, seq, out) -> None:
        """``dataclasses.replace(obj, max_len=None, seg_lens=None)`` empties every group of a contract."""
        if any(arg.star for arg in node.args):
            return
        nones = {arg.keyword.value for arg in node.args if arg.keyword is not None and is_none(arg.value)}
        label = (dotted(node.func) or "replace").rsplit(".", 1)[-1] + "(...)"
        for c in self.rules.replace_contracts:
            if not c.require or not all(any(_top(n) in nones for n in g) for g in c.require):
                continue
            later = self._stored_later(node, scope, seq)
            if later and c.missing_groups({n for g in c.require for n in g if _top(n) in later}) is None:
                continue
            named = list(dict.fromkeys(n for g in c.require for n in g if _top(n) in nones))
            out.append(RawFinding(node, c, _line(c, f"{label} sets " + " and ".join(f"{n}=None" for n in named)),
                                  c.severity, how="replace", scope=scope, seq=seq, label=label, note=contract_note(c)))
