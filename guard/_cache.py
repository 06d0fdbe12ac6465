"""A small LRU of values derived from metadata tensors, keyed on the tensor's identity and version.

An entry is valid while its tensor is alive (a weakref, whose callback drops the entry, so no derived
tensor outlives its source) and unchanged: same ``_version`` (bumped by every in-place write), same
``data_ptr()``, shape, dtype and device. Host sequences (lists, tuples, numpy arrays) are keyed on their
contents. Plain dicts keep insertion order, which is all an LRU of 64 entries needs.
"""
from __future__ import annotations

import weakref
from typing import Any, Hashable

CAPACITY = 64
MISS = object()


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
