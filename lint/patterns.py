"""Pattern rules: contracts of kind ``pattern`` are found by a dedicated visitor, registered here.

Plain data (no libcst): the textual pre-filter reads the needles before anything is parsed, and the
visitors (``host_sync``) read the vocabulary, so both agree on what can trigger a rule.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Callable, Optional

from guardlint.contracts.catalog import HOST_SUFFIXES, SEQLEN_STEMS, VARLEN_KERNELS

from .registries import _TEXT as REGISTRATION
from .registries import may_register


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
    where: Optional[Callable[..., bool]] = None
    # Reads of any receiver (GL104: a value derived from metadata under another name, which the value
    # model follows within one function): given to ``where`` as ``derived``, which looks for them only
    # in the functions whose text holds a needle.
    derived: Optional[re.Pattern] = None
    # ``needles`` as one pattern, searched instead of each needle in turn when given (needles with a
    # common start: the regex engine looks for that start once), but for ``more_needles``, tested apart.
    needle_pattern: Optional[re.Pattern] = None
    more_needles: tuple[bytes, ...] = ()

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
            if self.needle_pattern.search(data) is None and not any(n in data for n in self.more_needles):
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
        if self.derived is None:
            return bool(at) and self.where(data, sorted(set(at)))
        return self.where(data, sorted(set(at)), derived=self.derived)


def _offsets(data: bytes, needle: bytes) -> list[int]:
    out = []
    at = data.find(needle)
    while at != -1:
        out.append(at)
        at = data.find(needle, at + 1)
    return out


# GL104's needles as one pattern: cu_seqlens contains seqlens, so the shorter stems cover every name.
_NEEDLES = re.compile(b"|".join(re.escape(stem.encode()) for stem in SEQLEN_STEMS if stem != "cu_seqlens"))
# And the names of the known varlen kernels (``kernel_facts``), whose calls make metadata of values named anyhow:
# searched apart (in the pattern above they would cost its common start, "se", which the regex engine looks for
# at once: 0.6 s more over vLLM 0.33).
KERNEL_NAMES = tuple(sorted({q.rsplit(".", 1)[1].encode() for q in VARLEN_KERNELS}))

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


# The headers of the last text read (GL104's pre-filter and the callee summaries' read the same bytes in turn).
_LAST_HEADERS: list = [None, None]


def _headers(data: bytes) -> tuple:
    """The for/def/class headers of ``data`` (offset, indentation, keyword, name, keyword's offset), their
    offsets, and each one's nearest header above it with a smaller indentation."""
    if _LAST_HEADERS[0] is data:
        return _LAST_HEADERS[1]
    # Offsets in ``data``: the text searched has a line break in front (a header on the first line).
    headers = [(m.start(1) - 1, len(m.group(1)), m.group(2), m.group(3), m.start(2) - 1)
               for m in _HEADER.finditer(b"\n" + data)]
    # Each header's parent: everything in between is indented at least as deep as the header, so a walk
    # up can jump there.
    parents: list[int] = []
    stack: list[int] = []
    for k, header in enumerate(headers):
        while stack and headers[stack[-1]][1] >= header[1]:
            stack.pop()
        parents.append(stack[-1] if stack else -1)
        stack.append(k)
    _LAST_HEADERS[:] = [data, (headers, [h[0] for h in headers], parents)]
    return _LAST_HEADERS[1]


def is_layer_class(name: str, bases=()) -> bool:
    """A class whose ``forward`` runs once per layer: named ``*Block``/``*Layer``/``*Attention`` (any case), or
    derived from a class named so (``bases`` as written, dotted or not)."""
    return any(n.rsplit(".", 1)[-1].lower().endswith(PER_LAYER_CLASS_SUFFIXES) for n in (name, *bases) if n)


def _forward_name(name: bytes) -> bool:
    """``forward``, or a method a dispatching forward may run (``forward_oot``): the visitor decides which."""
    return name == b"forward" or name.startswith(b"forward_")


# A class header's bases, up to its closing parenthesis (matched at the ``class`` keyword).
_CLASS_BASES = re.compile(rb"class[ \t]+\w+[ \t]*\(([^):]{0,400})")
_WORD = re.compile(rb"[\w.]+")


def _layer_header(data: bytes, header: tuple) -> bool:
    """``is_layer_class`` of the class whose header is ``header`` (as ``_headers`` gives it)."""
    if header[3].decode().lower().endswith(PER_LAYER_CLASS_SUFFIXES):
        return True
    m = _CLASS_BASES.match(data, header[4])
    return m is not None and is_layer_class("", [w.decode() for w in _WORD.findall(m.group(1))])


def in_per_layer_code(data: bytes, offsets: list[int], derived: Optional[re.Pattern] = None) -> bool:
    """Whether one of ``offsets`` (host reads) can be in code run per layer, read from indentation
    alone: the statements above each offset that open a block at a smaller indentation are its
    enclosing ones (a loop over layers or blocks, or ``forward`` in a class ``*Block``/``*Layer``/
    ``*Attention``). A read in a module-level function makes its calls reads too (host_sync's helpers).
    ``derived`` matches reads of any receiver: they are looked for only in the functions whose text
    names metadata (``_NEEDLES``; the value model follows values within one function, from such names).
    It may pass a file whose reads are not per layer (the tree pre-filter then drops it), never one
    whose reads are."""
    if b"\r" in data and data.count(b"\r") != data.count(b"\r\n"):
        return True  # lines ended by \r alone: the line breaks looked for here are \n
    if may_register(data):
        return True  # a def registered in an attention registry runs per layer, whatever its name (the tree
        # pre-filter reads which)
    headers, starts, parents = _headers(data)
    helpers: set = set()

    def enclosing(at: int, decorators: bool = True):
        """The headers around offset ``at``, innermost first; with ``decorators``, those of the def a
        decorator there belongs to."""
        line = data.rfind(b"\n", 0, at) + 1
        indent = len(data[line:at]) - len(data[line:at].lstrip(b" \t"))
        # The statement's own line counts (``for b in blocks(seq_lens.item()):``, ``def forward(self,
        # n=int(seq_lens[0])):``), and a header at the read's indentation too (a continuation line
        # written at its statement's indentation); a decorator belongs to the ``def`` below it.
        i = bisect.bisect_right(starts, line) - 1
        limit = indent + 1
        j = bisect.bisect_right(starts, at)
        if decorators and j < len(headers) and headers[j][2] == b"def" and headers[j][1] <= indent \
                and _in_decorator(data, line, headers[j][1]):
            i, limit = j, headers[j][1] + 1
        while i >= 0 and limit > 0:
            k, level = i, headers[i][1]
            i = parents[i]
            if level >= limit:
                continue
            limit = level
            yield k

    def per_layer(at: int, helper: bool, decorators: bool = True) -> bool:
        forward = False
        outer = None
        for k in enclosing(at, decorators):
            start, level, word, name, keyword = headers[k]
            if word == b"for":
                if _FOR_LAYERS.match(data, keyword):
                    return True
            elif word == b"def":
                # Any forward below counts (not only one right in the class): with statements left
                # out, the def found next may not be the one around.
                forward = forward or _forward_name(name)
                outer = name if level == 0 else None
            elif word == b"class" and forward and _layer_header(data, headers[k]):
                return True
        if helper and outer:
            helpers.add(outer.decode())
        return False

    if any(per_layer(at, True) for at in offsets):
        return True
    if derived is not None:
        # The outermost defs (no def among the headers above them), each from its header to the next
        # header as little indented (its end or later: these spans do not overlap); the reads in those
        # holding a needle are the ones a derived value may reach.
        in_def: list[bool] = []
        spans: list[tuple[int, int, int, int]] = []  # (start, end, first header past it, def's header)
        for k, (start, level, word, _, _) in enumerate(headers):
            top = parents[k] == -1 or not in_def[parents[k]]
            in_def.append(word == b"def" or not top)
            if word == b"def" and top:
                after = next((j for j in range(k + 1, len(headers)) if headers[j][1] <= level), len(headers))
                spans.append((start, headers[after][0] if after < len(headers) else len(data), after, k))
        begins = [span[0] for span in spans]
        named: set = set()
        for m in _NEEDLES.finditer(data):
            i = bisect.bisect_right(begins, m.start()) - 1
            if i >= 0 and m.start() < spans[i][1]:
                named.add(i)
        for i in sorted(named):
            start, end, after, k = spans[i]
            if per_layer(headers[k][4], False):  # the def runs per layer: any read in it
                if derived.search(data, start, end):
                    return True
            elif any(headers[j][2] == b"class" or (headers[j][2] == b"for" and _FOR_LAYERS.match(data, headers[j][4]))
                     for j in range(k + 1, after)):
                # A loop over layers (or a class) inside: read by read. (A read in a decorator is
                # outside the function's values: the value model never follows it.)
                if any(per_layer(m.start(1) if m.lastindex else m.start(), True, False)
                       for m in derived.finditer(data, start, end)):
                    return True
            elif headers[k][1] == 0 and derived.search(data, start, end):
                helpers.add(headers[k][3].decode())  # a module-level function that reads: a helper
    if not helpers:
        return False
    calls = re.compile(rb"(?<![\w.])(?:" + b"|".join(re.escape(h.encode()) for h in sorted(helpers)) + rb")\s*\(")
    return any(per_layer(m.start(), False) for m in calls.finditer(data))


def reached_places(data: bytes) -> bool:
    """Whether GL104's pre-filter, last run on this very text, got to its per-layer test: the text names
    metadata and has a per-layer place (``PatternSpec.may_match`` tests those first)."""
    return _LAST_HEADERS[0] is data


def names_metadata_per_layer(data: bytes) -> bool:
    """Whether a GL104 needle (a sequence-length name) is in code run per layer, read from indentation
    alone (as ``in_per_layer_code``, without decorators): in a loop over layers, or in ``forward`` of a
    class ``*Block``/``*Layer``/``*Attention`` (its own line counts: ``def forward(self, x, cu_seqlens)``)."""
    headers, starts, parents = _headers(data)
    seen: set = set()
    for m in _NEEDLES.finditer(data):
        line = data.rfind(b"\n", 0, m.start()) + 1
        if line in seen:
            continue
        seen.add(line)
        text = data[line:m.start()]
        i, limit, forward = bisect.bisect_right(starts, line) - 1, len(text) - len(text.lstrip(b" \t")) + 1, False
        while i >= 0 and limit > 0:
            header = headers[i]
            _, level, word, name, keyword = header
            i = parents[i]
            if level >= limit:
                continue
            limit = level
            if word == b"for" and _FOR_LAYERS.match(data, keyword):
                return True
            forward = forward or (word == b"def" and _forward_name(name))
            if word == b"class" and forward and _layer_header(data, header):
                return True
    return False


# A forward assigned to (``X.forward = f``, ``setattr(X, "forward", f)``): a file ``summaries._installs`` reads.
INSTALLS = re.compile(rb"\.forward\s*=[^=]|setattr\([^)\n]*[\"']forward[\"']")


def may_call(data: bytes) -> bool:
    """A file that the textual pre-filter has just turned down (``RuleSet.may_match``) can hold a per-layer
    call with metadata (the callee summaries' roots, ``summaries.py``): GL104's part of it got to its per-layer
    test (the text names metadata and has a per-layer place), and a name of metadata is in code run per layer
    (``names_metadata_per_layer``). (The files parsed anyway are sketched whatever their text: the sketch finds
    its places itself.)"""
    return reached_places(data) and names_metadata_per_layer(data)


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

# A bare copy of a tensor to the host, read or not: ``t.cpu()``, ``t.to("cpu")``, ``t.to(device="cpu")``,
# ``t.to(torch.device("cpu"), dtype)`` (a ``non_blocking=True`` copy is told apart by the visitor).
_COPY = rb"\.cpu\(\s*\)|\.to\((?:[^()]|\([^()]*\))*?[\"']cpu\b"
_STEM = rb"(?:" + b"|".join(stem.encode() for stem in SEQLEN_STEMS if stem != "cu_seqlens") + rb")"

PATTERNS: dict[str, PatternSpec] = {
    "GL104": PatternSpec(
        code="GL104",
        visitor="host_sync:PerLayerHostSync",
        needles=tuple(stem.encode() for stem in SEQLEN_STEMS if stem != "cu_seqlens") + KERNEL_NAMES,
        # seqlens, seq_lens, seg_lens, seg_indptr: one search for "se" and what follows (on vLLM 0.33's
        # 50 MB, 0.026 s against 0.063 s for four substring searches)
        needle_pattern=_NEEDLES,
        more_needles=KERNEL_NAMES,
        # The truth of a tensor as a whole test: ``if (a > b).any():`` (the visitor reports no other use).
        also=((b".any():",), (b".all():",), (b".any()):",), (b".all()):",)),
        # A per-layer place: a forward in a class *Block/*Layer/*Attention (any case), or a for loop
        # whose header names layers or blocks (up to its colon: headers over several lines count).
        # (``forward_*``: the methods a dispatching forward runs, vLLM's CustomOp ``forward_oot``...; a class
        # whose base is named so is a layer too: ``class AscendMMEncoderAttention310(MMEncoderAttention)``.)
        # Or a function registered in an attention registry (``registries``), which a model calls once per layer.
        context=(
            (re.compile(rb"def\s+forward(?:_\w+)?\b"),
             re.compile(rb"class\s+\w*(?:(?i:block|layer|attention)\b|\([^):]*?(?i:block|layer|attention)\b)")),
            (_FOR_LAYERS,),
            (REGISTRATION,),
        ),
        # Then only reads that can be in such a place: ``in_per_layer_code`` reads the nesting from the
        # indentation (52 of vLLM 0.33's files passed on GL104's words alone, and CPython parsed them
        # for no finding; 1 did with the reads of lengths below, 34 do with the derived reads too, and
        # the tree pre-filter sends none of those to libcst).
        # .item()/.tolist() without arguments and bare copies to the host (.cpu(), .to("cpu"): ``_COPY``) (of
        # a receiver naming lengths, on the line of the read or up to three lines before it), int(t)/bool(t)/
        # float(t) of lengths, with the lengths on the line of
        # the cast (or the next one: ``int(`` and its argument below it), and ``if``/``while`` tests of
        # lengths (``if seq_lens:``, ``if not cu_seqlens[0]``, ``while x and seg_lens[i] < n``): ``.item(``,
        # ``int`` and ``if`` alone are in most files, and ``if seq_lens is None`` is no read.
        # A call of a known varlen kernel is a place of a read too (a device tensor handed to its int parameters).
        also_pattern=re.compile(
            rb"\.(?:item|tolist)\(\s*\)|" + _COPY + rb"|(?:" + b"|".join(KERNEL_NAMES) + rb")\s*\("
            + rb"|(?:int|bool|float)\(\s*[^\n]*?" + _STEM
            + rb"|(?:if|elif|while|and|or)\s+(?:not\s+)?\(?\s*[\w.]*" + _STEM
            + rb"\w*(?:\[[^\]\n]*\])?\s*(?::|and\b|or\b|[<>]=?|==|!=|\))"),
        also_after=3,
        where=in_per_layer_code,
        # Reads of a value derived from metadata under another name (``spans.tolist()``, ``spans.cpu()``,
        # ``int(m)``, ``if spans[0] > 0:``): in a function that names metadata (``in_per_layer_code``'s ``derived``).
        # An if/elif/while statement starts its line; ``if x is None:`` alone is no read (the visitor
        # leaves ``is`` tests alone).
        # (The read is where group 1 starts, when it matched.)
        derived=re.compile(rb"\.(?:item|tolist)\(\s*\)|" + _COPY + rb"|(?<![\w.])(?:int|bool|float)\("
                           rb"|^[ \t]*(if|elif|while)[ \t(]+(?![\w.]+[ \t]+is[ \t]+(?:not[ \t]+)?None[ \t]*:)", re.M),
    ),
}


# GL104's value model (values.py) and the tree pre-filter's cheaper picture of it (prefilter.py): the
# operations through which a value stays where its tensor is, and with it the metadata it derives from
# (``torch.diff(cu_seqlens).max()`` is still cu_seqlens' on the device). Any other call's result is host
# data or unknown.
# The same tensor seen otherwise.
SAME_TENSOR_ATTRS = frozenset({"T", "mT", "H", "mH", "data", "real", "imag"})
# Tensor methods whose result lives where the tensor does (``.cuda()`` and ``.to(...)`` move it).
KEEP_METHODS = frozenset("""
    abs absolute add add_ addcmul all amax amin any argmax argmin argsort bfloat16 bincount bool byte ceil char
    chunk clamp clamp_ clamp_max clamp_min clip clone contiguous copy_ count_nonzero cummax cummin cumprod
    cumsum cumsum_ detach diff div div_ double eq expand expand_as fill_ flatten flip float floor floor_divide
    gather ge gt half index_add index_fill index_put index_select int le long lt masked_fill masked_fill_
    masked_scatter masked_select max maximum mean min minimum mul mul_ narrow ne neg nonzero permute pow prod
    remainder repeat repeat_interleave reshape reshape_as roll round scatter scatter_ scatter_add select short
    sort split square squeeze std sub sub_ sum t tensor_split tile topk transpose tril triu trunc type type_as
    unbind unflatten unique unique_consecutive unsqueeze var view view_as where zero_
""".split())
MOVE_METHODS = ("cuda", "to")
# Methods of a host container (a list of device tensors) that give back what it holds.
CONTAINER_METHODS = ("pop", "get", "__getitem__", "copy")
# torch.<f>(x, ...) and F.<f>(x, ...): where their tensor operands are.
TORCH_KEEP = frozenset("""
    abs add all amax amin any argmax argmin argsort bincount broadcast_to bucketize ceil chunk clamp clip clone
    count_nonzero cummax cummin cumprod cumsum diff div eq flatten flip floor floor_divide gather ge gt
    index_select le lt masked_fill masked_select max maximum mean min minimum mul narrow ne neg nonzero pad
    permute pow prod remainder repeat_interleave reshape roll round searchsorted sort split squeeze sub sum t
    tensor_split topk transpose tril triu unbind unique unique_consecutive unsqueeze where
""".split())
# torch.cat([a, b]): where the tensors of its first argument are.
TORCH_JOIN = frozenset({"cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack"})
# torch.tensor(x) of a device tensor is a copy on its device (of Python data, a host tensor).
TORCH_COPIES = ("tensor", "as_tensor", "asarray")
# Builtins whose result holds their argument's elements: max(seq_lens) is a 0-d device tensor.
KEEP_BUILTINS = ("list", "tuple", "sorted", "reversed", "set", "frozenset", "max", "min", "sum", "abs", "round")
# Declared types of host data: ``seq_lens: list[int] | None`` is a host list whatever its name.
DECLARED_HOST_TYPES = frozenset({"int", "float", "bool", "str", "bytes", "complex", "None", "ndarray", "NDArray"})
DECLARED_CONTAINERS = frozenset({"list", "List", "tuple", "Tuple", "Sequence", "MutableSequence", "Iterable",
                                 "Iterator", "set", "Set", "frozenset", "FrozenSet", "dict", "Dict", "Mapping"})


def is_seqlen_name(name: str) -> bool:
    return bool(SEQLEN_NAME.match(name)) and not name.endswith(HOST_SUFFIXES)
