"""For ``guardlint diagnose``: engine errors that name no argument or no rule, and the rule each means."""
from __future__ import annotations

from typing import NamedTuple


class EngineError(NamedTuple):
    """For ``guardlint diagnose``: an engine error that names no argument or no rule (a TypeError on None, a
    bare assert, a CUDA fault, the engine's own wording). It means ``code`` when an exception line matches
    ``exception`` and, where set:
    ``file``: the innermost frame whose path matches it raised the error (a fault told apart by where);
    ``source``: the line that raised it, quoted by the innermost frame in any file (forks and copies of the
    engine's code raise it from their own files); ``callee``: the function it is raised inside (its
    innermost frame, e.g. triton's ``cdiv``), so that ``source`` is the line of the nearest frame that
    calls it, and a caller that passes something else is another error; without ``source``, the entry
    applies only when no frame shows the call; ``alone``: ``source`` is the whole error text (an assert
    without a message): that line pasted alone, with or without the exception line, means ``code``.
    ``engine``: whose shape it is; it picks the fix (the solutions starting "In <engine>:") when no frame
    shows the engine. ``confirm`` marks the rule as one possible cause among several and says how to tell.
    ``summary``: what the engine checks, in its terms, for the answer's first line."""

    code: str
    exception: str
    file: str = ""
    source: str = ""
    engine: str = ""
    confirm: str = ""
    callee: str = ""
    alone: bool = False
    summary: str = ""


# Any spelling of a max_len passed to cdiv: triton.cdiv(max_len, ...), cdiv(self.batch_info.max_len, ...).
_CDIV_MAX_LEN = r"\bcdiv\(\s*(?:[A-Za-z_]\w*\s*\.\s*)*max_len\b"
_NONE_PLUS_INT = r"^TypeError: unsupported operand type\(s\) for [-+]: 'NoneType' and 'int'$"
_LORA_FRAMES = (r"(?:^|/)(?:sglang/(?:srt/lora|kernels/ops/lora)|vllm/lora|guardlint/kernels/lora|kernels/lora)"
                r"(?:/|\.py$)")
_ILLEGAL_ACCESS = r"CUDA error: an illegal memory access was encountered"
_CONFIRM = (
    "An illegal memory access has several causes, and {what} is one of them. CUDA reports the fault at a "
    "later call, so the frames need not show the kernel that faulted. To confirm, run again with "
    "CUDA_LAUNCH_BLOCKING=1 (the error then surfaces at the launch that faulted) and GUARDLINT_MODE=strict "
    "(guardlint checks the metadata of every guarded call and names the wrong argument)."
)

ENGINE_ERRORS: tuple[EngineError, ...] = (
    EngineError("GL101", r"sequence_lengths must be a torch\.Tensor", engine="sglang"),
    EngineError("GL103", r"offset \+ len out of bounds; packed indptr is wrong", engine="sglang"),
    EngineError("GL107", r"packed indptr numel mismatch", engine="sglang"),
    EngineError("GL107", r"flashinfer_cudnn expects packed indptrs as a torch\.Tensor", engine="sglang"),
    # VisionAttention always forwards max_seqlen= and sequence_lengths= (None when not given), so without
    # prepared forward_metadata the cuDNN backend gets past its "should be prepared" checks and fails here.
    EngineError("GL102", r"^TypeError: int\(\) argument must be .*, not 'NoneType'$",
                source=r"^max_seqlen = int\(max_seqlen\)$", engine="sglang"),
    # sglang's Triton LoRA launchers size their grid with triton.cdiv(max_len, BLOCK_S), which computes
    # None + BLOCK_S - 1 (vLLM's LoRA metadata has no max_len).
    EngineError("GL201", _NONE_PLUS_INT, source=_CDIV_MAX_LEN, engine="sglang", callee=r"^cdiv$"),
    EngineError("GL201", _NONE_PLUS_INT, engine="sglang", callee=r"^cdiv$", confirm=(
        "cdiv got None as its first argument; in sglang's LoRA kernels that is batch_info.max_len "
        "(triton.cdiv(batch_info.max_len, BLOCK_S) sizes the grid). The input does not show the line that "
        "called cdiv: if that line passes max_len, this is GL201; if it passes anything else, it is not.")),
    # vLLM's FlashInfer (cuDNN) encoder wrapper, called by MMEncoderAttention, asserts without a message.
    EngineError("GL101", r"^AssertionError$", source=r"^assert sequence_lengths is not None$", engine="vllm",
                alone=True, summary="MMEncoderAttention on the FlashInfer cuDNN encoder backend asserts "
                                    "sequence_lengths is not None"),
    EngineError("GL102", r"^AssertionError$", source=r"^assert max_seqlen is not None$", engine="vllm",
                alone=True, summary="MMEncoderAttention on the FlashInfer cuDNN encoder backend asserts "
                                    "max_seqlen is not None"),
    EngineError("GL204", _ILLEGAL_ACCESS, _LORA_FRAMES,
                confirm=_CONFIRM.format(what="LoRA batch info that does not describe the batch")),
    EngineError("GL103", _ILLEGAL_ACCESS, confirm=_CONFIRM.format(what="varlen metadata that does not "
                                                                        "describe the packed tensors")),
)
