"""The tensor-keyed LRUs of guard/_cache.py: what makes a hit, what evicts, and that a dead tensor never hits.

``IdentityCache`` backs the kernels' per-forward plans (sequence order, element offsets, FlashInfer wrappers),
the integrations' mask plans and the guard's LoRA batch-info copies; ``DerivedCache`` is the guard's own store.
"""
from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

from guardlint.guard._cache import MISS, DerivedCache, IdentityCache  # noqa: E402


def offsets(*values):
    return torch.tensor(values, dtype=torch.int32)


def test_identity_cache_hits_the_same_tensor_and_tag():
    cache = IdentityCache(4)
    cu = offsets(0, 3, 8)
    cache.put((cu,), "order", "value")
    assert cache.get((cu,), "order") == "value"
    assert cache.get((cu,), "other tag") is MISS
    assert cache.get((offsets(0, 3, 8),), "order") is MISS  # equal values, another object: no hit


def test_identity_cache_evicts_the_least_recently_used_at_its_bound():
    cache = IdentityCache(3)
    tensors = [offsets(0, i) for i in range(4)]
    for i, t in enumerate(tensors[:3]):
        cache.put((t,), None, i)
    assert cache.get((tensors[0],)) == 0  # used: now the most recent
    cache.put((tensors[3],), None, 3)
    assert len(cache) == 3
    assert cache.get((tensors[1],)) is MISS  # the least recently used went first
    assert [cache.get((t,)) for t in (tensors[0], tensors[2], tensors[3])] == [0, 2, 3]


def test_identity_cache_misses_after_an_in_place_write():
    cache = IdentityCache()
    cu = offsets(0, 3, 8)
    cache.put((cu,), None, "lengths 3, 5")
    cu[1] = 4  # _version bumped
    assert cache.get((cu,)) is MISS
    assert len(cache) == 0  # the stale entry is gone
    cache.put((cu,), None, "lengths 4, 4")
    assert cache.get((cu,)) == "lengths 4, 4"


def test_identity_cache_misses_when_the_tensor_is_re_pointed():
    cache = IdentityCache()
    cu = offsets(0, 3, 8)
    cache.put((cu,), None, "old")
    cu.data = offsets(0, 1, 8)  # same object, new storage (no version bump)
    assert cache.get((cu,)) is MISS


def test_identity_cache_checks_every_source():
    cache = IdentityCache()
    cu, lengths = offsets(0, 3, 8), offsets(3, 5)
    cache.put((cu, lengths), "tokens", "offsets")
    assert cache.get((cu, lengths), "tokens") == "offsets"
    assert cache.get((lengths, cu), "tokens") is MISS
    lengths[0] = 2  # the second source written in place
    assert cache.get((cu, lengths), "tokens") is MISS


def test_identity_cache_entry_dies_with_its_tensor_and_a_reused_address_never_hits():
    cache = IdentityCache()
    cu = offsets(0, 3, 8)
    cache.put((cu,), None, "derived from the freed tensor")
    del cu
    # New tensors of the same size, kept alive so that each takes another free slot: CPython soon hands one
    # the freed object's id, and the allocator the freed storage; none may find the old value.
    made = [offsets(0, 3, 8) for _ in range(200)]
    assert len(cache) == 0  # dropped by the weakref's callback: nothing derived outlives its source
    assert all(cache.get((t,)) is MISS for t in made)


def test_identity_cache_compares_identity_when_ids_collide(monkeypatch):
    """The weakref is what decides, not the id: two live tensors given one id (as a freed tensor's id is
    given to the next) never share an entry."""
    import guardlint.guard._cache as cache_module

    monkeypatch.setattr(cache_module, "id", lambda obj: 1234, raising=False)
    cache = IdentityCache()
    first, second = offsets(0, 3, 8), offsets(0, 3, 8)
    cache.put((first,), None, "first")
    assert cache.get((second,)) is MISS
    assert cache.get((first,)) is MISS  # the stale entry was dropped by the mismatch
    cache.put((second,), None, "second")
    del first
    gc.collect()  # the first tensor's weakref callback must not drop the second's entry under the same key
    assert cache.get((second,)) == "second"


def test_identity_cache_holds_host_offsets_that_take_no_weakref():
    cache = IdentityCache()
    host = (0, 3, 8)  # a tuple: no weakref, held by the entry, so its id cannot be reused while cached
    cache.put((host,), "plan", "wrapper")
    assert cache.get((host,), "plan") == "wrapper"
    assert cache.get((tuple([0, 3, 8]),), "plan") is MISS  # an equal tuple, another object


def test_identity_cache_without_hold_skips_objects_that_take_no_weakref():
    class Slotted:
        __slots__ = ("seg_indptr",)

    cache = IdentityCache(hold=False)
    info = Slotted()
    cache.put((info,), None, "copy")
    assert len(cache) == 0 and cache.get((info,)) is MISS


def test_identity_cache_clear():
    cache = IdentityCache()
    cu = offsets(0, 3)
    cache.put((cu,), None, 1)
    cache.clear()
    assert len(cache) == 0 and cache.get((cu,)) is MISS


def test_derived_cache_entry_dies_with_its_tensor_and_misses_after_a_write():
    cache = DerivedCache(capacity=2)
    cu = offsets(0, 3, 8)
    cache.put(cu, "seq", "lengths")
    assert cache.get(cu, "seq") == "lengths"
    cu[2] = 9
    assert cache.get(cu, "seq") is MISS
    cache.put(cu, "seq", "new lengths")
    del cu
    gc.collect()
    assert len(cache) == 0
