"""``GuardError``: the one exception every guardlint runtime failure raises.

It carries the rule code, the argument, what was expected and what was got (shapes, dtypes, devices;
never tensor contents: printing them would be a device sync and a data leak), and the fix.
"""
from __future__ import annotations

from typing import Any, Optional

from guardlint.contracts import get as _get_contract


def describe(value: Any) -> str:
    """A short, content-free description of a value for error messages."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        device = getattr(value, "device", None)
        where = f" on {device}" if device is not None else ""
        return f"{type(value).__name__}(shape={tuple(shape)}, dtype={dtype}{where})"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of length {len(value)}"
    return type(value).__name__


class GuardError(ValueError, RuntimeError):
    """A coded guardlint error. Subclasses both ``ValueError`` and ``RuntimeError`` so handlers written
    for the engine's own errors still catch it.

    Attributes: ``code`` (e.g. ``"GL101"``), ``argument``, ``expected``, ``got``, ``function``, ``fix``.
    """

    def __init__(self, code: str, *, argument: str, expected: str, got: str, function: Optional[str] = None,
                 fix: Optional[str] = None, detail: str = ""):
        self.code = code
        self.argument = argument
        self.expected = expected
        self.got = got
        self.function = function
        self.detail = detail
        try:
            contract = _get_contract(code)
        except KeyError:
            contract = None
        self.name = contract.name if contract else ""
        if fix is None and contract is not None and contract.diagnosis.solutions:
            fix = contract.diagnosis.solutions[0]
        self.fix = fix
        where = f"{function}(): " if function else ""
        text = (f"[{code}{' ' + self.name if self.name else ''}] {where}argument {argument!r}: "
                f"expected {expected}, got {got}.")
        if detail:
            text += f" {detail}"
        if fix:
            text += f"\n  fix: {fix}"
        text += f"\n  see: guardlint explain {code}"
        super().__init__(text)

    def __reduce__(self):
        return (_rebuild, (self.code, self.argument, self.expected, self.got, self.function, self.fix,
                           self.detail))


def _rebuild(code, argument, expected, got, function, fix, detail=""):
    return GuardError(code, argument=argument, expected=expected, got=got, function=function, fix=fix,
                      detail=detail)
