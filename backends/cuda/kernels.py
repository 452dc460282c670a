"""The copy kernel, in Triton, for every copy the SMs make: the expansion of compact jobs
(`expand`: block ids against a layout's entry table), into staging or through unified
addresses to and from host memory.

Triton ships with CUDA builds of torch; where it is missing, `why_unavailable()` says so and the
backend offers only copy-engine mechanisms.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def _compile():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_tile(src, dst, size, W: tl.constexpr):
        # A tile of copies (addresses and sizes per row; size 0 for a row that copies nothing):
        # W 64-bit words of each per step where both ends are 8-byte aligned, then W bytes of
        # each per step for the rest. Small copies are bound by latency: a tile goes at once.
        cols = tl.arange(0, W)
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

    @triton.jit(do_not_specialize=["blocks", "n", "num_entries", "num_groups", "per_block", "row_base", "row_step"])
    def expand_kernel(
        blocks,
        n,
        entries,
        num_entries,
        groups,
        num_groups,
        per_block,
        row_base,
        row_step,
        STORE: tl.constexpr,
        SIMPLE: tl.constexpr,
        BY_HOST: tl.constexpr,
        NARROW: tl.constexpr,
        D: tl.constexpr,
        W: tl.constexpr,
    ):
        # Item t is entry slot t % per_block of block t // per_block (offload_core.compact has the
        # formulas); each program moves a tile of D items at once (`copy_tile`). The block table
        # has five columns, the host row's address in place of the chunk; or, SIMPLE, two: device
        # and host block ids (int32 where NARROW), the row at row_base + row_step * (host id if
        # BY_HOST else block).
        rows = tl.arange(0, D)
        blk = blocks.to(tl.pointer_type(tl.int32 if NARROW else tl.int64))
        ent = entries.to(tl.pointer_type(tl.int64))
        grp = groups.to(tl.pointer_type(tl.int64))
        for first in range(tl.program_id(0) * D, n * per_block, tl.num_programs(0) * D):
            t = first + rows
            b = t // per_block
            ok = b < n
            dev_id = tl.load(blk + b, mask=ok, other=0).to(tl.int64)
            if SIMPLE:
                page = tl.load(blk + n + b, mask=ok, other=0).to(tl.int64)
                row = row_base + row_step * (page if BY_HOST else b.to(tl.int64))
                sub = tl.zeros_like(page)
                g = tl.zeros_like(page)
            else:
                row = tl.load(blk + n + b, mask=ok, other=0)
                sub = tl.load(blk + 2 * n + b, mask=ok, other=0)
                page = tl.load(blk + 3 * n + b, mask=ok, other=0)
                g = tl.load(blk + 4 * n + b, mask=ok, other=0)
            ok = ok & ((t % per_block) < tl.load(grp + num_groups + g, mask=ok, other=0))
            e = tl.load(grp + g, mask=ok, other=0) + t % per_block
            dev = (
                tl.load(ent + e, mask=ok, other=0)
                + dev_id * tl.load(ent + num_entries + e, mask=ok, other=0)
                + tl.load(ent + 2 * num_entries + e, mask=ok, other=0)
            )
            side = (
                row
                + tl.load(ent + 3 * num_entries + e, mask=ok, other=0)
                + sub * tl.load(ent + 4 * num_entries + e, mask=ok, other=0)
            )
            size = tl.load(ent + 5 * num_entries + e, mask=ok, other=0)
            if STORE:  # writer election: a replicated page is written by one rank
                writers = tl.load(ent + 6 * num_entries + e, mask=ok, other=1)
                size = tl.where(page % writers == tl.load(ent + 7 * num_entries + e, mask=ok, other=0), size, 0)
                src, dst = dev, side
            else:
                src, dst = side, dev
            copy_tile(src, dst, size, W)

    return expand_kernel


@functools.lru_cache(maxsize=1)
def why_unavailable() -> str | None:
    """None if the kernel can run here, else why not."""
    try:
        import triton  # noqa: F401
    except Exception as exc:
        return f"triton is not importable ({exc.__class__.__name__}: {exc})"
    return None


def _spec(value: int) -> tuple:
    """What Triton specializes an int argument on: equal to 1, divisible by 16, 32 or 64 bits."""
    return (value == 1, value % 16 == 0, -(1 << 31) <= value < (1 << 31), value < (1 << 63))


_compiled: dict = {}  # (kernel, constexprs, argument specializations) -> Triton's compiled kernel
_raw: dict = {}  # the same keys -> what `_raw_launch` found (None: not launchable by hand)
_fast = True  # False once the compiled kernel's own launcher is found unusable (another Triton)
MAX_SHARED = 49152  # above it, Triton's own loader sets the kernel up for dynamic shared memory
RAW_TYPES = ("i32", "u32", "i64", "u64")  # what a 64-bit parameter slot passes as it is


def _launch(kernel, programs: int, args: list, constexprs: dict, stream, key_args=None, device=0, warps=4) -> None:
    """Launch `kernel` on `stream`; from the second launch of a build on, through the compiled
    kernel's launcher with the stream handle, which skips Triton's dispatch and torch's stream
    context (two thirds of a launch's host time). The build is found by `_key`, of `key_args`
    where given (values that tell the build where `args` would not); `warps` is Triton's
    ``num_warps``."""
    global _fast
    key = _key(kernel, device, warps, constexprs, args if key_args is None else key_args)
    compiled = _compiled.get(key)
    if compiled is not None and _fast:
        try:
            compiled[(programs, 1, 1)](*args, *constexprs.values(), stream=stream.cuda_stream)
            return
        except (TypeError, IndexError, AttributeError):  # a Triton whose launcher differs: dispatch as usual
            _fast = False
    import torch

    with torch.cuda.stream(stream):
        _compiled[key] = kernel[(programs,)](*args, **constexprs, num_warps=warps)


def _key(kernel, device: int, warps: int, constexprs: dict, args) -> tuple:
    """What finds a compiled build: the arguments are all ints, so this covers all Triton
    specializes on; the GPU too, as a build is loaded into one GPU's context."""
    return (kernel, device, warps, *constexprs.values(), *map(_spec, args))


def _raw_launch(compiled) -> tuple | None:
    """``(function, threads, shared, kept, hidden)`` for a plain ``cuLaunchKernel`` of a
    Triton-compiled kernel: the CUfunction, threads per program, dynamic shared bytes, the
    indices of the arguments (constexprs included) that are parameters, and how many null
    scratch pointers follow them (one per scratch size the metadata names). None where it
    needs more (hooks, clusters, cooperative or dependent launches, scratch memory, large
    shared memory, parameter types a 64-bit slot does not pass as they are)."""
    try:
        md, src = compiled.metadata, compiled.src
        if (
            _hooked(compiled)
            or getattr(md, "num_ctas", 1) != 1
            or getattr(md, "launch_cooperative_grid", False)
            or getattr(md, "launch_pdl", False)
            or any(d != 1 for d in (getattr(md, "cluster_dims", None) or ()))
        ):
            return None
        hidden = 0
        for name in ("global_scratch_size", "profile_scratch_size"):
            if hasattr(md, name):
                if getattr(md, name):
                    return None
                hidden += 1
        shared = int(md.shared)
        if shared > MAX_SHARED:
            return None
        if getattr(compiled, "function", None) is None:
            compiled._init_handles()
        names = list(src.fn.arg_names)
        signature = src.signature
        constants = {
            k[0] if isinstance(k, tuple) else (names.index(k) if isinstance(k, str) else k)
            for k in getattr(src, "constants", {})
        }
        kept = []
        for i, name in enumerate(names):
            kind = signature.get(name, signature.get(i)) if isinstance(signature, dict) else None
            if kind == "constexpr" or i in constants:
                continue
            if kind not in RAW_TYPES:
                return None
            kept.append(i)
        return int(compiled.function), 32 * int(md.num_warps), shared, tuple(kept), hidden
    except Exception:  # another Triton's layout: its own launcher stays
        return None


def _hooked(compiled) -> bool:
    """Whether Triton calls launch hooks (a profiler's) around this kernel's launches, set on
    the compiled kernel (older Triton) or in ``triton.knobs.runtime`` (3.4 on)."""
    import sys

    knobs = getattr(sys.modules.get("triton"), "knobs", None)
    holders = (compiled, getattr(knobs, "runtime", None))
    hooks = [getattr(h, name, None) for h in holders for name in ("launch_enter_hook", "launch_exit_hook")]
    # a hook, or a chain of them (Triton 3.5 on: an object whose `calls` may be empty)
    return any(hook is not None and getattr(hook, "calls", True) for hook in hooks)


def expand_tile(largest: int) -> tuple[int, int, int]:
    """The expansion kernel's tile for entries of up to `largest` bytes: (items, words per step,
    warps per program). Up to 4 KiB, 256 bytes of each of 256 items on 8 warps: host rows
    written through unified addresses cross the link in whole 256-byte writes, and a program
    keeps the 64 KiB in flight that few programs need to keep the link busy. Larger entries:
    32 KiB a step on 4 warps."""
    if largest <= 4096:
        return 256, 32, 8
    if largest <= 8192:
        return 16, 256, 4
    return 8, 512, 4


def expand(
    ring,
    columns,
    n: int,
    entries: int,
    num_entries: int,
    groups: int,
    num_groups: int,
    per_block: int,
    store: bool,
    largest: int,
    stream,
    max_programs: int,
    rows: tuple[int, int, bool] | None = None,
    narrow: bool = False,
    held: list | None = None,
    device: int = 0,
) -> None:
    """Upload the block table of `n` blocks, `columns` (int64 arrays), through `ring` and enqueue
    its expansion on `stream`; `entries` and `groups` are the device addresses of the entry
    table (``ENTRY_COLUMNS``, `num_entries` wide) and of the group table (first entry, count;
    `num_groups` wide); `per_block` is the most entries of any group. `columns` None launches
    with no table (a build's warm-up). What must outlive the kernel (see `DescriptorRing.upload`)
    goes to `held` before the launch, which may fail with the upload enqueued.

    The block table is `offload_core.compact.BLOCK_COLUMNS` with the host row's address in place
    of the chunk where `rows` is None; else a simple job's device and host block ids (int32
    where `narrow`), and `rows` is ``(base, step, by_host)``: block i's host row lies at
    ``base + step * (its host block if by_host else i)``. Where the ring `launches` and the build
    allows a plain ``cuLaunchKernel``, upload and launch are one compiled call
    (`_driver.table_launch`).

    Raises:
        CudaDriverError: the upload or the launch failed.
    """
    tile, width, warps = expand_tile(largest)
    programs = max(1, min(max_programs, -(-(n * per_block) // tile)))
    base, step, by_host = (0, 0, False) if rows is None else rows
    # The table's address is the ring's for the builds' key: the kernel does not specialize on
    # it, so one build serves every table, and a 64-bit parameter takes any address.
    args = [ring.device_address(), n, entries, num_entries, groups, num_groups, per_block, base, step]
    simple = rows is not None
    narrow = simple and narrow
    constexprs = {"STORE": store, "SIMPLE": simple, "BY_HOST": by_host, "NARROW": narrow, "D": tile, "W": width}
    kernel = _compile()
    key_args = None
    if columns is not None:
        if ring.launches:
            raw = _raw_expansion(programs, args, constexprs, warps, device)
            if raw is not None:
                ring.upload_launch(columns, stream, narrow, *raw, held)
                return
        (table,) = ring.upload(columns, stream, held, narrow=narrow)
        if (table < 1 << 31) == (args[0] < 1 << 31):  # else one of 32 bits and one of 64: not the same build
            key_args = args.copy()
        args[0] = table
    _launch(kernel, programs, args, constexprs, stream, key_args, device, warps)


def _raw_expansion(programs: int, args: list, constexprs: dict, warps: int, device: int) -> tuple | None:
    """``(function, grid, threads, shared, params)`` for a plain ``cuLaunchKernel`` of the
    expansion's build of these arguments (`params` all but the table's address, which comes
    first), or None where there is none yet (the first launch of a build goes through Triton)
    or it cannot be launched so (`_raw_launch`; a ring below 2**31, whose builds take 32 bits)."""
    if args[0] < 1 << 31:
        return None
    key = _key(_compile(), device, warps, constexprs, args)
    compiled = _compiled.get(key)
    raw = None if compiled is None else _raw.get(key, False)
    if raw is False:
        raw = _raw[key] = _raw_launch(compiled)
    if raw is None or raw[3][:1] != (0,):
        return None
    function, threads, shared, kept, hidden = raw
    values = [*args, *constexprs.values()]
    return function, programs, threads, shared, [values[i] for i in kept[1:]] + [0] * hidden
