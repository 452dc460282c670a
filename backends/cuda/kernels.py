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
SMALL_BYTES = 1024  # up to this size the tiled kernel wins; at 4 KiB the piece kernel did (H200)
TILE_WORDS = 4096  # words in flight per program per step in the tiled kernel


@functools.lru_cache(maxsize=1)
def _compile():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(src_col, src_step, dst_col, dst_step, size_col, n, pieces, SRC_ARRAY: tl.constexpr,
                    DST_ARRAY: tl.constexpr, SIZE_ARRAY: tl.constexpr, PIECE: tl.constexpr, BLOCK: tl.constexpr):
        # Work item t is piece t % pieces of copy t // pieces; programs stride over the items.
        offs = tl.arange(0, BLOCK)
        total = n * pieces
        item = tl.program_id(0)
        while item < total:
            i = item // pieces
            start = (item % pieces).to(tl.int64) * PIECE
            # a column is read from a device array, or is base + i * step (nothing uploaded)
            size = tl.load(size_col + i) if SIZE_ARRAY else size_col
            if start < size:
                src = tl.load(src_col + i) if SRC_ARRAY else src_col + i.to(tl.int64) * src_step
                dst = tl.load(dst_col + i) if DST_ARRAY else dst_col + i.to(tl.int64) * dst_step
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

    @triton.jit
    def copy_small_kernel(src_col, src_step, dst_col, dst_step, size_col, n, SRC_ARRAY: tl.constexpr,
                          DST_ARRAY: tl.constexpr, SIZE_ARRAY: tl.constexpr, D: tl.constexpr, W: tl.constexpr):
        # Small copies are bound by latency, not bytes: each program moves a tile of D copies
        # at once, W 64-bit words (or bytes, for the unaligned rest) of each per step.
        rows = tl.arange(0, D)
        cols = tl.arange(0, W)
        for first in range(tl.program_id(0) * D, n, tl.num_programs(0) * D):
            i = first + rows
            ok = i < n
            src = tl.load(src_col + i, mask=ok, other=0) if SRC_ARRAY else src_col + i.to(tl.int64) * src_step
            dst = tl.load(dst_col + i, mask=ok, other=0) if DST_ARRAY else dst_col + i.to(tl.int64) * dst_step
            size = tl.load(size_col + i, mask=ok, other=0) if SIZE_ARRAY else tl.where(ok, size_col, 0)
            words = tl.where(((src | dst) & 7) == 0, size // 8, 0)
            src_w = src.to(tl.pointer_type(tl.int64))
            dst_w = dst.to(tl.pointer_type(tl.int64))
            for w in range(0, tl.max(words, axis=0), W):
                o = w + cols
                m = o[None, :] < words[:, None]
                tl.store(dst_w[:, None] + o[None, :], tl.load(src_w[:, None] + o[None, :], mask=m), mask=m)
            done = words * 8
            left = size - done
            src_b = (src + done).to(tl.pointer_type(tl.int8))
            dst_b = (dst + done).to(tl.pointer_type(tl.int8))
            for b in range(0, tl.max(left, axis=0), W):
                o = b + cols
                m = o[None, :] < left[:, None]
                tl.store(dst_b[:, None] + o[None, :], tl.load(src_b[:, None] + o[None, :], mask=m), mask=m)

    return copy_kernel, copy_small_kernel


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """None if the kernel can run here, else why not."""
    try:
        import triton  # noqa: F401
    except Exception as exc:
        return f"triton is not importable ({exc.__class__.__name__}: {exc})"
    return None


def upload(columns, stream, device, split: int = 0) -> list:
    """Descriptor columns to the device on `stream`: int64 ``(len(columns), n)`` tensors, one,
    or two (``[:split]`` and ``[split:]``, copied in that order) where ``0 < split < n``.

    The host side is one buffer from torch's pinned allocator, which keeps it alive until the
    copies have run; the device tensors' memory is ordered on `stream`.
    """
    import torch

    n, k = len(columns[0]), len(columns)
    parts = [(0, split), (split, n)] if 0 < split < n else [(0, n)]
    host = torch.empty(k * n, dtype=torch.int64, pin_memory=True)  # part after part, each contiguous
    flat, tables = host.numpy(), []
    with torch.cuda.stream(stream):
        for a, b in parts:
            rows = flat[k * a : k * b].reshape(k, b - a)
            for row, column in zip(rows, columns):
                row[:] = column[a:b]
            tables.append(torch.empty((k, b - a), dtype=torch.int64, device=device))
            tables[-1].copy_(host[k * a : k * b].view(k, b - a), non_blocking=True)
    return tables


def run(src, dst, size, n: int, largest: int, stream, max_programs: int) -> None:
    """Enqueue the copy kernel on `stream` for `n` copies: copy i moves ``size[i]`` bytes from
    ``src[i]`` to ``dst[i]``, each address one the device can dereference.

    Each of `src`, `dst` and `size` is a device int64 tensor of `n` values, or a pair
    ``(base, step)`` standing for ``base + i * step`` (for `size`, a step of 0): a column that
    costs no upload. `largest` is the largest size.
    """
    import torch

    copy_kernel, copy_small_kernel = _compile()
    args, arrays = [], []
    for col in (src, dst, size):
        arrays.append(not isinstance(col, tuple))
        args += [col, 0] if arrays[-1] else [int(col[0]), int(col[1])]
    args.pop()  # size has no step
    with torch.cuda.stream(stream):
        if largest <= SMALL_BYTES:
            width = 32 if largest <= 256 else 128  # words per copy per step: little masked waste
            rows = TILE_WORDS // width
            grid = (max(1, min(max_programs, -(-n // rows))),)
            copy_small_kernel[grid](*args, n, *arrays, D=rows, W=width)
        else:
            pieces = -(-largest // PIECE_BYTES)
            grid = (max(1, min(max_programs, n * pieces)),)
            copy_kernel[grid](*args, n, pieces, *arrays, PIECE=PIECE_BYTES, BLOCK=BLOCK)


def launch(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream, device, max_programs: int) -> None:
    """Upload the descriptors (the sizes only if they differ) and enqueue the copy kernel on `stream`."""
    largest = int(sizes.max())
    uniform = int(sizes.min()) == largest
    (table,) = upload((src, dst) if uniform else (src, dst, sizes), stream, device)
    run(table[0], table[1], (largest, 0) if uniform else table[2], len(sizes), largest, stream, max_programs)
