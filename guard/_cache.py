"""Small LRUs of values derived from tensors, keyed on the tensor's identity and version.

An entry is valid while its tensor is alive (a weakref, whose callback drops the entry, so no derived
tensor outlives its source) and unchanged: same ``_version`` (bumped by every in-place write), same
``data_ptr()``, shape, dtype and device. ``DerivedCache`` is the guard's store (several values per metadata
tensor, and which tensor a value came from); ``IdentityCache`` serves every other such cache (the kernels'
per-forward plans, the integrations' masks). Plain dicts keep insertion order, which is all these LRUs need.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Hashable, Optional

CAPACITY = 64
MISS = object()


def _stamp(source: Any) -> Optional[tuple]:
    """(version, data pointer) of a tensor; None for anything else (compared by identity only)."""
    version = getattr(source, "_version", None)
    return None if version is None else (version, source.data_ptr())


class _Held:
    """A strong stand-in for a weakref, for a source that takes none (a tuple of host offsets)."""

    __slots__ = ("source",)

    def __init__(self, source: Any) -> None:
        self.source = source

    def __call__(self) -> Any:
        return self.source


class IdentityCache:
    """A bounded LRU of values made from one or more objects (mostly tensors) and a hashable ``tag``.

    A hit needs every source to be the very object the value was made from (alive: held by weakref, and an
    entry is dropped when one of its sources dies, so a freed tensor's reused id or address never hits) and,
    for a tensor, unchanged since: same ``_version`` and ``data_ptr()``. A source that takes no weakref is
    held by its entry (``hold=True``) or not cached at all (``hold=False``). ``capacity`` entries at most;
    the least recently used goes first."""

    __slots__ = ("capacity", "hold", "_entries", "_last")

    def __init__(self, capacity: int = 8, *, hold: bool = True) -> None:
        self.capacity = capacity
        self.hold = hold
        self._entries: dict[tuple, tuple[tuple, tuple, Any]] = {}
        self._last: Any = None  # the key most recently moved to the end (a hot entry is not moved again)

    def get(self, sources: tuple, tag: Hashable = None) -> Any:
        """The value stored for ``sources`` and ``tag``, or ``MISS``."""
        # Called per layer: one source (the common case) is checked without building generic tuples.
        if len(sources) == 1:
            source = sources[0]
            key: tuple = (tag, id(source))
            entry = self._entries.get(key)
            if entry is None:
                return MISS
            stamp = entry[1][0]
            fresh = entry[0][0]() is source and (stamp is None or stamp == (source._version, source.data_ptr()))
        else:
            key = (tag, *map(id, sources))
            entry = self._entries.get(key)
            if entry is None:
                return MISS
            fresh = True
            for ref, stamp, source in zip(entry[0], entry[1], sources):
                if ref() is not source or (stamp is not None and stamp != (source._version, source.data_ptr())):
                    fresh = False
                    break
        if not fresh:  # another object under a reused id (not yet dropped), or written in place since
            del self._entries[key]
            return MISS
        if key != self._last:
            self._entries[key] = self._entries.pop(key)  # most recently used goes last
            self._last = key
        return entry[2]

    def put(self, sources: tuple, tag: Hashable, value: Any) -> None:
        key = (tag, id(sources[0])) if len(sources) == 1 else (tag, *map(id, sources))
        drop = self._dropper(key)
        refs: list[Callable[[], Any]] = []
        for source in sources:
            try:
                refs.append(weakref.ref(source, drop))
            except TypeError:
                if not self.hold:
                    return
                refs.append(_Held(source))
        entries = self._entries
        entries.pop(key, None)
        entries[key] = (tuple(refs), tuple(map(_stamp, sources)), value)
        self._last = key
        while len(entries) > self.capacity:
            entries.pop(next(iter(entries)), None)

    def _dropper(self, key: tuple) -> Callable[[Any], None]:
        entries = self._entries

        def drop(ref: Any) -> None:
            entry = entries.get(key)
            if entry is not None and any(r is ref for r in entry[0]):
                del entries[key]

        return drop

    def clear(self) -> None:
        self._last = None
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class _Slot:
    __slots__ = ("ref", "version", "data_ptr", "shape", "dtype", "device", "values")

    def __init__(self, ref, tensor) -> None:
        self.ref = ref
        self.version = tensor._version
        self.data_ptr = tensor.data_ptr()
        self.shape = tensor.shape
        self.dtype = tensor.dtype
        self.device = tensor.device
        self.values: dict = {}


class DerivedCache:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._tensors: dict[int, _Slot] = {}
        self._host: dict[Hashable, Any] = {}
        self._last: Any = None  # the slot most recently moved to the end (a hot slot is not moved again)
        # Derived object -> (weakref to its source tensor, version, data_ptr) at derivation: which tensor a
        # plan was made from, outliving the LRU entry (it dies with the plan).
        self._origins: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    # -- tensors ------------------------------------------------------------------------------------
    def get(self, tensor, tag: Hashable) -> Any:
        slot = self._tensors.get(id(tensor))
        if slot is None or slot.ref() is not tensor:
            return MISS
        # Same object (the weakref), so shape, dtype and device can only have changed together with
        # the version (resize_, set_) or the data pointer (``.data =``); comparing those two suffices.
        if tensor._version != slot.version or tensor.data_ptr() != slot.data_ptr:
            # Written in place (or re-pointed): every value derived from it is stale.
            slot.values.clear()
            return MISS
        value = slot.values.get(tag, MISS)
        if value is not MISS and slot is not self._last:
            self._tensors[id(tensor)] = self._tensors.pop(id(tensor))  # most recently used goes last
            self._last = slot
        return value

    def put(self, tensor, tag: Hashable, value: Any) -> None:
        key = id(tensor)
        slot = self._tensors.pop(key, None)  # re-inserted below: most recently used goes last
        if slot is None or slot.ref() is not tensor:
            slot = _Slot(weakref.ref(tensor, self._dropper(key)), tensor)
        elif tensor._version != slot.version or tensor.data_ptr() != slot.data_ptr:
            slot = _Slot(slot.ref, tensor)
        slot.values[tag] = value
        try:
            self._origins[value] = (slot.ref, slot.version, slot.data_ptr)
        except TypeError:  # not weakly referenceable (tuples, ints): no origin kept
            pass
        self._tensors[key] = slot
        self._last = slot
        while len(self._tensors) > self.capacity:
            self._tensors.pop(next(iter(self._tensors)), None)

    def made_from(self, value: Any, tensor) -> bool:
        """Was ``value`` derived from ``tensor`` as it is now (same object, version and data pointer)?"""
        try:
            origin = self._origins.get(value)
        except TypeError:
            return False
        return (origin is not None and origin[0]() is tensor and tensor._version == origin[1]
                and tensor.data_ptr() == origin[2])

    def _dropper(self, key: int):
        tensors = self._tensors

        def drop(ref) -> None:
            slot = tensors.get(key)
            if slot is not None and slot.ref is ref:
                tensors.pop(key, None)

        return drop

    # -- host sequences -----------------------------------------------------------------------------
    def get_host(self, key: Hashable) -> Any:
        return self._host.get(key, MISS)

    def put_host(self, key: Hashable, value: Any) -> None:
        self._host.pop(key, None)
        self._host[key] = value
        while len(self._host) > self.capacity:
            self._host.pop(next(iter(self._host)), None)

    def clear(self) -> None:
        self._last = None
        self._tensors.clear()
        self._origins.clear()
        self._host.clear()

    def __len__(self) -> int:
        return len(self._tensors) + len(self._host)


cache = DerivedCache()


def clear_cache() -> None:
    """Forget every derived value (the next call reads its metadata again)."""
    cache.clear()
