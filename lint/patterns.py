"""Pattern rules: contracts of kind ``pattern`` are found by a dedicated visitor, registered here.

Plain data (no libcst): the textual pre-filter reads the needles before anything is parsed, and the
visitors (``host_sync``) read the vocabulary, so both agree on what can trigger a rule.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

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
    # Passes for ``also`` too when it matches a line that holds one of ``needles``, with the line
    # before it (``if (`` and the lengths below it, as formatters write long tests): reads whose
    # spelling is too common to look for alone; only those lines are searched.
    also_pattern: Optional[re.Pattern] = None

    def _also_on_a_line(self, data: bytes) -> bool:
        seen = set()
        for needle in self.needles:
            at = data.find(needle)
            while at != -1:
                line = max(data.rfind(b"\n", 0, at), data.rfind(b"\r", 0, at))
                start = max(data.rfind(b"\n", 0, max(line, 0)), data.rfind(b"\r", 0, max(line - 1, 0))) + 1
                if start not in seen:
                    seen.add(start)
                    end = data.find(b"\n", at)
                    if self.also_pattern.search(data, start, len(data) if end == -1 else end):
                        return True
                at = data.find(needle, at + 1)
        return False

    def may_match(self, data: bytes) -> bool:
        if not any(n in data for n in self.needles):
            return False
        # Cheapest first: substring tests, then patterns that start with a literal (a pattern that
        # starts with \b is tried at every byte).
        if self.also and not any(all(n in data for n in group) for group in self.also):
            if self.also_pattern is None or not self._also_on_a_line(data):
                return False
        return not self.context or any(all(p.search(data) for p in group) for group in self.context)


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
        also=((b".item(",), (b".tolist(",), (b"int(", b".max("), (b".any()",), (b".all()",)),
        # A per-layer place: a forward in a class *Block/*Layer/*Attention (any case), or a for loop
        # whose header names layers or blocks (up to its colon: headers over several lines count).
        context=(
            (re.compile(rb"def\s+forward\b"), re.compile(rb"class\s+\w*(?i:block|layer|attention)\b")),
            (re.compile(rb"for\b[^:]{0,400}?\bin\b[^:]{0,400}?(?:\b|_)(?i:layers?|blocks?)\b"),),
        ),
        # int(t)/bool(t)/float(t) of lengths, with the lengths on the line of the cast, and ``if``/``while``
        # tests of lengths (``if seq_lens:``, ``if not cu_seqlens[0]``, ``while x and seg_lens[i] < n``):
        # ``int`` and ``if`` alone are in every file, and ``if seq_lens is None`` is no read.
        also_pattern=re.compile(
            rb"(?:int|bool|float)\([^\n]*?" + _STEM
            + rb"|(?:if|elif|while|and|or)\s+(?:not\s+)?\(?\s*[\w.]*" + _STEM
            + rb"\w*(?:\[[^\]\n]*\])?\s*(?::|and\b|or\b|[<>]=?|==|!=|\))"),
    ),
}


def is_seqlen_name(name: str) -> bool:
    return bool(SEQLEN_NAME.match(name)) and not name.endswith(HOST_SUFFIXES)
