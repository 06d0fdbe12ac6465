"""User-declared contracts from ``[[tool.guardlint.contracts]]``: validated, turned into ``Contract``s.

Errors name the offending key so a bad configuration is fixed in one look.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from .catalog import GL001
from .model import Contract, Derivation, Diagnosis, Target


class ConfigError(ValueError):
    """A [tool.guardlint] configuration problem; the message names the key."""


CONTRACT_KEYS = {"call", "params", "require", "code", "name", "message", "derive", "kind", "severity"}
_CODE = re.compile(r"^GL\d{3}$")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_QUALNAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _str_list(value: Any, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key}: expected a list of strings, got {type(value).__name__}: {value!r}")
    return tuple(value)


def _builtin_codes() -> frozenset:
    from .catalog import BUILTIN

    return frozenset(c.code for c in BUILTIN)


def contract_from_config(raw: Mapping[str, Any], index: int = 0) -> Contract:
    where = f"tool.guardlint.contracts[{index}]"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a table, got {type(raw).__name__}")
    unknown = sorted(set(raw) - CONTRACT_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(CONTRACT_KEYS))})")
    if "call" not in raw:
        raise ConfigError(f"{where}.call: missing (the qualified name of the callable, e.g. 'mylib.ops.fwd')")
    call = raw["call"]
    if not isinstance(call, str) or not _QUALNAME.match(call):
        raise ConfigError(f"{where}.call: expected a dotted qualified name, got {call!r}")
    params = _str_list(raw.get("params", []), f"{where}.params")
    for p in params:
        if not _IDENT.match(p):
            raise ConfigError(f"{where}.params: {p!r} is not a parameter name")
    if "require" not in raw:
        raise ConfigError(f"{where}.require: missing (a list of argument groups, e.g. [[\"max_seqlen\"]])")
    req = raw["require"]
    if not isinstance(req, list) or not req:
        raise ConfigError(f"{where}.require: expected a non-empty list of lists of names, got {req!r}")
    groups = []
    for i, g in enumerate(req):
        if isinstance(g, str):
            g = [g]
        groups.append(_str_list(g, f"{where}.require[{i}]"))
    if params:
        for i, g in enumerate(groups):
            for name in g:
                if name.split(".", 1)[0] not in params:
                    raise ConfigError(f"{where}.require[{i}]: {name!r} is not one of params "
                                      f"{list(params)} of contract {call!r}; add it to params or fix the name")
    code = raw.get("code", "GL001")
    if not isinstance(code, str) or not _CODE.match(code):
        raise ConfigError(f"{where}.code: expected a code like 'GL001', got {code!r}")
    if code != "GL001" and code in _builtin_codes():
        raise ConfigError(f"{where}.code: {code!r} is a built-in rule code (contract {call!r}); expected "
                          f"GL001 or a code no built-in rule uses, like 'GL900'")
    kind = raw.get("kind", "function")
    if kind not in ("function", "class", "instance"):
        raise ConfigError(f"{where}.kind: expected 'function', 'class' or 'instance', got {kind!r}")
    severity = raw.get("severity", "error")
    if severity not in ("error", "warning"):
        raise ConfigError(f"{where}.severity: expected 'error' or 'warning', got {severity!r}")
    derive = raw.get("derive", {})
    if not isinstance(derive, Mapping):
        raise ConfigError(f"{where}.derive: expected a table of argument = \"template\", got {derive!r}")
    derivations = []
    for target, template in derive.items():
        if not isinstance(template, str):
            raise ConfigError(f"{where}.derive.{target}: expected a template string, got {template!r}")
        sources = tuple(dict.fromkeys(re.findall(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", template)))
        for s in sources:
            if params and s not in params:
                raise ConfigError(f"{where}.derive.{target}: placeholder {{{s}}} is not one of params")
        derivations.append(Derivation(target=target, sources=sources, name="template", template=template))
    message = raw.get("message", f"{call.rsplit('.', 1)[-1]} needs " + " or ".join("+".join(g) for g in groups))
    if not isinstance(message, str):
        raise ConfigError(f"{where}.message: expected a string, got {message!r}")
    name = raw.get("name", GL001.name)
    if not isinstance(name, str):
        raise ConfigError(f"{where}.name: expected a string, got {name!r}")
    base = GL001.diagnosis
    return Contract(
        code=code,
        name=name,
        summary=message,
        kind="call",
        severity=severity,
        targets=(Target(call, kind),),
        params=params,
        require=tuple(groups),
        derivations=tuple(derivations),
        fix_safety="unsafe" if derivations else "none",
        user_defined=True,
        diagnosis=Diagnosis(
            message=message,
            headline=message,  # the user's own words head the line: nothing else says what is wrong
            what_it_means=base.what_it_means,
            when_it_happens=base.when_it_happens,
            solutions=base.solutions,
            fix_safety=base.fix_safety,
        ),
    )
