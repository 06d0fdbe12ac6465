"""GL000-GL002 (the linter and user-declared contracts) and GL301 (the machine)."""
from __future__ import annotations

from ..model import Contract, Diagnosis

GL001 = Contract(
    code="GL001",
    name="unmet-contract",
    summary="A call that does not meet a contract declared in [tool.guardlint]",
    kind="call",
    diagnosis=Diagnosis(
        message="call does not pass what its declared contract requires",
        what_it_means="A contract from your [tool.guardlint] configuration says this callable needs one "
        "of the listed argument groups, each argument passed and not None.",
        when_it_happens="A call site passes only part of the metadata of your own kernel.",
        solutions=(
            "Pass one of the required groups.",
            "Give the contract a derivation template (derive = {arg = \"...\"}) to get an automatic fix.",
        ),
        fix_safety="Unsafe, and only where the contract gives a derivation template.",
    ),
)

GL002 = Contract(
    code="GL002",
    name="guard-misuse",
    summary="A guard decorator applied to a function or with options it cannot work with",
    kind="runtime",
    diagnosis=Diagnosis(
        message="the guard decorator cannot be applied like this",
        what_it_means="@guard, @guard_varlen, @guard_cudnn_vision or @guard_lora was given something other "
        "than a rule code or Contract, an unknown code or option, a rename to a parameter that does not "
        "exist, or a function that has no parameter to receive the values it would derive. Raised once, "
        "when the decorator is applied, never per call.",
        when_it_happens="A typo in a rule code or a rename, a function without the metadata parameters, "
        "or options such as rank_dim on a kernel without a weights parameter.",
        solutions=(
            "Decorate with a known code (@guard(\"GL101\")) and map names to the function's parameters "
            "(@guard(\"GL101\", cu_seqlens=\"cu\")); give the function the parameters, or **kwargs.",
        ),
    ),
)

GL000 = Contract(
    code="GL000",
    name="parse-error",
    summary="A file that could not be read or parsed",
    kind="file",
    diagnosis=Diagnosis(
        message="file could not be parsed",
        what_it_means="guardlint could not read or parse this file, so it was not checked. The run goes on.",
        when_it_happens="Syntax errors, undecodable bytes, unreadable files, files too large or nested "
        "too deeply.",
        solutions=("Fix the syntax, or exclude the file ([tool.guardlint] exclude).",),
    ),
)

GL301 = Contract(
    code="GL301",
    name="no-gpu-driver",
    summary="A Triton or CUDA kernel was launched on a machine without a GPU driver",
    kind="runtime",
    diagnosis=Diagnosis(
        message="no GPU driver: GPU kernels cannot launch here",
        what_it_means="Not a metadata error: Triton or CUDA found no usable GPU (no driver, or no CUDA "
        "device visible), so compiled kernels cannot run on this machine.",
        when_it_happens="Running GPU code on a CPU-only machine or container, or with CUDA_VISIBLE_DEVICES "
        "empty.",
        solutions=(
            "Use backend=\"sdpa\" (the torch reference) on the CPU, or run on a GPU machine.",
            "For testing kernels on the CPU, set TRITON_INTERPRET=1 before the kernels are imported.",
        ),
        patterns=(r"0 active drivers", r"Found no NVIDIA driver on your system",
                  r"no CUDA-capable device is detected"),
    ),
)
