"""What a call of a known varlen attention kernel (``catalog.VARLEN_KERNELS``) establishes about its arguments.

A tree that imports ``flash_attn_varlen_func`` from flash-attn (or vLLM's fork) and hands it offsets states a
fact, whatever the names: the offsets are read on the device, so each parameter of the calling def they derive
from, through torch ops that keep a tensor where it is (``F.pad(torch.cumsum(seq_len, 0), (1, 0)).int()``), is a
device tensor of sequence-length metadata. Its int parameters (``max_seqlen_q``) are converted on the host: a
0-d device tensor handed there is read back at every call. Both halves of the linter ask this module, on
CPython's tree (``summaries`` through ``prefilter._tainted``, ``host_sync`` through ``file_facts``, which the
engine hands it with the file's tree).
"""
from __future__ import annotations

import ast
from typing import Any, Optional

from guardlint.contracts import catalog

from .engine_defs import _dotted, _top_level, imports_of, qualify
from .patterns import KEEP_METHODS, KERNEL_NAMES, TORCH_JOIN, TORCH_KEEP

# Ops whose result lives where their tensor does: the value model's (``patterns``); ``t.to(...)`` and ``t.type(...)``
# only with a dtype (``_keeps_place``).
_SAME_PLACE_FUNCTIONS = TORCH_KEEP | TORCH_JOIN
_TORCH_BASES = frozenset({"torch", "F", "torch.nn.functional", "nn.functional"})
_SAME_PLACE_METHODS = KEEP_METHODS | {"to"}


def may_call(data: bytes) -> bool:
    """A file without one of the kernels' names in its text calls none of them."""
    return any(n in data for n in KERNEL_NAMES)


def kernels_of(body: list, module: Optional[str] = None, is_package: bool = False) -> dict:
    """Callee text as this module writes it -> the kernel's entry, for the names its imports bind to a known
    kernel (``from flash_attn import flash_attn_varlen_func``, ``import flash_attn`` then
    ``flash_attn.flash_attn_varlen_func``), in a ``try`` or not. A name that alternative imports bind under
    different conditions (``if is_flash_attn_2_available(): from flash_attn import ...``, then ``if is_npu_available:
    from ...npu_flash_attention import npu_flash_attn_varlen_func as flash_attn_varlen_func``, verl's models) is the
    kernel where one of them binds it: the platform that takes that branch runs it."""
    out: dict = {}
    for stmt in _top_level(body):
        if not isinstance(stmt, (ast.Import, ast.ImportFrom)):
            continue
        imports = imports_of([stmt])
        for local in imports:
            qualified = qualify(local, imports, module, is_package)
            if qualified is None:
                continue
            for name, entry in catalog.VARLEN_KERNELS.items():
                if name == qualified:
                    out[local] = (name, entry)
                elif name.startswith(qualified + "."):
                    out[local + name[len(qualified):]] = (name, entry)
    return out


def arguments(call: ast.Call, entry: dict, kind: str) -> list:
    """(parameter name, argument) of ``call`` for the kernel's ``kind`` parameters ("offsets" or "ints")."""
    positional = []
    for a in call.args:
        if isinstance(a, ast.Starred):
            break
        positional.append(a)
    keywords = {k.arg: k.value for k in call.keywords if k.arg}
    out = []
    for position, name in entry[kind]:
        if name in keywords:
            out.append((name, keywords[name]))
        elif position < len(positional):
            out.append((name, positional[position]))
    return out


def _keeps_place(call: ast.Call) -> bool:
    """``t.to(...)`` with a dtype only: no device, no string, no other tensor (which would move it)."""
    if any(k.arg in ("device", None) for k in call.keywords):
        return False
    return all(isinstance(a, ast.Attribute) and (_dotted(a) or "").startswith("torch.") for a in call.args)


def _single_assignments(func: ast.AST) -> dict:
    """Names the def binds exactly once, by a plain ``name = value``, -> that value; a name bound any other way
    or more than once maps to None (its value is not one expression)."""
    out: dict = {}
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            out[name] = None if name in out else node.value
            continue
        targets: list = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            targets = [node.target]
        elif isinstance(node, ast.NamedExpr):
            targets = [node.target]
        for target in targets:
            for n in ast.walk(target):
                if isinstance(n, ast.Name):
                    out[n.id] = None
    return out


def _roots(expr: ast.AST, assigned: dict, params: frozenset, seen: set) -> set:
    """The parameters ``expr``'s tensor derives from through ops that keep it where it is."""
    if isinstance(expr, ast.Name):
        name = expr.id
        if name in assigned:
            value = assigned[name]
            if value is None or name in seen:
                return set()
            return _roots(value, assigned, params, seen | {name})
        return {name} if name in params else set()
    if isinstance(expr, ast.Subscript):
        return _roots(expr.value, assigned, params, seen)
    if isinstance(expr, ast.BinOp):
        return _roots(expr.left, assigned, params, seen) | _roots(expr.right, assigned, params, seen)
    if isinstance(expr, ast.UnaryOp):
        return _roots(expr.operand, assigned, params, seen)
    if isinstance(expr, (ast.List, ast.Tuple)):
        out: set = set()
        for e in expr.elts:
            out |= _roots(e, assigned, params, seen)
        return out
    if not isinstance(expr, ast.Call) or not isinstance(expr.func, ast.Attribute):
        return set()
    func = expr.func
    if _dotted(func.value) in _TORCH_BASES and func.attr in _SAME_PLACE_FUNCTIONS and expr.args:
        return _roots(expr.args[0], assigned, params, seen)
    if func.attr in _SAME_PLACE_METHODS and (func.attr not in ("to", "type") or _keeps_place(expr)):
        return _roots(func.value, assigned, params, seen)
    return set()


def offset_params(func: Any, kernels: dict) -> frozenset:
    """The parameters of ``func`` from which a value it hands to a known kernel's offsets derives on the device:
    device tensors of sequence-length metadata by that fact."""
    if not kernels:
        return frozenset()
    a = func.args
    assigned = _single_assignments(func)
    # A parameter the def binds again is no longer what the caller passed.
    params = frozenset(p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)) - set(assigned)
    out: set = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Call):
            found = kernels.get(_dotted(node.func) or "")
            if found is None:
                continue
            for _, arg in arguments(node, found[1], "offsets"):
                out |= _roots(arg, assigned, params, set())
    return frozenset(out)


def _hands_metadata_to_ints(func: Any, kernels: dict, seeds: frozenset) -> bool:
    """Whether a kernel call in ``func`` hands an int parameter a value derived, through ops that keep a tensor
    where it is, from a parameter that is device metadata by its name or by ``seeds`` (what the value model
    would find on the device there; a value from any other call is no such value)."""
    from .patterns import is_seqlen_name

    assigned = _single_assignments(func)
    a = func.args
    params = frozenset(p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)
                       if p.arg in seeds or is_seqlen_name(p.arg)) - set(assigned)
    if not params:
        return False
    for call in ast.walk(func):
        if not isinstance(call, ast.Call):
            continue
        found = kernels.get(_dotted(call.func) or "")
        if found is not None and any(_roots(arg, assigned, params, set())
                                     for _, arg in arguments(call, found[1], "ints")):
            return True
    return False


def _unpacked(func: Any) -> dict:
    """Names ``func`` binds once, by unpacking a call's result into a tuple target (``q, (cu_q, cu_k), (max_q, max_k) =
    prepare(...)``): name -> (the call, the index path of its element)."""
    out: dict = {}
    counts: dict = {}
    for node in ast.walk(func):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            counts[node.id] = counts.get(node.id, 0) + 1
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.value, ast.Call)
                and isinstance(node.targets[0], (ast.Tuple, ast.List))):
            continue
        todo: list = [(node.targets[0], ())]
        while todo:
            target, path = todo.pop()
            if any(isinstance(e, ast.Starred) for e in target.elts):
                continue
            for i, e in enumerate(target.elts):
                if isinstance(e, ast.Name):
                    out[e.id] = (node.value, (*path, i))
                elif isinstance(e, (ast.Tuple, ast.List)):
                    todo.append((e, (*path, i)))
    return {name: got for name, got in out.items() if counts.get(name) == 1}


def _returned_display(helper: Any) -> Optional[ast.AST]:
    """The tuple display a def returns, where its own body has one return and that is one."""
    returns, todo = [], list(helper.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Return):
            returns.append(node)
        todo.extend(ast.iter_child_nodes(node))
    if len(returns) != 1 or not isinstance(returns[0].value, (ast.Tuple, ast.List)):
        return None
    return returns[0].value


def _element(display: ast.AST, path: tuple) -> Optional[ast.AST]:
    for i in path:
        if not isinstance(display, (ast.Tuple, ast.List)) or i >= len(display.elts) \
                or any(isinstance(e, ast.Starred) for e in display.elts):
            return None
        display = display.elts[i]
    return display


def _beside(expr: ast.AST, assigned: dict, seen: frozenset = frozenset()) -> set:
    """The names of the tensors ``expr``'s tensor derives from through ops that keep it where it is (itself, where
    it is a name): ``max_length = cu_seqlens.diff().max()`` lives beside ``cu_seqlens``."""
    if isinstance(expr, ast.Name):
        value = assigned.get(expr.id)
        if value is None or expr.id in seen:
            return {expr.id}
        return {expr.id} | _beside(value, assigned, seen | {expr.id})
    if isinstance(expr, ast.Subscript):
        return _beside(expr.value, assigned, seen)
    if isinstance(expr, ast.BinOp):
        return _beside(expr.left, assigned, seen) | _beside(expr.right, assigned, seen)
    if isinstance(expr, ast.UnaryOp):
        return _beside(expr.operand, assigned, seen)
    if not isinstance(expr, ast.Call) or not isinstance(expr.func, ast.Attribute):
        return set()
    func = expr.func
    if _dotted(func.value) in _TORCH_BASES and func.attr in _SAME_PLACE_FUNCTIONS and expr.args:
        return _beside(expr.args[0], assigned, seen) if not isinstance(expr.args[0], (ast.Tuple, ast.List)) \
            else set().union(*(_beside(e, assigned, seen) for e in expr.args[0].elts))
    if func.attr in _SAME_PLACE_METHODS and (func.attr not in ("to", "type") or _keeps_place(expr)):
        return _beside(func.value, assigned, seen)
    return set()


def unpacked_ints(func: Any, kernels: dict, defs: dict) -> dict:
    """{(int parameter, argument name): (helper, offsets parameter)} of the kernel calls in ``func`` whose int
    argument is unpacked from a call of a def of the module (``defs``) that returns a tuple display, where that
    element derives, through ops that keep a tensor where it is, from the tensor of an element the same call hands
    the kernel's offsets (``max_length = cu_seqlens.diff().max(); return (..., (cu_seqlens, cu_seqlens), (max_length,
    max_length))``: verl's ``prepare_fa2_from_position_ids``). The offsets are on the device (the kernel reads them
    there), so the int is a 0-d device tensor, whatever the caller's names or its parameters' devices."""
    if not kernels or not defs:
        return {}
    unpacked = _unpacked(func)
    if not unpacked:
        return {}
    out: dict = {}
    for node in ast.walk(func):
        if not isinstance(node, ast.Call):
            continue
        found = kernels.get(_dotted(node.func) or "")
        if found is None:
            continue
        offsets = [(p, a.id) for p, a in arguments(node, found[1], "offsets")
                   if isinstance(a, ast.Name) and a.id in unpacked]
        for param, arg in arguments(node, found[1], "ints"):
            if not isinstance(arg, ast.Name) or arg.id not in unpacked:
                continue
            call, path = unpacked[arg.id]
            helper = defs.get(call.func.id) if isinstance(call.func, ast.Name) else None
            if helper is None:
                continue
            display = _returned_display(helper)
            element = _element(display, path) if display is not None else None
            if display is None or element is None:
                continue
            assigned = _single_assignments(helper)
            here = _beside(element, assigned)
            for offsets_param, name in offsets:
                other = unpacked[name]
                beside = _element(display, other[1]) if other[0] is call else None
                if beside is not None and here & _beside(beside, assigned):
                    out[(param, arg.id)] = (helper.name, offsets_param)
                    break
    return out


def call_lines(tree: ast.AST, kernels: dict) -> list:
    """The sorted lines of the calls of ``kernels`` in ``tree`` (one walk; none without kernels)."""
    if not kernels:
        return []
    return sorted(n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and (_dotted(n.func) or "") in kernels)


def holds_a_call(func: Any, lines: list) -> bool:
    """Whether one of the kernel calls at ``lines`` is within ``func``'s lines."""
    import bisect

    i = bisect.bisect_left(lines, func.lineno)
    return i < len(lines) and lines[i] <= (func.end_lineno or func.lineno)


def file_facts(tree: Optional[ast.Module], data: bytes, module: Optional[str] = None,
               is_package: bool = False) -> tuple[dict, dict, bool, dict]:
    """(the kernels the file's imports bind, ``kernels_of``; def qualname -> ``offset_params``; whether a kernel
    call may hand metadata to an int parameter, by the tree pre-filter's taint; def qualname -> ``unpacked_ints``),
    empty for a file that names no known kernel. The file needs GL104's exact reading only where a def has such
    parameters or such a call."""
    if tree is None or not may_call(data):
        return {}, {}, False, {}
    kernels = kernels_of(tree.body, module, is_package)
    lines = call_lines(tree, kernels)
    if not lines:
        return kernels, {}, False, {}
    seeds: dict = {}
    unpacked: dict = {}
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    suspect = False

    def visit(node: ast.AST, scope: tuple) -> None:
        nonlocal suspect
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if not holds_a_call(child, lines):
                    continue  # (nor do the defs nested in it)
                inner = (*scope, child.name)
                found = offset_params(child, kernels)
                if found:
                    qual = ".".join(inner)
                    seeds[qual] = seeds.get(qual, frozenset()) | found
                ints = unpacked_ints(child, kernels, defs)
                if ints:
                    unpacked[".".join(inner)] = ints
                if not suspect:
                    suspect = bool(ints) or _hands_metadata_to_ints(child, kernels, found)
                visit(child, inner)
            elif isinstance(child, ast.ClassDef):
                visit(child, (*scope, child.name))
            else:
                visit(child, scope)

    visit(tree, ())
    return kernels, seeds, suspect, unpacked
