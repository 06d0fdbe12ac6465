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
                 module_names: Optional[set[str]] = None):
        """``module_names``: what ``callable_names`` gives for the module scope, when the caller keeps
        it (a file checked in chunks would otherwise look through every module binding per chunk)."""
        self.rules = rules
        self.c = collector
        self.strict = strict
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
        bound = bind_args(node, c.params_for(qual))
        target = c.target(qual)
        if target is not None and target.when_passed and not set(target.when_passed) <= bound.present():
            return
        note = contract_note(c, target.message if target is not None else "")
        if c.kind == "call":
            if guarded:  # the guard derives what is missing at runtime
                return
            missing = self._missing(c, self._present(c, bound, scope, seq), node, scope, seq)
            if missing is None:
                return
            if bound.star or bound.double_star:
                self._unknown(c, node, label, bound, out)
                return
            # A target with its own parameter list names only the alternatives it takes (vLLM's
            # MMEncoderAttention has no forward_metadata).
            own = set(target.params) if target is not None and target.params else None
            groups = [g for g in c.require if own is None or all(_top(n) in own for n in g)] or list(c.require)
            nones = list(dict.fromkeys(_top(n) for g in groups for n in g if _top(n) in bound.explicit_none()))
            if c.subject and len(groups) > 1:  # the line names the subject only: the note, every way out
                note += f"\nIt takes {_join(['+'.join(g) for g in groups], 'or')} (not None)."
            out.append(RawFinding(node, c, _line(c, f"{label} {lacks(c, groups, nones)}"), c.severity,
                                  how="call", bound=bound, scope=scope, seq=seq, label=label, note=note))
        elif c.kind == "positional":
            if bound.positional:
                n = bound.positional
                out.append(RawFinding(node, c, _line(c, f"{label} passes {n} positional argument"
                                                        f"{'s' if n != 1 else ''}"), c.severity,
                                      how="positional", bound=bound, scope=scope, seq=seq, label=label,
                                      note=note))
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

    def _missing(self, c: Contract, present: set[str], node, scope, seq):
        items = {n for g in c.require for n in g if n in present or ("." not in n and _top(n) in present)}
        missing = c.missing_groups(items)
        if missing is not None and c.satisfied_by_later_assignment:
            later = self._stored_later(node, scope, seq)
            if later:
                items |= {n for g in c.require for n in g if _top(n) in later}
                missing = c.missing_groups(items)
        return missing

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
