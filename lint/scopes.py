"""Scope collection: one libcst walk of a file fills its scopes (bindings, aliases, attribute stores) and
lists every call with the scope, enclosing def and indentation it is made in, and why it runs once per
layer. The checker resolves callees against what this collects.
"""
from __future__ import annotations

from typing import Optional

import libcst as cst

from .host_sync import _layer_loop
from .names import Binding, ClassInfo, FuncInfo, Scope, dotted, is_none
from .patterns import PER_LAYER_CLASS_SUFFIXES


class Collector:
    """Bindings per scope, ``self.<attr> = <call>`` per class, attribute stores per function, and every
    call with the scope it is made in. ``seq`` orders bindings, calls and stores in source order."""

    def __init__(self, module_name: Optional[str] = None, is_package: bool = False):
        self.module_name = module_name
        self.is_package = is_package
        self.module = Scope("module", None)
        self.scope = self.module
        self.func: Optional[FuncInfo] = None
        self.seq = 0
        self.calls: list[cst.Call] = []
        # (call, scope, seq, enclosing def, indentation of the enclosing block)
        self.sites: list[tuple[cst.Call, Scope, int, Optional[FuncInfo], str]] = []
        self.default_indent = "    "
        self._indents: list[str] = []
        self.indent = ""
        # id(call) -> the dotted name its result was assigned to (``info = C(...)`` -> "info").
        self.assigned: dict[int, str] = {}
        self._bodies: dict[int, Scope] = {}
        self._restore: list[tuple[Scope, Optional[FuncInfo]]] = []
        # ``obj.attr = value`` anywhere: (class of the method it is in or None, function scope, seq,
        # object with local aliases replaced by what they alias, attribute, value).
        self.stores: list[tuple] = []
        # id(call) -> why it runs once per layer (a per-layer forward or a loop over layers).
        self.per_layer: dict[int, str] = {}
        self._layer_contexts: list[Optional[str]] = []
        self._classes: list[Optional[str]] = []
        # Names bound in the module scope since the caller last emptied it (None: not kept).
        self.module_bound: Optional[set[str]] = None
        # id(FuncInfo) -> its def: the checker reads a constructor's body for the backends it allows.
        self.defs: dict[int, cst.FunctionDef] = {}

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def bind(self, name: str, kind: str, value=None, scope: Optional[Scope] = None) -> None:
        s = scope or self.scope
        if name in s.nonlocal_names:
            return
        if name in s.global_names:
            s = self.module
        s.bindings.setdefault(name, []).append(Binding(self._next(), kind, value))
        if s is self.module and self.module_bound is not None:
            self.module_bound.add(name)

    # imports
    def visit_Import(self, node: cst.Import) -> None:
        for alias in node.names:
            full = dotted(alias.name)
            if full is None:
                continue
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                self.bind(alias.asname.name.value, "import", full)
            else:
                head = full.split(".", 1)[0]
                self.bind(head, "import", head)

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        base: Optional[str] = dotted(node.module) if node.module is not None else ""
        if node.relative:
            base = self._absolute(base or "", len(node.relative))
        if isinstance(node.names, cst.ImportStar):
            if base:
                self.module.star_modules.append(base)
            return
        for alias in node.names:
            name = dotted(alias.name)
            if name is None:
                continue
            bound = name
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                bound = alias.asname.name.value
            if base:
                self.bind(bound, "import", f"{base}.{name}")
            else:
                self.bind(bound, "local")

    def _absolute(self, module: str, level: int) -> Optional[str]:
        if not self.module_name:
            return None
        parts = self.module_name.split(".")
        if not self.is_package:
            parts = parts[:-1]
        if level - 1 > len(parts):
            return None
        parts = parts[: len(parts) - (level - 1)]
        if module:
            parts.append(module)
        return ".".join(parts) or None

    # definitions and scopes
    def _push(self, scope: Scope, func: Optional[FuncInfo] = None) -> None:
        self._restore.append((self.scope, self.func))
        self.scope = scope
        if func is not None:
            self.func = func

    def _pop(self, node=None) -> None:
        self.scope, self.func = self._restore.pop()

    def _qualname(self, name: str) -> Optional[str]:
        if self.scope is self.module and self.module_name:
            return f"{self.module_name}.{name}"
        return None

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        name = node.name.value
        info = FuncInfo(name, [d.decorator for d in node.decorators], self.scope, self.seq + 1, self.func,
                        self._qualname(name))
        self.bind(name, "def", info)
        self.defs[id(info)] = node
        inner = Scope("function", self.scope, info)
        p = node.params
        positional = [*p.posonly_params, *p.params]
        if (self.scope.kind == "class" and positional
                and not any(dotted(d) in ("staticmethod", "classmethod") for d in info.decorators)):
            inner.bindings[positional[0].name.value] = [Binding(self._next(), "self", self.scope.info)]
            positional = positional[1:]
        rest = [*positional, *p.kwonly_params]
        for star in (p.star_arg, p.star_kwarg):
            if isinstance(star, cst.Param):
                rest.append(star)
        for param in rest:
            self.bind(param.name.value, "local", scope=inner)
        # Decorators, defaults and annotations are evaluated outside; the body runs inside.
        self._bodies[id(node.body)] = inner
        self._restore.append((self.scope, self.func))
        owner = self._classes[-1] if self._classes else None
        context = None
        if owner and (name == "forward" or name.startswith("_")) and not name.startswith("__") \
                and owner.lower().endswith(PER_LAYER_CLASS_SUFFIXES):
            context = f"{owner}.{name}, which runs once per layer"
        self._layer_contexts.append(context)
        self._classes.append(None)

    def leave_FunctionDef(self, node) -> None:
        self._pop()
        self._layer_contexts.pop()
        self._classes.pop()

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        name = node.name.value
        info = ClassInfo(name, self._qualname(name))
        self.bind(name, "def", info)
        self._bodies[id(node.body)] = Scope("class", self.scope, info)
        self._restore.append((self.scope, self.func))
        self._classes.append(name)

    def leave_ClassDef(self, node) -> None:
        self._pop()
        self._classes.pop()

    def _enter_body(self, node) -> None:
        scope = self._bodies.pop(id(node), None)
        if scope is not None:
            self.scope = scope
            if isinstance(scope.info, FuncInfo):
                self.func = scope.info

    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> None:
        self._enter_body(node)
        # A fix re-renders a call alone; its continuation lines are indented relative to the block.
        self._indents.append(self.default_indent if node.indent is None else node.indent)
        self.indent = "".join(self._indents)

    def leave_IndentedBlock(self, node: cst.IndentedBlock) -> None:
        self._indents.pop()
        self.indent = "".join(self._indents)

    visit_SimpleStatementSuite = _enter_body

    def visit_Lambda(self, node: cst.Lambda) -> None:
        inner = Scope("lambda", self.scope)
        p = node.params
        for param in (*p.posonly_params, *p.params, *p.kwonly_params, p.star_arg, p.star_kwarg):
            if isinstance(param, cst.Param):
                self.bind(param.name.value, "local", scope=inner)
        self._push(inner)

    leave_Lambda = _pop

    def _enter_comprehension(self, node) -> None:
        inner = Scope("comp", self.scope)
        self._push(inner)
        comp = node.for_in
        while comp is not None:
            self._target(comp.target, None)
            comp = comp.inner_for_in

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _enter_comprehension
    leave_ListComp = leave_SetComp = leave_DictComp = leave_GeneratorExp = _pop

    def visit_Global(self, node: cst.Global) -> None:
        self.scope.global_names.update(n.name.value for n in node.names)

    def visit_Nonlocal(self, node: cst.Nonlocal) -> None:
        self.scope.nonlocal_names.update(n.name.value for n in node.names)

    # assignments
    def visit_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:
            self._target(t.target, node.value)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        if node.value is not None:
            self._target(node.target, node.value)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._target(node.target, None)

    def visit_For(self, node: cst.For) -> None:
        self._target(node.target, None)
        loop = _layer_loop(node.iter)
        self._layer_contexts.append(f"a loop over {loop}" if loop else None)

    def leave_For(self, node: cst.For) -> None:
        self._layer_contexts.pop()

    def visit_WithItem(self, node: cst.WithItem) -> None:
        if node.asname is not None:
            self._target(node.asname.name, None)

    def visit_ExceptHandler(self, node: cst.ExceptHandler) -> None:
        if node.name is not None and isinstance(node.name.name, cst.Name):
            self.bind(node.name.name.value, "local")

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        if isinstance(node.target, cst.Name):
            self.bind(node.target.value, "local", scope=self.scope.function_scope())

    def visit_MatchAs(self, node) -> None:
        if node.name is not None:
            self.bind(node.name.value, "local")

    def _target(self, target: cst.BaseExpression, value: Optional[cst.BaseExpression]) -> None:
        if isinstance(target, cst.Name):
            if isinstance(value, cst.Call):
                self.bind(target.value, "call", (value.func, self.scope, self.seq + 1, value))
                self.assigned[id(value)] = target.value
            elif not is_none(value):
                alias = dotted(value) if isinstance(value, (cst.Name, cst.Attribute)) else None
                if alias is not None:
                    self.scope.function_scope().aliases.setdefault(target.value, []).append(alias)
                # ``X = None`` is a placeholder (``except ImportError: X = None``), not a new meaning.
                self.bind(target.value, "local")
        elif isinstance(target, cst.Attribute):
            obj = dotted(target.value)
            if obj is None:
                return
            attr = target.attr.value
            fn = self.scope.function_scope()
            seq = self._next()
            fn.attr_stores.append((seq, obj, attr, is_none(value), value))
            head, _, rest = obj.partition(".")
            owner = self.func.def_scope.info if self.func is not None else None
            owner = owner if isinstance(owner, ClassInfo) else None
            for base in fn.aliases.get(head, [head]):
                self.stores.append((owner, fn, seq, base + ("." + rest if rest else ""), attr, value))
            if isinstance(value, cst.Call):
                self.assigned[id(value)] = f"{obj}.{attr}"
                cls = self._self_class(obj)
                if cls is not None:
                    cls.attrs.setdefault(attr, []).append((value.func, self.scope, self.seq, value))
        elif isinstance(target, (cst.Tuple, cst.List)):
            for el in target.elements:
                self._target(el.value, None)
        elif isinstance(target, cst.StarredElement):
            self._target(target.value, None)

    def _self_class(self, obj: str) -> Optional[ClassInfo]:
        binds = self.scope.function_scope().bindings.get(obj)
        value = binds[0].value if binds and binds[0].kind == "self" else None
        return value if isinstance(value, ClassInfo) else None

    # calls
    def visit_Call(self, node: cst.Call) -> None:
        self.calls.append(node)
        self.sites.append((node, self.scope, self._next(), self.func, self.indent))
        context = next((c for c in reversed(self._layer_contexts) if c), None)
        if context:
            self.per_layer[id(node)] = context
