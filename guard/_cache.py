"""Small LRUs of values derived from tensors, served only while their sources are unchanged (``unchanged``).

A host tensor (CPU, up to 1 MiB) is compared by contents, so every write shows. A device tensor (and a larger
host one) is compared by version counter and place (data pointer, sizes, strides, dtype; an alias held in the
entry keeps the storage, so no other memory can take that address): writes that bypass the version counter do
not show (``t.data[i] = x``, DLPack or CUDA-IPC views, other libraries' in-place kernels).
For callers who write that way: ``GUARDLINT_CACHE=off``, ``set_cache(False)`` or ``with caching(False):``.
"""
from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any, Callable, Hashable, Iterator, Optional

import torch

CAPACITY = 64
MISS = object()
# Host tensors up to this size are compared by contents (one memcmp); larger ones by version, like device ones.
HOST_BYTES_MAX = 1 << 20
ENV_VAR = "GUARDLINT_CACHE"
_OFF = ("off", "0", "false", "no")
_ON = ("on", "1", "true", "yes", "")

Tensor = torch.Tensor


def _parse(value: str) -> bool:
    key = value.strip().lower()
    if key in _ON:
        return True
    if key in _OFF:
        return False
    from .errors import GuardError  # errors imports the catalog; only a bad setting needs it
    raise GuardError("GL002", argument=ENV_VAR, function=None, expected="on or off", got=repr(value),
                     fix=f"set {ENV_VAR} to on (the default) or off")


# Read by every lookup. Off: an entry serves only the guarded call that made it (``epoch``), so a call's
# derivation and its checks still share one read, and the next call reads again.
enabled: bool = _parse(os.environ.get(ENV_VAR, ""))
epoch = 0


def set_cache(on: bool) -> bool:
    """Serve derived values from the cache (``True``, the default) or derive them again at every call
    (``False``: for callers who write their metadata where no version counter sees it). Returns the previous
    setting. Process-wide, like ``set_mode``."""
    global enabled
    if type(on) is not bool:
        from .errors import GuardError, describe
        raise GuardError("GL002", argument="on", function="set_cache", expected="True or False", got=describe(on),
                         fix="set_cache(False) to derive at every call, set_cache(True) to cache again")
    previous, enabled = enabled, on
    cache.clear()
    return previous


@contextlib.contextmanager
def caching(on: bool) -> Iterator[bool]:
    """``with caching(False): ...`` runs a block with the cache off (every call reads its metadata again)."""
    previous = set_cache(on)
    try:
        yield on
    finally:
        set_cache(previous)


def new_call() -> None:
    """Called by the guard as a call starts: with the cache off, what earlier calls derived is not served."""
    global epoch
    epoch += 1


# -- fingerprints -----------------------------------------------------------------------------------

_VERSION, _BYTES, _OPAQUE, _ITEMS, _ARRAY, _VALUES = 0, 1, 2, 3, 4, 5
# Up to this many elements a host tensor is compared by reading its values again (one tolist: cheaper than a
# layout check for a handful of ints, and it follows any re-pointing by itself); above, by a view's bytes.
HOST_VALUES_MAX = 16


def _host_view(alias: Tensor) -> Any:
    """A numpy view of a host tensor's elements (sharing its storage), or None where there is none (no numpy,
    an exotic tensor)."""
    try:
        return alias.numpy()
    except (RuntimeError, TypeError, ValueError):
        return None


def fingerprint(source: Any) -> Any:
    """What ``unchanged`` compares ``source`` against later; None: compared by identity only.

    A device tensor is compared by version counter and by where its elements are: data pointer, sizes,
    strides and dtype. An alias (``detach()``) keeps its storage alive, so that address cannot be taken by
    other memory while the entry lives. (``is_set_to`` would say the same through the dispatcher: on a CUDA
    tensor that call costs more than the rest of a prepared call's check.)"""
    if isinstance(source, Tensor):
        if source.layout is not torch.strided or source.is_meta:  # sparse and the like: no storage to compare
            return (_OPAQUE, source._version, (source.layout, source.shape, source.dtype))
        if source.is_cpu and source.numel() <= HOST_VALUES_MAX:
            # Equal values derive equal facts, whatever the dtype (which the kernels check themselves).
            return (_VALUES, source.tolist())
        alias = source.detach()
        if source.is_cpu and source.numel() * source.element_size() <= HOST_BYTES_MAX:
            view = _host_view(alias)
            if view is not None:
                return (_BYTES, alias, source.dtype, view, view.tobytes())
        return (_VERSION, source._version, alias, source.dtype, source.data_ptr(), source.shape, source.stride())
    if isinstance(source, list):
        return (_ITEMS, tuple(source))
    if hasattr(source, "__array_interface__") and hasattr(source, "tobytes"):
        return (_ARRAY, source.__array_interface__["data"][0], source.shape, source.dtype.str, source.tobytes())
    return None


def unchanged(source: Any, fp: Any) -> bool:
    """Is ``source`` as it was when ``fingerprint`` took ``fp``? (Contents for host tensors, version and storage
    for device ones.)"""
    if fp is None:
        return True
    kind = fp[0]
    if kind == _VALUES:
        return source.tolist() == fp[1]
    if kind == _VERSION:
        return source._version == fp[1] and source.data_ptr() == fp[4] and source.dtype is fp[3] \
            and source.shape == fp[5] and source.stride() == fp[6]
    if kind == _BYTES:
        return source.is_set_to(fp[1]) and source.dtype is fp[2] and fp[3].tobytes() == fp[4]
    if kind == _OPAQUE:
        return source._version == fp[1] and (source.layout, source.shape, source.dtype) == fp[2]
    if kind == _ITEMS:
        return tuple(source) == fp[1]
    return (source.__array_interface__["data"][0], source.shape, source.dtype.str) == fp[1:4] \
        and source.tobytes() == fp[4]


def by_contents(fp: Any) -> bool:
    """Does ``fp`` compare contents (a host tensor), so that a match proves the values unchanged?"""
    return fp is not None and fp[0] in (_BYTES, _VALUES, _ITEMS, _ARRAY)


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
    entry is dropped when one of its sources dies, so a freed tensor's reused id or address never hits) and
    unchanged since (``unchanged``: contents for a host tensor or a list, version and storage for a device
    tensor). A source that takes no weakref is held by its entry (``hold=True``) or not cached at all
    (``hold=False``). ``capacity`` entries at most; the least recently used goes first. With the cache off
    (``set_cache(False)``) nothing is stored."""

    __slots__ = ("capacity", "hold", "_entries", "_last")

    def __init__(self, capacity: int = 8, *, hold: bool = True) -> None:
        self.capacity = capacity
        self.hold = hold
        self._entries: dict[tuple, tuple[tuple, tuple, Any]] = {}
        self._last: Any = None  # the key most recently moved to the end (a hot entry is not moved again)

    def get(self, sources: tuple, tag: Hashable = None) -> Any:
        """The value stored for ``sources`` and ``tag``, or ``MISS``."""
        if not enabled:
            return MISS
        # Called per layer: one source (the common case) is checked without building generic tuples.
        if len(sources) == 1:
            source = sources[0]
            key: tuple = (tag, id(source))
            entry = self._entries.get(key)
            if entry is None:
                return MISS
            fresh = entry[0][0]() is source and unchanged(source, entry[1][0])
        else:
            key = (tag, *map(id, sources))
            entry = self._entries.get(key)
            if entry is None:
                return MISS
            fresh = True
            for ref, fp, source in zip(entry[0], entry[1], sources):
                if ref() is not source or not unchanged(source, fp):
                    fresh = False
                    break
        if not fresh:  # another object under a reused id (not yet dropped), or written since
            del self._entries[key]
            return MISS
        if key != self._last:
            self._entries[key] = self._entries.pop(key)  # most recently used goes last
            self._last = key
        return entry[2]

    def put(self, sources: tuple, tag: Hashable, value: Any) -> None:
        if not enabled:
            return
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
        entries[key] = (tuple(refs), tuple(map(fingerprint, sources)), value)
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
    __slots__ = ("ref", "fp", "epoch", "values")

    def __init__(self, ref, tensor) -> None:
        self.ref = ref
        self.fp = fingerprint(tensor)
        self.epoch = epoch
        self.values: dict = {}


class Origin:
    """Which tensor a derived object was made from and how it was then (``fingerprint``); ``source`` is None
    for one made from host offsets (a list or tuple), which are compared by value instead."""

    __slots__ = ("ref", "fp")

    def __init__(self, source: Optional[Tensor], fp: Any = None) -> None:
        self.ref = None if source is None else weakref.ref(source)
        self.fp = fp

    def made_from(self, tensor: Any) -> bool:
        ref = self.ref
        if ref is None or ref() is not tensor or not unchanged(tensor, self.fp):
            return False
        # With the cache off a device tensor's version proves nothing: the caller writes where it cannot see.
        return enabled or by_contents(self.fp)


class DerivedCache:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._tensors: dict[int, _Slot] = {}
        self._host: dict[Hashable, Any] = {}
        # Derived object -> Origin, for objects without an ``_origin`` attribute of their own (the engines'
        # metadata classes): which tensor a plan was made from, outliving the LRU entry (it dies with the plan).
        self._origins: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    # -- tensors ------------------------------------------------------------------------------------
    def get(self, tensor, tag: Hashable) -> Any:
        slot = self._tensors.get(id(tensor))
        if slot is None or slot.ref() is not tensor:
            return MISS
        if not unchanged(tensor, slot.fp) or (not enabled and slot.epoch != epoch):
            # Written (or re-pointed) since, or made by an earlier call with the cache off: all of it is stale.
            slot.values.clear()
            return MISS
        return slot.values.get(tag, MISS)

    def put(self, tensor, tag: Hashable, value: Any) -> None:
        key = id(tensor)
        slot = self._tensors.get(key)
        if slot is None or slot.ref() is not tensor:
            slot = _Slot(weakref.ref(tensor, self._dropper(key)), tensor)
        elif not unchanged(tensor, slot.fp) or slot.epoch != epoch and not enabled:
            slot = _Slot(slot.ref, tensor)
        slot.values[tag] = value
        if tag != "host" and not isinstance(value, (tuple, int)):
            self.seal(value, tensor, slot.fp)
        # The most recently derived from goes last and the oldest goes first; lookups do not reorder (a forward
        # derives from its few tensors once each, and a lookup stays a dict get and a comparison).
        tensors = self._tensors
        tensors.pop(key, None)
        tensors[key] = slot
        while len(tensors) > self.capacity:
            tensors.pop(next(iter(tensors)), None)

    def fingerprint(self, tensor) -> Any:
        """The tensor's fingerprint as its cache slot holds it (one view and copy per version), else a new one."""
        slot = self._tensors.get(id(tensor))
        if slot is not None and slot.ref() is tensor and unchanged(tensor, slot.fp):
            return slot.fp
        return fingerprint(tensor)

    def seal(self, value: Any, tensor: Optional[Tensor], fp: Any = None) -> None:
        """Remember that ``value`` was derived from ``tensor`` as ``fp`` describes it (see ``made_from``)."""
        origin = Origin(tensor, fp)
        try:
            object.__setattr__(value, "_origin", origin) if hasattr(type(value), "_origin") else \
                self._origins.__setitem__(value, origin)
        except (TypeError, AttributeError):  # takes neither an attribute nor a weakref: no origin kept
            pass

    def origin(self, value: Any) -> Optional[Origin]:
        found: Any = getattr(value, "_origin", MISS)
        if found is not MISS:
            return found
        try:
            return self._origins.get(value)
        except TypeError:
            return None

    def made_from(self, value: Any, tensor) -> bool:
        """Was ``value`` derived from ``tensor`` as it is now (same object; same contents for a host tensor,
        same version and storage for a device one)?"""
        origin = self.origin(value)
        return origin is not None and origin.made_from(tensor)

    def _dropper(self, key: int):
        tensors = self._tensors

        def drop(ref) -> None:
            slot = tensors.get(key)
            if slot is not None and slot.ref is ref:
                tensors.pop(key, None)

        return drop

    # -- host sequences -----------------------------------------------------------------------------
    def get_host(self, key: Hashable) -> Any:
        # Keyed on the values themselves: nothing to go stale, but the cache-off setting still applies.
        return self._host.get(key, MISS) if enabled else MISS

    def put_host(self, key: Hashable, value: Any) -> None:
        if not enabled:
            return
        self._host.pop(key, None)
        self._host[key] = value
        while len(self._host) > self.capacity:
            self._host.pop(next(iter(self._host)), None)

    def clear(self) -> None:
        self._tensors.clear()
        self._origins.clear()
        self._host.clear()

    def __len__(self) -> int:
        return len(self._tensors) + len(self._host)


cache = DerivedCache()


def clear_cache() -> None:
    """Forget every derived value (the next call reads its metadata again)."""
    cache.clear()
