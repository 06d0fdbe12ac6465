"""GL201-GL205: segmented LoRA GEMMs and their batch info, each rule with its examples."""
from __future__ import annotations

from ..model import Contract, Diagnosis, Example, Target
from .engine import ENGINE_LORA_INFO, LORA_FIELDS, MAX_LEN, MAX_LIVE_LEN, OUR_LORA_INFO, SEG_LENS

_LORA_BAD = '''\
import torch
from guardlint.kernels.lora import LoRABatchInfo, sgemm_lora_a

x = torch.randn(7, 16)
lora_a = torch.randn(2, 4, 16)
seg_indptr = torch.tensor([0, 3, 7], dtype=torch.int32)
info = LoRABatchInfo(  # expect: GL201
    use_cuda_graph=False,
    bs=2,
    num_segments=2,
    seg_indptr=seg_indptr,
    weight_indices=torch.tensor([0, 1], dtype=torch.int32),
    lora_ranks=torch.tensor([4, 4], dtype=torch.int32),
    scalings=torch.tensor([1.0, 0.5]),
    permutation=None,
)
shrunk = sgemm_lora_a(x, lora_a, info)
'''

_LORA_FIXED = '''\
import torch
from guardlint.kernels.lora import LoRABatchInfo, sgemm_lora_a

x = torch.randn(7, 16)
lora_a = torch.randn(2, 4, 16)
seg_indptr = torch.tensor([0, 3, 7], dtype=torch.int32)
info = LoRABatchInfo(
    use_cuda_graph=False,
    bs=2,
    num_segments=2,
    seg_indptr=seg_indptr,
    weight_indices=torch.tensor([0, 1], dtype=torch.int32),
    lora_ranks=torch.tensor([4, 4], dtype=torch.int32),
    scalings=torch.tensor([1.0, 0.5]),
    permutation=None,
    seg_lens=seg_indptr[1:] - seg_indptr[:-1],
    max_len=int((seg_indptr[1:] - seg_indptr[:-1]).max()),
)
shrunk = sgemm_lora_a(x, lora_a, info)
'''

GL201 = Contract(
    code="GL201",
    name="missing-max-len-and-seg-lens",
    summary="LoRABatchInfo built with neither max_len nor seg_lens",
    kind="call",
    targets=(Target(ENGINE_LORA_INFO, "class"), Target(OUR_LORA_INFO, "class", params=LORA_FIELDS[:10])),
    params=LORA_FIELDS,
    require=(("max_len",), ("seg_lens",)),
    derivations=(SEG_LENS, MAX_LEN, MAX_LIVE_LEN),
    fix_safety="unsafe",
    satisfied_by_later_assignment=True,
    fix_writes=("seg_lens", "max_len"),
    notes=(
        "dataclasses.replace(info, max_len=None, seg_lens=None) is reported too.",
        "Not reported when the same function later sets info.max_len or info.seg_lens to a non-None value.",
    ),
    diagnosis=Diagnosis(
        message="LoRA batch_info must provide max_len or seg_lens.",
        what_it_means=(
            "The segmented LoRA GEMMs (shrink, expand, and the steps of MLA's absorbed kv_b_proj: "
            "step_a_q, step_b_q, step_a_v, step_b_v) size their grid by the longest segment. With both "
            "max_len and seg_lens None the launcher cannot size the grid without a host read, so it "
            "refuses."
        ),
        when_it_happens=(
            "A LoRA backend or test builds LoRABatchInfo by hand (or with dataclasses.replace) and leaves "
            "both fields at None; a CUDA-graph path that fills them only in one branch."
        ),
        solutions=(
            "Pass seg_lens=seg_indptr[1:] - seg_indptr[:-1] (no host read) and, when known on the host, "
            "max_len=int(max(lengths)).",
            "Under CUDA graphs, compute both over the live num_segments only; entries past it are stale.",
            "Or let the guard derive them: guardlint.kernels.lora kernels do, cached per seg_indptr version.",
            "In sglang: the Triton LoRA kernels size their grid with triton.cdiv(batch_info.max_len, "
            "BLOCK_S), so they need max_len itself (seg_lens alone is not enough there): set max_len to a "
            "host int, as the backend's prepare_lora_batch does from forward_batch.extend_seq_lens_cpu "
            "(no device read), and seg_lens on the LoRABatchInfo before the LoRA layers run.",
        ),
        fix_safety=(
            "Unsafe: the fix adds seg_lens (a seg_lens already in scope, else seg_indptr[1:] - "
            "seg_indptr[:-1] from the call's own seg_indptr) and max_len (a max_len already in scope, else "
            "int(seg_lens.max()): one host read per batch). sglang's Triton kernels size their grid "
            "with triton.cdiv(max_len, BLOCK_S), so seg_lens alone is not enough there; only its absorbed-MLA "
            "kv_b_proj path derives max_len itself. On graph-padded buffers the tail past num_segments is "
            "stale. Applied with --unsafe-fixes, only when the sources are names or attribute chains."
        ),
        patterns=(r"LoRA batch_info must provide max_len or seg_lens",),
    ),
    examples=(
        Example("bad", _LORA_BAD, runnable=True),
        Example("fixed", _LORA_FIXED, runnable=True),
        Example("bad", '''\
import dataclasses


def reset(info):
    return dataclasses.replace(info, max_len=None, seg_lens=None)  # expect: GL201
'''),
        Example("good", '''\
from sglang.srt.lora.utils import LoRABatchInfo as Info


def build(bs, seg_indptr, weight_indices, ranks, scalings, lens, longest):
    info = Info(use_cuda_graph=False, bs=bs, num_segments=bs, seg_indptr=seg_indptr,
                weight_indices=weight_indices, lora_ranks=ranks, scalings=scalings,
                max_len=None, seg_lens=None, permutation=None)
    info.seg_lens = lens
    info.max_len = longest  # a host int: sglang's Triton kernels size their grid by max_len itself
    return info
'''),
        Example("good", '''\
from sglang.srt.lora.utils import LoRABatchInfo


def build(seg_indptr, weight_indices, ranks, scalings, max_len):
    return LoRABatchInfo(use_cuda_graph=True, bs=8, num_segments=8, seg_indptr=seg_indptr,
                         weight_indices=weight_indices, lora_ranks=ranks, scalings=scalings,
                         max_len=max_len, seg_lens=None, permutation=None)
'''),
    ),
)

GL202 = Contract(
    code="GL202",
    name="positional-lora-batch-info",
    summary="LoRABatchInfo built with positional arguments",
    kind="positional",
    targets=GL201.targets,
    params=LORA_FIELDS,
    fix_safety="unsafe",
    diagnosis=Diagnosis(
        message="LoRABatchInfo takes keywords: its field order changed between releases",
        headline="field order differs between releases",
        what_it_means=(
            "LoRABatchInfo's field order is not stable across engine releases (max_len and seg_lens moved, "
            "permutation was added; sglang 0.5.23 has 16 fields, ten as before and then expected_tokens, "
            "has_active_lora, is_prefill, req_seg_indptr, req_weight_indices, moe_lora_info). A positional call silently puts a tensor in the wrong field after an "
            "upgrade."
        ),
        when_it_happens="Code written against one release and run against another, or copied from an "
        "older test.",
        solutions=("Name every field: LoRABatchInfo(use_cuda_graph=..., bs=..., ...).",),
        fix_safety=(
            "Unsafe: the fix names each positional argument by the field order of sglang 0.5.23 ("
            + ", ".join(LORA_FIELDS) + "; guardlint's own LoRABatchInfo has the first ten). If the code "
            "was written for an older order, check the result by eye."
        ),
    ),
    examples=(
        Example("bad", '''\
from sglang.srt.lora.utils import LoRABatchInfo


def build(seg_indptr, weight_indices, ranks, scalings, seg_lens):
    return LoRABatchInfo(False, 2, 2, seg_indptr, weight_indices, ranks, scalings, None, seg_lens, None)  # expect: GL202
'''),
        Example("fixed", '''\
from sglang.srt.lora.utils import LoRABatchInfo


def build(seg_indptr, weight_indices, ranks, scalings, seg_lens):
    return LoRABatchInfo(use_cuda_graph=False, bs=2, num_segments=2, seg_indptr=seg_indptr, weight_indices=weight_indices, lora_ranks=ranks, scalings=scalings, max_len=None, seg_lens=seg_lens, permutation=None)
'''),
    ),
)

GL203 = Contract(
    code="GL203",
    name="zero-max-len",
    summary="LoRABatchInfo with max_len=0: the kernels launch an empty grid and do nothing",
    kind="value",
    targets=GL201.targets,
    params=LORA_FIELDS,
    forbidden_values=(("max_len", "0"),),
    satisfied_by_later_assignment=True,
    notes=(
        "Not reported for a CUDA-graph buffer whose placeholder 0 is overwritten per batch: the object is "
        "kept and its max_len is set to another value afterwards. For self.batch_info = "
        "LoRABatchInfo(..., max_len=0, ...), a method of the same class sets self.batch_info.max_len (or "
        "info.max_len after info = self.batch_info); for info = LoRABatchInfo(...), the same function "
        "sets info.max_len later.",
    ),
    diagnosis=Diagnosis(
        message="max_len=0 launches an empty grid: the LoRA kernels silently do nothing",
        headline="an empty launch grid",
        what_it_means=(
            "max_len sizes the grid. 0 passes the 'is not None' check, so no error is raised, but no "
            "program runs: the LoRA delta is never added and outputs stay as they were."
        ),
        when_it_happens="A placeholder 0 left in a CUDA-graph warm-up batch, or max(lengths, default=0) "
        "over an empty host list while tokens exist.",
        solutions=(
            "Pass the real maximum segment length, or None with seg_lens set so it is derived.",
            "With the guardlint kernels (or @guard_lora), GUARDLINT_MODE=strict rejects max_len == 0 when "
            "there are tokens; the default mode, derive, computes max_len again from seg_indptr.",
        ),
        fix_safety="No automatic fix: the right value is a runtime quantity.",
    ),
    examples=(
        Example("bad", '''\
from sglang.srt.lora.utils import LoRABatchInfo


def build(seg_indptr, weight_indices, ranks, scalings, seg_lens):
    return LoRABatchInfo(use_cuda_graph=False, bs=2, num_segments=2, seg_indptr=seg_indptr,
                         weight_indices=weight_indices, lora_ranks=ranks, scalings=scalings,
                         max_len=0, seg_lens=seg_lens, permutation=None)  # expect: GL203
'''),
        Example("good", '''\
from sglang.srt.lora.utils import LoRABatchInfo


def build(seg_indptr, weight_indices, ranks, scalings, seg_lens):
    return LoRABatchInfo(use_cuda_graph=False, bs=2, num_segments=2, seg_indptr=seg_indptr,
                         weight_indices=weight_indices, lora_ranks=ranks, scalings=scalings,
                         max_len=None, seg_lens=seg_lens, permutation=None)
'''),
    ),
)

GL204 = Contract(
    code="GL204",
    name="invalid-lora-batch-info",
    summary="LoRABatchInfo fields are present but inconsistent",
    kind="runtime",
    diagnosis=Diagnosis(
        message="LoRA batch info does not describe the batch",
        what_it_means=(
            "seg_indptr must be 1-D integer prefix sums from 0, non-decreasing, ending at the token count "
            "over the live num_segments; weight_indices must index the weight stack; lora_ranks must not "
            "exceed the stored rank; given seg_lens must match seg_indptr. Otherwise the kernels read "
            "out of bounds (illegal memory access) or skip tokens."
        ),
        when_it_happens="Reused CUDA-graph buffers with a stale num_segments, adapters unloaded while a "
        "batch still points at their slot, ranks larger than the memory pool's max rank.",
        solutions=(
            "Rebuild the batch info from the scheduler's batch.",
            "Run with GUARDLINT_MODE=strict while debugging to validate every call (one host read per call).",
        ),
    ),
)

GL205 = Contract(
    code="GL205",
    name="bad-lora-input",
    summary="LoRA GEMM inputs whose shapes, dtypes or devices do not fit together",
    kind="runtime",
    diagnosis=Diagnosis(
        message="LoRA GEMM inputs do not fit the kernel",
        what_it_means=(
            "x is (S, K) (or (S, H, K) for the MLA steps), weights are (num_slots, N, K) stacks, output "
            "is (S, N); all on one device, x and weights of one floating dtype."
        ),
        when_it_happens="A transposed weight stack, an output of the wrong width, or inputs on the CPU.",
        solutions=("Check the shapes in the kernel's docstring (help(guardlint.kernels.lora.sgemm_lora_a)); "
                   "compare with its torch reference, the same name with _reference "
                   "(guardlint.kernels.lora.sgemm_lora_a_reference).",),
    ),
)
