"""Fixes from contracts: what a finding's call becomes, as a new libcst call plus the imports it needs.

Nothing here knows a rule code. A ``call`` contract is fixed by its derivations (``Derivation.template``
filled with the call's own argument expressions), a ``positional`` one by naming arguments in the
contract's ``params`` order; the engine turns the new call into text edits (``findings.Edit``).
"""
# A fix writes the source expressions of the call a second time (``cu_seqlens`` into
# ``prepare_varlen_metadata(cu_seqlens, q, ...)``), so it is only offered when evaluating them again
# cannot differ: names, attribute chains and subscripts of those by constants. ``make_cu()`` twice may
# allocate twice or advance a generator; the finding then says why there is no fix.
from __future__ import annotations

import dataclasses
import functools
import re
import string
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union, cast

import libcst as cst

from guardlint.contracts import Contract, Derivation
from guardlint.contracts.catalog import HOISTED_METADATA, EncoderMetadataHoist

from .findings import per_layer_place
from .names import dotted, is_none
from .walk import children


@dataclass(frozen=True)
class Plan:
    """A fix for one call: the call as it should read, the imports it needs, a one-line description."""

    new_call: cst.Call
    imports: tuple[tuple[str, str], ...]
    message: str


@dataclass(frozen=True)
class NoFix:
    """Why a finding whose contract has fixes gets none here. The first line of ``reason`` is said on
    the finding's line (``; no fix: <it>``); the lines after it, what to do instead, are the finding's
    note. One string, so that it travels as the fixer's one reason."""

    reason: str
    # A derivation that cannot be written at the call (a host read per layer) but may be built once where the
    # layer loop runs and passed down (``hoist.py``): the fix builder tries that before giving the reason.
    hoist: Optional[Derivation] = None
    # Values only the engine's own helpers can build, from what the layer has rather than the call (vLLM's
    # MMEncoderAttention): built where the layer loop runs with ``hoist.Hoister.plan_encoder_metadata``.
    helpers: Optional[EncoderMetadataHoist] = None

    @classmethod
    def because(cls, why: str, instead: str = "", hoist: Optional[Derivation] = None,
                helpers: Optional[EncoderMetadataHoist] = None) -> "NoFix":
        return cls(f"{why}\n{instead}" if instead else why, hoist, helpers)



Outcome = Union[Plan, NoFix, None]  # None: the contract has no automatic fix at all
# (module, name) -> None: import it; "": it is already imported there; other text: why it cannot be.
ImportCheck = Callable[[str, str], Optional[str]]

_EMPTY = cst.SimpleWhitespace("")
_SPACE = cst.SimpleWhitespace(" ")
_NO_SPACE_EQUAL = cst.AssignEqual(whitespace_before=_EMPTY, whitespace_after=_EMPTY)


# Derived expressions repeat from call to call (the same template over the same names): libcst's nodes
# are immutable, so one parse of a text serves every call it is written into. On a generated module of
# 2000 target calls this was a fifth of the check (12000 parses of a handful of texts).
_parse_expression = functools.lru_cache(maxsize=4096)(cst.parse_expression)


def _code(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node)


def _short(node: cst.CSTNode, limit: int = 40) -> str:
    text = re.sub(r"([(\[{]) | ([)\]}])", r"\1\2", " ".join(_code(node).split()))
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- may an expression be evaluated a second time? ----------------------------------------------------
def reevaluation_problem(expr: cst.BaseExpression) -> Optional[str]:
    """None when ``expr`` reads the same value when evaluated again (a name, an attribute chain, a
    subscript of those by constants or names); else what it is (``a call``, ...)."""
    if isinstance(expr, cst.Name):
        return None
    if isinstance(expr, cst.Attribute):
        return reevaluation_problem(expr.value)
    if isinstance(expr, cst.Subscript):
        problem = reevaluation_problem(expr.value)
        if problem is not None:
            return problem
        for element in expr.slice:
            index = element.slice
            if isinstance(index, cst.Index):
                parts = [index.value]
            else:  # a BaseSlice is an Index or a Slice
                bounds = cast(cst.Slice, index)
                parts = [p for p in (bounds.lower, bounds.upper, bounds.step) if p is not None]
            for part in parts:
                if isinstance(part, (cst.Integer, cst.SimpleString)):
                    continue
                if isinstance(part, cst.UnaryOperation) and isinstance(part.expression, cst.Integer):
                    continue
                if reevaluation_problem(part) is not None:
                    return "a subscript with a computed index"
        return None
    if _is_literal(expr):
        return None
    if isinstance(expr, cst.Call):
        return "a call"
    if isinstance(expr, cst.NamedExpr):
        return "an assignment expression"
    if isinstance(expr, (cst.Await, cst.Yield)):
        return "an await or yield"
    if _contains_call(expr):
        return "an expression with a call"
    return "an expression"


def _is_literal(expr: cst.BaseExpression) -> bool:
    """Numbers, strings and lists or tuples of them: a second evaluation builds an equal value."""
    if isinstance(expr, (cst.Integer, cst.Float, cst.Imaginary, cst.SimpleString, cst.ConcatenatedString)):
        return True
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, (cst.Minus, cst.Plus)):
        return _is_literal(expr.expression)
    if isinstance(expr, (cst.List, cst.Tuple)):
        return all(isinstance(e, cst.Element) and _is_literal(e.value) for e in expr.elements)
    return False


def _contains_call(node: cst.CSTNode) -> bool:
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, (cst.Call, cst.NamedExpr, cst.Await, cst.Yield)):
            return True
        stack.extend(children(n))
    return False


def _source_problem(name: str, expr: cst.BaseExpression) -> Optional[str]:
    problem = reevaluation_problem(expr)
    if problem is None:
        return None
    return f"{name} is `{_short(expr)}`, {problem}\nThe fix would evaluate it twice, which may differ."


def placeholders(template: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(f for _, f, _, _ in string.Formatter().parse(template) if f))


# -- rewriting argument lists, keeping their layout ------------------------------------------------------
def _bare_newline(ws: cst.ParenthesizedWhitespace) -> cst.ParenthesizedWhitespace:
    """The same line break and indentation without the comment or blank lines before it."""
    return cst.ParenthesizedWhitespace(first_line=cst.TrailingWhitespace(), empty_lines=[], indent=ws.indent,
                                       last_line=ws.last_line)


def _separator_before_last(call: cst.Call):
    args = call.args
    if len(args) >= 2 and isinstance(args[-2].comma, cst.Comma):
        return args[-2].comma.whitespace_after
    return call.whitespace_before_args


def append_argument(call: cst.Call, arg: cst.Arg) -> cst.Call:
    """``call`` with ``arg`` after its last argument: on a line of its own when the arguments are one
    per line, else after ``, `` on the same line. Comments stay with the argument they follow."""
    args = list(call.args)
    if not args:
        return call.with_changes(args=[arg])
    last = args[-1]
    sep = _separator_before_last(call)
    own_line = isinstance(sep, cst.ParenthesizedWhitespace)
    if isinstance(last.comma, cst.Comma):  # a trailing comma stays last
        after = last.comma.whitespace_after
        if own_line and isinstance(after, cst.ParenthesizedWhitespace):
            kept = cst.ParenthesizedWhitespace(first_line=after.first_line, empty_lines=after.empty_lines,
                                               indent=sep.indent, last_line=sep.last_line)
            new_last = last.with_changes(comma=last.comma.with_changes(whitespace_after=kept))
            new = arg.with_changes(comma=last.comma.with_changes(whitespace_after=_bare_newline(after)))
        else:
            new_last = last.with_changes(comma=last.comma.with_changes(whitespace_after=_SPACE))
            new = arg.with_changes(comma=last.comma)
    else:
        after = last.whitespace_after_arg
        if own_line and isinstance(after, cst.ParenthesizedWhitespace):
            kept = cst.ParenthesizedWhitespace(first_line=after.first_line, empty_lines=after.empty_lines,
                                               indent=sep.indent, last_line=sep.last_line)
            new_last = last.with_changes(comma=cst.Comma(whitespace_after=kept), whitespace_after_arg=_EMPTY)
            new = arg.with_changes(whitespace_after_arg=_bare_newline(after))
        else:
            ws = _bare_newline(sep) if own_line else _SPACE
            new_last = last.with_changes(comma=cst.Comma(whitespace_after=ws), whitespace_after_arg=_EMPTY)
            new = arg.with_changes(whitespace_after_arg=after)
    return call.with_changes(args=[*args[:-1], new_last, new])


def keyword_arg(name: str, value: cst.BaseExpression) -> cst.Arg:
    return cst.Arg(value=value, keyword=cst.Name(name), equal=_NO_SPACE_EQUAL)


# -- planning ------------------------------------------------------------------------------------------
@dataclass
class _Choice:
    group: tuple[str, ...]
    uses: list[tuple[str, Derivation, str]]  # (target, derivation, rendered expression)


def _render(d: Derivation, sources: dict[str, str]) -> Union[str, NoFix]:
    try:
        text = d.template.format(**sources)
    except (KeyError, IndexError, ValueError) as e:
        return NoFix(f"the derivation template of {d.target} ({d.template!r}) cannot be filled: {e}")
    try:
        _parse_expression(text)
    except cst.ParserSyntaxError:
        return NoFix(f"the derivation template of {d.target} ({d.template!r}) is not an expression")
    return text


def choose_derivations(contract: Contract, missing_in: Callable[[tuple[str, ...]], tuple[str, ...]],
                       source_of: Callable[[str], Union[str, NoFix]]) -> Union[_Choice, NoFix]:
    """The any-of group to complete and the derivations that complete it.

    The contract lists its preferred derivation first; the group of the first one whose target is
    missing is completed (the group with fewest gaps when several hold it), each gap by its first
    derivation. There is no falling back to a later derivation when the preferred one cannot be
    written here: later ones may be right for some inputs only (GL101's ``cu[1:] - cu[:-1]`` is wrong
    for packed element indptrs, which ``prepare_varlen_metadata`` tells apart)."""
    gaps = {g: missing_in(g) for g in contract.require}
    for d in contract.derivations:
        groups = [g for g, missing in gaps.items() if d.target in missing]
        if not groups:
            continue
        group = min(groups, key=lambda g: len(gaps[g]))
        uses = []
        for target in gaps[group]:
            first = next((x for x in contract.derivations if x.target == target), None)
            if first is None or "." in target:
                return NoFix(f"{target} has no derivation to write")
            sources = {}
            for name in placeholders(first.template):
                got = source_of(name)
                if isinstance(got, NoFix):
                    return got
                sources[name] = got
            rendered = _render(first, sources)
            if isinstance(rendered, NoFix):
                return rendered
            uses.append((target, first, rendered))
        return _Choice(group, uses)
    return NoFix("no derivation of " + " or ".join("+".join(g) for g in contract.require) + " is declared")


def _imports_for(uses, can_import: ImportCheck) -> Union[tuple[tuple[str, str], ...], NoFix]:
    needed = []
    for _, d, _ in uses:
        for module, name in d.imports:
            problem = can_import(module, name)
            if problem == "":
                continue  # already imported there
            if problem is not None:
                return NoFix(problem)
            if (module, name) not in needed:
                needed.append((module, name))
    return tuple(needed)


def _set_value(arg: cst.Arg, value: cst.BaseExpression) -> cst.Arg:
    return arg.with_changes(value=value)


def _derive_into(contract: Contract, call: cst.Call, passed: dict, missing_in, source_of,
                 can_import: ImportCheck) -> Outcome:
    """Write the contract's preferred derivations of what ``missing_in`` reports into ``call``: an
    argument passed as None (its expression in ``passed``) gets its value replaced in place, an absent
    one is added as a keyword."""
    choice = choose_derivations(contract, missing_in, source_of)
    if isinstance(choice, NoFix):
        return choice
    imports = _imports_for(choice.uses, can_import)
    if isinstance(imports, NoFix):
        return imports
    new_call = call
    words = []
    for target, _, text in choice.uses:
        value = _parse_expression(text)
        current = passed.get(target)
        if current is not None:
            args = [_set_value(a, value) if a.value is current else a for a in new_call.args]
            new_call = new_call.with_changes(args=args)
            words.append(f"Set {target}={text}")
        else:
            new_call = append_argument(new_call, keyword_arg(target, value))
            words.append(f"Add {target}={text}")
    return Plan(new_call, imports, "; ".join(words))


_NARROWED: dict = {}  # (id(contract), ids of derivations) -> (contract, derivations, the narrowed contract)


def _with_derivations(contract: Contract, derivations: tuple) -> Contract:
    """``contract`` with only ``derivations``: made once per contract and target, not per call."""
    key = (id(contract), tuple(map(id, derivations)))
    got = _NARROWED.get(key)
    if got is None or got[0] is not contract or any(a is not b for a, b in zip(got[1], derivations)):
        if len(_NARROWED) > 1024:
            _NARROWED.clear()
        got = _NARROWED[key] = (contract, derivations, dataclasses.replace(contract, derivations=derivations))
    return got[2]


def plan_call(contract: Contract, call: cst.Call, bound_values: dict, can_import: ImportCheck,
              qual: str = "", in_scope: Optional[Callable[[str], bool]] = None, per_layer: str = "",
              takes: Optional[frozenset] = None, judged: str = "") -> Outcome:
    """Fix for a ``call`` contract: derive what is missing from the call's own arguments. A name
    passed as None gets its value replaced; an absent one is added as a keyword.

    Only the derivations written for ``qual`` (the resolved target) are used. A missing value that
    ``in_scope`` says is already bound under its own name is passed as that name. A derivation with a
    host read is not written into code that runs once per layer (``per_layer`` says why it does). ``takes``:
    the keywords the target's definition here uses (``judged`` names it); a fix passes no other."""
    if not contract.derivations or contract.fix_safety == "none":
        return None
    derivations = tuple(d for d in contract.derivations if d.applies_to(qual or None))
    if not derivations:
        # vLLM's MMEncoderAttention.maybe_compute_seq_lens, say, needs the attention backend and the host
        # offsets, which a call site does not have: that belongs in the model's forward, once, where the fix
        # builds it with the helpers HOISTED_METADATA names (edits.py, hoist.py).
        return NoFix.because("nothing at the call can build it",
                             f"Compute it once per model forward with the engine's own helper "
                             f"(guardlint explain {contract.code}).", helpers=HOISTED_METADATA.get(qual))
    written = contract.fix_writes or (derivations[0].target,)
    untaken = [t for t in written if takes is not None and t.split(".", 1)[0] not in takes]
    if untaken:
        # No falling back to a later derivation (see choose_derivations): the preferred one is what the
        # target needs; where this release takes no such keyword, the finding says so.
        short = qual.rsplit(".", 1)[-1].removesuffix("[]") or "the target"
        return NoFix.because(f"{short} here takes no {untaken[0]}",
                             f"{short} as {judged or 'found'} does not use {untaken[0]}: the fix would pass a "
                             f"value it ignores.")
    contract = _with_derivations(contract, derivations)
    in_scope = in_scope or (lambda name: False)

    def missing_in(group):
        return tuple(n for n in group if n.split(".", 1)[0] not in bound_values
                     or is_none(bound_values[n.split(".", 1)[0]]))

    def source_of(name):
        expr = bound_values.get(name)
        if expr is None:
            return NoFix(f"{name} is not passed")
        if is_none(expr):
            return NoFix(f"{name} is None")
        if isinstance(expr, cst.Name):  # its code, without parentheses
            return expr.value
        problem = _source_problem(name, expr)
        return NoFix(problem) if problem else _code(expr.with_changes(lpar=(), rpar=()))

    if contract.fix_writes:
        return _write_all(contract, call, bound_values, missing_in, source_of, can_import, in_scope, per_layer)
    first = derivations[0]
    if per_layer and first.host_read and not first.cached:
        return NoFix.because(f"runs per layer in {per_layer_place(per_layer)}",
                             f"Writing {first.target} here would add a host read per layer: build it once per "
                             f"model forward, before the block loop ({first.template.split('(')[0]}(...)), and "
                             f"pass it down.", hoist=first)
    return _derive_into(contract, call, bound_values, missing_in, source_of, can_import)


def _write_all(contract: Contract, call: cst.Call, passed: dict, missing_in, source_of, can_import,
               in_scope, per_layer: str) -> Outcome:
    """Write every name of ``contract.fix_writes`` that is missing, each from a value in scope when one
    has its name, else from its first derivation (whose sources may be values written just before)."""
    written: dict[str, str] = {}
    uses: list[tuple[str, Optional[Derivation], str]] = []  # a None derivation: the value in scope is passed
    for target in contract.fix_writes:
        if not missing_in((target,)):
            continue
        if in_scope(target):
            written[target] = target
            uses.append((target, None, target))
            continue
        d = contract.derivation_for(target)
        if d is None:
            return NoFix(f"{target} has no derivation to write")
        if per_layer and d.host_read:
            # Made once where the layer loop runs and passed down instead (hoist.py): the call then gets this one
            # value, which its contract takes alone; values it was to be derived from here are derived there.
            return NoFix.because(f"runs per layer in {per_layer_place(per_layer)}",
                                 f"Deriving {target} here would be a host read per layer: compute it once per "
                                 f"model forward and pass it down.", hoist=_standalone(contract, d))
        sources = {}
        for name in placeholders(d.template):
            if name in written:
                text = written[name]
                sources[name] = text if reevaluation_problem(_parse_expression(text)) is None else f"({text})"
                continue
            if not missing_in((name,)):
                got = source_of(name)
            elif in_scope(name):
                got = name
            else:
                got = source_of(name)
            if isinstance(got, NoFix):
                return got
            sources[name] = got
        rendered = _render(d, sources)
        if isinstance(rendered, NoFix):
            return rendered
        written[target] = rendered
        uses.append((target, d, rendered))
    imports = _imports_for([u for u in uses if u[1] is not None], can_import)
    if isinstance(imports, NoFix):
        return imports
    new_call = call
    words = []
    for target, d, text in uses:
        value = _parse_expression(text)
        current = passed.get(target)
        if current is not None:
            new_call = new_call.with_changes(args=[_set_value(a, value) if a.value is current else a
                                                   for a in new_call.args])
            words.append(f"Set {target}={text}")
        else:
            new_call = append_argument(new_call, keyword_arg(target, value))
            words.append(f"Add {target}={text}")
        if d is not None and d.host_read:
            words[-1] += " (a host read, once per batch)"
    return Plan(new_call, imports, "; ".join(words))


def _standalone(contract: Contract, d: Derivation) -> Derivation:
    """``d`` with the values its template takes from other derivations of the contract written out, so that it
    reads only the call's own arguments (``int({seg_lens}.max())`` with seg_lens' template in place)."""
    template = d.template
    for name in placeholders(template):
        inner = contract.derivation_for(name)
        if inner is not None and inner is not d and not inner.host_read:
            template = template.replace("{" + name + "}", f"({inner.template})")
    return d if template == d.template else dataclasses.replace(d, template=template)


def plan_replace(contract: Contract, call: cst.Call, can_import: ImportCheck) -> Outcome:
    """Fix for ``dataclasses.replace(record, field=None, ...)``: derive from the replace call's own
    keywords, else from the record's fields (``record.seg_indptr``) when the record is re-evaluable."""
    if not contract.derivations or contract.fix_safety == "none":
        return None
    keywords = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
    positional = [a for a in call.args if a.keyword is None and not a.star]
    record = positional[0].value if positional else None

    def missing_in(group):
        return tuple(n for n in group if n in keywords and is_none(keywords[n]))

    def source_of(name):
        expr = keywords.get(name)
        if expr is not None and not is_none(expr):
            problem = _source_problem(name, expr)
            return NoFix(problem) if problem else _code(expr.with_changes(lpar=(), rpar=()))
        if record is None:
            return NoFix("the record to replace is not passed by position")
        problem = reevaluation_problem(record)
        if problem is not None or dotted(record) is None:
            return NoFix.because(f"the record is `{_short(record)}`, {problem or 'not a name'}",
                                 "The fix would evaluate it twice, which may differ.")
        return f"{dotted(record)}.{name}"

    return _derive_into(contract, call, keywords, missing_in, source_of, can_import)


def plan_positional(contract: Contract, call: cst.Call, label: str, qual: str = "",
                    params: Optional[Sequence[str]] = None) -> Outcome:
    """Fix for a ``positional`` contract: name every positional argument by the parameters of the
    resolved target ``qual`` (targets may differ: ours has fewer fields than the engine's), or by
    ``params``, those of the target's definition this file reaches."""
    if params is None:
        params = contract.params_for(qual) if qual else contract.params
    if contract.fix_safety == "none" or not params:
        return None
    if any(a.star for a in call.args):
        return NoFix.because("it passes *args or **kwargs", "The positions of its arguments are then unknown.")
    positional = [a for a in call.args if a.keyword is None]
    if len(positional) > len(params):
        return NoFix.because(f"{len(positional)} positional arguments, but {label} takes {len(params)}",
                             f"Its fields, in order: {', '.join(params)}.")
    names = params[: len(positional)]
    keywords = {a.keyword.value for a in call.args if a.keyword is not None}
    twice = [n for n in names if n in keywords]
    if twice:
        return NoFix(f"{twice[0]} is passed both by position and by keyword")
    index = 0
    args = []
    for a in call.args:
        if a.keyword is None:
            a = a.with_changes(keyword=cst.Name(names[index]), equal=_NO_SPACE_EQUAL)
            index += 1
        args.append(a)
    return Plan(call.with_changes(args=args), (), "Name the positional arguments: " + ", ".join(names))
