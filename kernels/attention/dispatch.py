"""``backend="auto"``: pick the fastest runnable varlen attention backend from measured times.

The table ``attention_dispatch.json`` (shipped beside this module, or the file named by
``GUARDLINT_ATTENTION_DISPATCH``) is written by ``bench/attention.py --write-dispatch``: one entry per
benchmarked case with every backend's median time. It is read once, on the first CUDA call, and each
call shape's choice is remembered: ``reset()`` makes the next call read the table (and choose) again.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable, Optional

TABLE_PATH = Path(__file__).with_name("attention_dispatch.json")
TABLE_ENV = "GUARDLINT_ATTENTION_DISPATCH"
TABLE_VERSION = 1

RULE = """\
How ``auto`` chooses (first match wins):
1. CPU tensors: ``sdpa``.
2. No table, or no entry measured on this GPU model (same name, else same compute-capability major):
   ``triton``.
3. Otherwise the nearest entry of that GPU, by, in order: head-dim distance |log2(D / D_entry)|, causal
   flag mismatch, dtype mismatch (float16 and bfloat16 count as near), then sequence-length profile
   distance |log2(max_seqlen / max_entry)| + |log2(mean / mean_entry)| + 0.5 |log2(batch / batch_entry)|.
4. Of that entry's measured backends, the fastest one that can run this call (head dim, dtype, device,
   installed libraries); when none can, ``triton``. In an eager call (not under CUDA-graph capture) a
   backend's time is the larger of its table time and its host time per eager call on that GPU (the
   table's host_us, measured by bench/attention_eager.py): a short batch is bound by the host, so a kernel
   whose launch costs more host time than its device time saves is not taken there.
Inputs that need a graph (training) follow the same rules over the entries' forward + backward times
(``train_times_us``, bench/attention_backward.py --write-dispatch) and the backends with a backward; with
no such entry, ``triton`` (the Triton backward, which takes any max_seqlen hint).
"""

_table: Optional[list] = None
_table_source: Optional[str] = None
# GPU name -> backend -> host time per eager call (us), from the table's "host_us".
_host: dict = {}
_memo: dict = {}
_MEMO_LIMIT = 4096
# Caches elsewhere that hold choices made from the table (the attention module's per-call plans):
# emptied whenever the table is (re)loaded or reset.
dependent_caches: list = []


def _forget_choices() -> None:
    _memo.clear()
    for cache in dependent_caches:
        cache.clear()


def table_path() -> Path:
    env = os.environ.get(TABLE_ENV)
    return Path(env) if env else TABLE_PATH


def load_table(path: Optional[Path] = None) -> list:
    """The table's entries (``[]`` when the file is missing or unreadable). Cached after the first read."""
    global _table, _table_source, _host
    path = Path(path) if path is not None else table_path()
    if _table is not None and _table_source == str(path):
        return _table
    entries: list = []
    host: dict = {}
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data.get("version") == TABLE_VERSION:
            entries = [e for e in data.get("entries", []) if _valid_entry(e)]
            host = _valid_host(data.get("host_us"))
    except (OSError, ValueError):
        entries = []
    _table, _table_source, _host = entries, str(path), host
    _forget_choices()
    return entries


def _valid_host(raw) -> dict:
    """``{gpu name: {backend: us}}`` with only finite positive times (anything else dropped)."""
    if not isinstance(raw, dict):
        return {}
    return {str(gpu): {str(name): float(t) for name, t in times.items()
                       if isinstance(t, (int, float)) and math.isfinite(t) and t > 0}
            for gpu, times in raw.items() if isinstance(times, dict)}


def host_times(device_name: str) -> dict:
    """Host time per eager call of each backend on this GPU model, from the loaded table ({} when none)."""
    load_table()
    return _host.get(device_name, {})


def reset() -> None:
    """Forget the loaded table and every memoised choice (tests, or after rewriting the table)."""
    global _table, _table_source, _host
    _table = None
    _table_source = None
    _host = {}
    _forget_choices()


def _valid_entry(e) -> bool:
    try:
        return (isinstance(e["times_us"], dict) and int(e["head_dim"]) > 0 and int(e["batch"]) > 0
                and int(e["max_seqlen"]) > 0 and int(e["total_tokens"]) > 0 and isinstance(e["device"], str))
    except (KeyError, TypeError, ValueError):
        return False


def _log2_ratio(a: float, b: float) -> float:
    return abs(math.log2(max(a, 1.0) / max(b, 1.0)))


def _dtype_distance(a: str, b: str) -> float:
    if a == b:
        return 0.0
    half = {"float16", "bfloat16"}
    return 0.5 if a in half and b in half else 1.0


def nearest_entry(entries: list, *, device_name: str, capability: tuple, head_dim: int, dtype: str,
                  causal: bool, batch: int, max_seqlen: int, total_tokens: int,
                  times: str = "times_us") -> Optional[dict]:
    """The table entry that rule 3 picks, or None (rule 2), among the entries that hold ``times`` (forward
    times, or ``train_times_us``: forward + backward)."""
    entries = [e for e in entries if isinstance(e.get(times), dict) and e[times]]
    same = [e for e in entries if e["device"] == device_name]
    if not same:
        same = [e for e in entries if tuple(e.get("capability", ()))[:1] == tuple(capability)[:1]]
    if not same:
        return None
    mean = total_tokens / max(batch, 1)

    def distance(e):
        e_mean = int(e["total_tokens"]) / int(e["batch"])
        profile = (_log2_ratio(max_seqlen, int(e["max_seqlen"])) + _log2_ratio(mean, e_mean)
                   + 0.5 * _log2_ratio(batch, int(e["batch"])))
        return (_log2_ratio(head_dim, int(e["head_dim"])), bool(e.get("causal", False)) != causal,
                _dtype_distance(dtype, str(e.get("dtype", "bfloat16"))), profile)

    return min(same, key=distance)


def choose(*, device_type: str, device_name: str = "", capability: tuple = (), head_dim: int, dtype: str,
           causal: bool, batch: int, max_seqlen: int, total_tokens: int,
           runnable: Callable[[str], bool], entries: Optional[list] = None, memo_extra: tuple = (),
           eager: bool = False, host: Optional[dict] = None, train: bool = False) -> str:
    """The backend ``auto`` runs for this call (see ``RULE``). ``runnable(name)`` says whether a backend
    can run this very call; the answer is memoised per call shape (plus ``memo_extra``: whatever else
    ``runnable`` depends on). ``eager``: the call is not being captured into a CUDA graph, so each
    backend's host time per call (``host``, default the table's for this GPU) bounds its time. ``train``: inputs
    that need a graph: the entries' forward + backward times (``train_times_us``, written by
    bench/attention_backward.py --write-dispatch), among backends with a backward (``runnable`` says which)."""
    if device_type != "cuda":
        return "sdpa"
    key = (device_name, head_dim, dtype, causal, batch, max_seqlen, total_tokens, memo_extra, eager, train)
    if entries is None:
        hit = _memo.get(key)
        if hit is not None:
            return hit
        table = load_table()
    else:
        table = entries
    entry = nearest_entry(table, device_name=device_name, capability=capability, head_dim=head_dim,
                          dtype=dtype, causal=causal, batch=batch, max_seqlen=max_seqlen,
                          total_tokens=total_tokens, times="train_times_us" if train else "times_us")
    choice = "triton"
    if entry is not None:
        if host is None:
            host = _host.get(device_name, {}) if entries is None else {}
        floor = host if eager else {}
        times = entry["train_times_us" if train else "times_us"]
        ranked = sorted((max(t, floor.get(name, 0.0)), name) for name, t in times.items()
                        if isinstance(t, (int, float)) and math.isfinite(t) and t > 0)
        for _, name in ranked:
            if runnable(name):
                choice = name
                break
    if entries is None:
        if len(_memo) >= _MEMO_LIMIT:
            _memo.clear()
        _memo[key] = choice
    return choice
