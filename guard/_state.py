"""Guard mode (off / derive / strict), the counters behind ``stats()`` and the ``on_derive`` hook.

The mode is one module-level int that every guarded call reads first, so ``off`` costs one global load.
``GUARDLINT_MODE`` sets it once, at import. Counters are plain ints: the fast path never touches them.
"""
from __future__ import annotations

import collections
import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

OFF, DERIVE, STRICT = 0, 1, 2
MODES = {"off": OFF, "derive": DERIVE, "strict": STRICT}
_NAMES = {value: name for name, value in MODES.items()}
ENV_VAR = "GUARDLINT_MODE"


def _parse(value: object, source: str) -> int:
    key = value.strip().lower() if isinstance(value, str) else value
    if not isinstance(key, str) or key not in MODES:
        from .errors import GuardError  # a ValueError too, as this was
        raise GuardError("GL002", argument=source, function=None, got=repr(value),
                         expected=f"a guard mode: {', '.join(repr(m) for m in MODES)}",
                         fix=f"use one of {', '.join(MODES)} (GUARDLINT_MODE, set_mode() or mode())")
    return MODES[key]


# Read by every guarded call; 0 (off) is falsy so the pass-through test is a single `if not`.
# Set but empty (``GUARDLINT_MODE=``) means the default, as unset does.
current: int = _parse(os.environ.get(ENV_VAR, "").strip() or "derive", f"environment variable {ENV_VAR}")


def set_mode(mode: str) -> str:
    """Set the guard mode for the whole process (``"off"``, ``"derive"`` or ``"strict"``); returns the
    previous one. Not thread-local: it is the switch a deployment flips, not a per-request setting."""
    global current
    previous = _NAMES[current]
    current = _parse(mode, "set_mode()")
    return previous


def get_mode() -> str:
    return _NAMES[current]


@contextlib.contextmanager
def mode(name: str) -> Iterator[str]:
    """``with mode("strict"): ...`` runs a block in another mode and restores the previous one."""
    previous = set_mode(name)
    try:
        yield name
    finally:
        set_mode(previous)


@dataclass(frozen=True)
class DerivationEvent:
    """One value the guard derived: ``target`` of ``function`` from ``sources`` by ``derivation``."""

    function: str
    target: str
    derivation: str
    sources: tuple
    host_read: bool

    def __str__(self) -> str:
        read = " (1 host read)" if self.host_read else ""
        return (f"guardlint: derived {self.target} for {self.function}() from "
                f"{', '.join(self.sources)} by {self.derivation}{read}")


class _Counters:
    __slots__ = ("host_reads", "device_reads", "cache_misses", "derivations", "cached",
                 "checks", "checks_skipped", "events", "hook")

    def __init__(self) -> None:
        self.hook: Optional[Callable[[DerivationEvent], object]] = None
        self.reset()

    def reset(self) -> None:
        self.host_reads = 0      # tensor values read into Python (a sync when the tensor is on a GPU)
        self.device_reads = 0    # ... of which from a non-CPU device
        self.cache_misses = 0
        self.derivations: dict[str, int] = {}  # fresh derivations by name
        self.cached: dict[tuple, int] = {}      # cache hits by the tuple of derivation names served
        self.checks = 0          # strict validations run
        self.checks_skipped = 0  # strict value checks skipped (graph capture, compile tracing)
        self.events: collections.deque = collections.deque(maxlen=64)


counters = _Counters()


def note_read(tensor) -> None:
    counters.host_reads += 1
    if tensor.device.type != "cpu":
        counters.device_reads += 1


def note_derived(function: str, target: str, derivation: str, sources: tuple, *, fresh: bool,
                 host_read: bool) -> None:
    """Count a derived value; a fresh one (not served from the cache) is also an event and a hook call."""
    if not fresh:
        note_cached(derivation)
        return
    counters.derivations[derivation] = counters.derivations.get(derivation, 0) + 1
    event = DerivationEvent(function, target, derivation, tuple(sources), host_read)
    counters.events.append(event)
    if counters.hook is not None:
        counters.hook(event)


def note_cached(*derivations: str) -> None:
    """Count values served from the cache (no event, no hook: they were reported when derived).
    One dict update per call; ``stats()`` spreads the counts over the derivation names."""
    cached = counters.cached
    cached[derivations] = cached.get(derivations, 0) + 1


def stats() -> dict:
    """Counts since the last ``reset_stats()``: ``host_reads`` (tensor values read into Python because a
    derivation or a strict check needed them; each is a device sync when the tensor is on a GPU; a host tensor
    read only to check a caller's values for free is not counted), ``device_reads`` (those from a GPU), ``cache_hits``,
    ``cache_misses``, ``derivations`` (by derivation name, cached uses included), ``checks`` and
    ``checks_skipped`` (strict validations run / skipped under capture or tracing), and ``events``: the
    most recent fresh derivations (``DerivationEvent``), oldest first."""
    c = counters
    derivations = dict(c.derivations)
    hits = 0
    for names, count in c.cached.items():
        hits += count * len(names)
        for name in names:
            derivations[name] = derivations.get(name, 0) + count
    return {
        "host_reads": c.host_reads,
        "device_reads": c.device_reads,
        "cache_hits": hits,
        "cache_misses": c.cache_misses,
        "derivations": derivations,
        "checks": c.checks,
        "checks_skipped": c.checks_skipped,
        "events": list(c.events),
    }


def reset_stats() -> None:
    hook = counters.hook
    counters.reset()
    counters.hook = hook


def on_derive(callback: Optional[Callable[[DerivationEvent], object]]):
    """Call ``callback(event)`` for each freshly derived value (not for cache hits); ``None`` removes it.
    Returns the callback, so it also works as a decorator. ``on_derive(print)`` prints one line each."""
    if callback is not None and not callable(callback):
        raise TypeError(f"on_derive() takes a callable or None, got {type(callback).__name__}")
    counters.hook = callback
    return callback
