"""One copy kernel, in Triton, for every copy the SMs make: host <-> device through unified
addresses (``sm_gather``) and device <-> device to and from a staging buffer (``staged``).

Triton ships with CUDA builds of torch; where it is missing, `available()` says why and the
backend offers only copy-engine mechanisms.
"""

from __future__ import annotations

import functools

import numpy as np

PIECE_BYTES = 64 * 1024  # one work item: large copies are split so that all programs share them
BLOCK = 1024  # elements moved per program per loop step (8 KiB of 64-bit words)


@functools.lru_cache(maxsize=1)
def _compile():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(desc_ptr, n, pieces, PIECE: tl.constexpr, BLOCK: tl.constexpr):
        # desc_ptr holds [src[0:n], dst[0:n], size[0:n]] as int64. Work item t is piece
        # t % pieces of copy t // pieces; programs stride over the items.
        offs = tl.arange(0, BLOCK)
        total = n * pieces
        item = tl.program_id(0)
        while item < total:
            i = item // pieces
            start = (item % pieces).to(tl.int64) * PIECE
            size = tl.load(desc_ptr + 2 * n + i)
            if start < size:
                src = tl.load(desc_ptr + i)
                dst = tl.load(desc_ptr + n + i)
                end = tl.minimum(start + PIECE, size)
                # 64-bit words where both ends are 8-byte aligned, bytes for the rest
                w0 = start // 8
                w1 = tl.where(((src | dst) & 7) == 0, end // 8, w0)
                src_w = src.to(tl.pointer_type(tl.int64))
                dst_w = dst.to(tl.pointer_type(tl.int64))
                for w in range(w0, w1, BLOCK):
                    o = w + offs
                    m = o < w1
                    tl.store(dst_w + o, tl.load(src_w + o, mask=m), mask=m)
                src_b = src.to(tl.pointer_type(tl.int8))
                dst_b = dst.to(tl.pointer_type(tl.int8))
                for b in range(w1 * 8, end, BLOCK):
                    o = b + offs
                    m = o < end
                    tl.store(dst_b + o, tl.load(src_b + o, mask=m), mask=m)
            item += tl.num_programs(0)

    return copy_kernel


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """None if the kernel can run here, else why not."""
    try:
        import triton  # noqa: F401
    except Exception as exc:
        return f"triton is not importable ({exc.__class__.__name__}: {exc})"
    return None


def launch(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream, device, max_programs: int) -> None:
    """Enqueue the copy kernel on `stream` for addresses the device can dereference.

    The descriptors go up through torch's pinned host allocator, which keeps the staging
    copy alive until the upload has run; the device copy belongs to `stream`.
    """
    import torch

    n = len(sizes)
    pieces = max(1, -(-int(sizes.max()) // PIECE_BYTES))
    host = torch.from_numpy(np.concatenate((src, dst, sizes))).pin_memory()
    with torch.cuda.stream(stream):
        desc = torch.empty(3 * n, dtype=torch.int64, device=device)
        desc.copy_(host, non_blocking=True)
        grid = (max(1, min(max_programs, n * pieces)),)
        _compile()[grid](desc, n, pieces, PIECE=PIECE_BYTES, BLOCK=BLOCK)
