"""auto against FlashInfer FA3 on the 6-image D=128 case (GPU only): rotated side-by-side event timings
of auto and two identical direct FA3 callables, then a torch profiler trace of each, to tell kernel work
from timer noise.

    python bench/attention_auto_profile.py
"""
from _util import require

require("torch", "triton", "guardlint")  # a clear message outside the venv
import os
import statistics
import sys

import torch

os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _attention_cases import all_cases, make_inputs
from _util import cuda_time_us
from guardlint.kernels import varlen_attention
from guardlint.kernels.attention import select_backend
case = [c for c in all_cases() if c.name == "6img-d128"][0]
q, k, v, cu, off, plan = make_inputs(case, torch.device("cuda"), torch.bfloat16)
mk = lambda b: (lambda: varlen_attention(q, k, v, cu, metadata=plan, backend=b))
fns = {"auto": mk("auto"), "fa3-a": mk("flashinfer-fa3"), "fa3-b": mk("flashinfer-fa3"), "fa2": mk("flashinfer-fa2")}
print("auto picks", select_backend(q, k, cu, case.max_seqlen), flush=True)
for n, f in fns.items():
    f(); torch.cuda.synchronize(); print("ready", n, flush=True)
ref = fns["fa3-a"]().float()
print("auto vs fa3 max diff", (fns["auto"]().float() - ref).abs().max().item())
names = list(fns); times = {n: [] for n in names}
for i in range(7):
    for n in names[i % 4:] + names[:i % 4]:
        times[n].append(cuda_time_us(fns[n], warmup=5, iters=30))
for n in names: print(n, round(statistics.median(times[n]), 1), [round(t, 1) for t in times[n]])
from torch.profiler import profile, ProfilerActivity
for n in ("auto", "fa3-a"):
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        for _ in range(3): fns[n]()
        torch.cuda.synchronize()
    print("=== profile", n)
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
