"""Run the two ViT twins on the CPU and show what the guard derived for the broken one.

``vit.py`` forgets sequence_lengths, max_seqlen, seg_lens and max_len; the guard derives each once per forward
(cached across the layers) instead of letting the kernels crash. ``vit_fixed.py`` prepares them itself.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

# On a machine without a GPU the Triton kernels run through the interpreter; it must be set before they load.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import guardlint.guard as guard  # noqa: E402


def main() -> int:
    import vit
    import vit_fixed

    torch.manual_seed(0)
    # Three images of 5, 7 and 8 patches packed into one sequence; image 1 uses adapter slot 1.
    cu_seqlens = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    adapter_of_image = torch.tensor([0, 1, 0], dtype=torch.int32)
    x = torch.randn(20, 64)
    broken, fixed = vit.TinyViT(), vit_fixed.TinyViT()
    fixed.load_state_dict(broken.state_dict())

    print(f"== guarded forward of examples/vit.py ({len(broken.blocks)} blocks, mode={guard.get_mode()})")
    guard.reset_stats()
    guard.on_derive(lambda event: print("  " + str(event)))
    with torch.no_grad():
        out_broken = broken(x, cu_seqlens, adapter_of_image)
    s = guard.stats()
    print(f"  -> host reads: {s['host_reads']} (device-to-host: {s['device_reads']}), cache hits: {s['cache_hits']}")

    print("== forward of examples/vit_fixed.py (metadata prepared once)")
    guard.reset_stats()
    with torch.no_grad():
        out_fixed = fixed(x, cu_seqlens, adapter_of_image)
    s = guard.stats()
    print(f"  -> derived by the guard: {len(s['events'])}, host reads: {s['host_reads']}")
    guard.on_derive(None)

    diff = (out_broken - out_fixed).abs().max().item()
    print(f"== both outputs agree: max |difference| = {diff:.2e}")
    return 0 if diff < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
