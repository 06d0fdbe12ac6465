"""Pattern rules: contracts of kind ``pattern`` are found by a dedicated visitor, registered here.

Plain data (no libcst): the textual pre-filter reads the needles before anything is parsed, and the
visitors (``host_sync``) read the vocabulary, so both agree on what can trigger a rule.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Callable, Optional

from guardlint.contracts.catalog import HOST_SUFFIXES, SEQLEN_STEMS


@dataclass(frozen=True)
class PatternSpec:
    """``visitor`` is ``module:Class`` under ``guardlint.lint``. A file can only trigger the rule when
    it contains one of ``needles``, all of one group of ``also`` (or a match of ``also_pattern``) and
    a match of every pattern of one group of ``context`` (bytes, matched before parsing)."""

    code: str
    visitor: str
    needles: tuple[bytes, ...]
    also: tuple[tuple[bytes, ...], ...] = ()
    context: tuple[tuple[re.Pattern, ...], ...] = ()
    # Passes for ``also`` too when it matches near a line that holds one of ``needles``: from the line
    # before it (``if (`` and the lengths below it, as formatters write long tests) to ``also_after``
    # lines after it (a receiver written over lines before its ``.item()``): reads whose spelling is
    # too common to look for alone; only those lines are searched.
    also_pattern: Optional[re.Pattern] = None
    also_after: int = 0
    # Last, given the offsets where ``also`` and ``also_pattern`` matched: whether one of them can be in
    # a place the rule looks at (GL104: code run per layer, ``in_per_layer_code``).
    where: Optional[Callable[[bytes, list[int]], bool]] = None
    # ``needles`` as one pattern, searched instead of each needle in turn when given (needles with a
    # common start: the regex engine looks for that start once).
    needle_pattern: Optional[re.Pattern] = None

    def _also_on_a_line(self, data: bytes, every: bool = False) -> list[int]:
        """Offsets of ``also_pattern``'s matches near the needles (with ``every``: all, else the first)."""
        pattern = self.also_pattern
        seen = set()
        found: list[int] = []
        if pattern is None:
            return found
        for needle in self.needles:
            at = data.find(needle)
            while at != -1:
                line = max(data.rfind(b"\n", 0, at), data.rfind(b"\r", 0, at))
                start = max(data.rfind(b"\n", 0, max(line, 0)), data.rfind(b"\r", 0, max(line - 1, 0))) + 1
                if start not in seen:
                    seen.add(start)
                    end = data.find(b"\n", at)
                    for _ in range(self.also_after):
                        if end == -1:
                            break
                        end = data.find(b"\n", end + 1)
                    end = len(data) if end == -1 else end
                    if not every:
                        m = pattern.search(data, start, end)
                        if m:
                            return [m.start()]
                    else:
                        found.extend(m.start() for m in pattern.finditer(data, start, end))
                at = data.find(needle, at + 1)
        return found

    def may_match(self, data: bytes) -> bool:
        if self.needle_pattern is not None:
            if self.needle_pattern.search(data) is None:
                return False
        elif not any(n in data for n in self.needles):
            return False
        # Cheapest first: substring tests, then patterns that start with a literal (a pattern that
        # starts with \b is tried at every byte).
        if self.where is None:
            if self.also and not any(all(n in data for n in group) for group in self.also):
                if self.also_pattern is None or not self._also_on_a_line(data):
                    return False
            return not self.context or any(all(p.search(data) for p in group) for group in self.context)
        if self.context and not any(all(p.search(data) for p in group) for group in self.context):
            return False
        at = [i for group in self.also if all(n in data for n in group) for n in group for i in _offsets(data, n)]
        if self.also_pattern is not None:
            at.extend(self._also_on_a_line(data, every=True))
        return bool(at) and self.where(data, sorted(set(at)))


def _offsets(data: bytes, needle: bytes) -> list[int]:
    out = []
    at = data.find(needle)
    while at != -1:
        out.append(at)
        at = data.find(needle, at + 1)
    return out


# The first line of a for, def or class statement (or what looks like one: a line of a string or of a
# bracket that starts with such a word only adds a place), its indentation, keyword and the name it
# defines. Other compound statements are left out: a real enclosing statement is always less indented
# than what it holds, so skipping some only adds candidates (and costs less than finding them all).
# (Found after a line break, which the regex engine looks for faster than a ``^`` under re.M.)
_HEADER = re.compile(rb"\n([ \t]*)(?:async[ \t]+)?(for|def|class)\b[ \t]*(\w*)")
# A for loop whose header names layers or blocks (GL104's context below, matched at the loop's ``for``).
_FOR_LAYERS = re.compile(rb"for\b[^:]{0,400}?\bin\b[^:]{0,400}?(?:\b|_)(?i:layers?|blocks?)\b")


def _in_decorator(data: bytes, line: int, level: int, most: int = 30) -> bool:
    """Whether the line at ``line`` is in a decorator at indentation ``level``: the nearest line at or
    above it, within ``most`` lines, that is not indented deeper starts with ``@``."""
    for _ in range(most):
        end = data.find(b"\n", line)
        text = data[line:len(data) if end == -1 else end]
        body = text.lstrip(b" \t")
        if body.strip() and len(text) - len(body) <= level:
            return body.startswith(b"@")
        if line == 0:
            return False
        line = data.rfind(b"\n", 0, line - 1) + 1
    return False


def in_per_layer_code(data: bytes, offsets: list[int]) -> bool:
    """Whether one of ``offsets`` (host reads) can be in code run per layer, read from indentation
    alone: the statements above each offset that open a block at a smaller indentation are its
    enclosing ones (a loop over layers or blocks, or ``forward`` in a class ``*Block``/``*Layer``/
    ``*Attention``). A read in a module-level function makes its calls reads too (host_sync's helpers).
    It may pass a file whose reads are not per layer (the tree pre-filter then drops it), never one
    whose reads are."""
    if b"\r" in data and data.count(b"\r") != data.count(b"\r\n"):
        return True  # lines ended by \r alone: the line breaks looked for here are \n
    # Offsets in ``data``: the text searched has a line break in front (a header on the first line).
    headers = [(m.start(1) - 1, len(m.group(1)), m.group(2), m.group(3), m.start(2) - 1)
               for m in _HEADER.finditer(b"\n" + data)]
    starts = [h[0] for h in headers]
    # Each header's nearest header above it with a smaller indentation: everything in between is
    # indented at least as deep as the header, so a walk up can jump there.
    parents: list[int] = []
    stack: list[int] = []
    for k, header in enumerate(headers):
        while stack and headers[stack[-1]][1] >= header[1]:
            stack.pop()
        parents.append(stack[-1] if stack else -1)
        stack.append(k)
    helpers: set = set()

    def per_layer(at: int, helper: bool) -> bool:
        line = data.rfind(b"\n", 0, at) + 1
        indent = len(data[line:at]) - len(data[line:at].lstrip(b" \t"))
        # The statement's own line counts (``for b in blocks(seq_lens.item()):``, ``def forward(self,
        # n=int(seq_lens[0])):``), and a header at the read's indentation too (a continuation line
        # written at its statement's indentation); a decorator belongs to the ``def`` below it.
        i = bisect.bisect_right(starts, line) - 1
        limit = indent + 1
        j = bisect.bisect_right(starts, at)
        if j < len(headers) and headers[j][2] == b"def" and headers[j][1] <= indent \
                and _in_decorator(data, line, headers[j][1]):
            i, limit = j, headers[j][1] + 1
        forward = False
        outer = None
        while i >= 0 and limit > 0:
            start, level, word, name, keyword = headers[i]
            i = parents[i]
            if level >= limit:
                continue
            limit = level
            if word == b"for":
                if _FOR_LAYERS.match(data, keyword):
                    return True
            elif word == b"def":
                # Any forward below counts (not only one right in the class): with statements left
                # out, the def found next may not be the one around.
                forward = forward or name == b"forward"
                outer = name if level == 0 else None
            elif word == b"class" and forward and name.decode().lower().endswith(PER_LAYER_CLASS_SUFFIXES):
                return True
        if helper and outer:
            helpers.add(outer.decode())
        return False

    if any(per_layer(at, True) for at in offsets):
        return True
    if not helpers:
        return False
    calls = re.compile(rb"(?<![\w.])(?:" + b"|".join(re.escape(h.encode()) for h in sorted(helpers)) + rb")\s*\(")
    return any(per_layer(m.start(), False) for m in calls.finditer(data))


# GL104 per-layer-host-sync. Names of host-read metadata: cu_seqlens, cu_seqlens_q, seq_lens,
# extend_seq_lens, seqlens, seg_lens, seg_indptr ... Names ending in _cpu/_host/_list already live on
# the host (sglang's seq_lens_cpu), so reading them back is no sync.
SEQLEN_NAME = re.compile(rf"^(?:\w*_)?(?:{'|'.join(SEQLEN_STEMS)})(?:_\w+)?$")
# Calls that copy a device value to the host: t.item(), t.tolist(); int(t.max()) is matched apart.
SYNC_METHODS = ("item", "tolist")
# int(t), bool(t), float(t) of a device tensor read it back as well.
CASTS = ("int", "bool", "float")
# A forward of a class named like this runs once per layer.
PER_LAYER_CLASS_SUFFIXES = ("block", "layer", "attention")
# A loop over something named like this runs once per layer: self.blocks, layers, self.layers,
# enumerate(self.blocks), range(num_layers), self.vision_blocks ...
LAYER_LOOP_NAME = re.compile(r"(?:^|_)(?:layers?|blocks?)$", re.IGNORECASE)

_STEM = rb"(?:" + b"|".join(stem.encode() for stem in SEQLEN_STEMS if stem != "cu_seqlens") + rb")"

PATTERNS: dict[str, PatternSpec] = {
    "GL104": PatternSpec(
        code="GL104",
        visitor="host_sync:PerLayerHostSync",
        # cu_seqlens contains seqlens: the shorter stems cover every name
        needles=tuple(stem.encode() for stem in SEQLEN_STEMS if stem != "cu_seqlens"),
        # seqlens, seq_lens, seg_lens, seg_indptr: one search for "se" and what follows (on vLLM 0.33's
        # 50 MB, 0.026 s against 0.063 s for four substring searches)
        needle_pattern=re.compile(b"|".join(re.escape(stem.encode()) for stem in SEQLEN_STEMS
                                            if stem != "cu_seqlens")),
        # The truth of a tensor as a whole test: ``if (a > b).any():`` (the visitor reports no other use).
        also=((b".any():",), (b".all():",), (b".any()):",), (b".all()):",)),
        # A per-layer place: a forward in a class *Block/*Layer/*Attention (any case), or a for loop
        # whose header names layers or blocks (up to its colon: headers over several lines count).
        context=(
            (re.compile(rb"def\s+forward\b"), re.compile(rb"class\s+\w*(?i:block|layer|attention)\b")),
            (_FOR_LAYERS,),
        ),
        # Then only reads that can be in such a place: ``in_per_layer_code`` reads the nesting from the
        # indentation (52 of vLLM 0.33's files passed on GL104's words alone, and CPython parsed them
        # for no finding; 1 does now).
        # .item()/.tolist() without arguments (of a receiver naming lengths, on the line of the read or up
        # to three lines before it), int(t)/bool(t)/float(t) of lengths, with the lengths on the line of
        # the cast (or the next one: ``int(`` and its argument below it), and ``if``/``while`` tests of
        # lengths (``if seq_lens:``, ``if not cu_seqlens[0]``, ``while x and seg_lens[i] < n``): ``.item(``,
        # ``int`` and ``if`` alone are in most files, and ``if seq_lens is None`` is no read.
        also_pattern=re.compile(
            rb"\.(?:item|tolist)\(\s*\)"
            + rb"|(?:int|bool|float)\(\s*[^\n]*?" + _STEM
            + rb"|(?:if|elif|while|and|or)\s+(?:not\s+)?\(?\s*[\w.]*" + _STEM
            + rb"\w*(?:\[[^\]\n]*\])?\s*(?::|and\b|or\b|[<>]=?|==|!=|\))"),
        also_after=3,
        where=in_per_layer_code,
    ),
}


def is_seqlen_name(name: str) -> bool:
    return bool(SEQLEN_NAME.match(name)) and not name.endswith(HOST_SUFFIXES)
