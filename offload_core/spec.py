"""What the caller describes: the device KV cache, and the blocks of one transfer.

A KV cache is a list of device tensors whose first dimension is the block index
(`KVCacheTensor`), and per KV-cache group the list of layers that read them
(`KVCacheRef`). A transfer names device blocks (`DeviceBlocks`) and host blocks
(`HostBlocks`); the worker's `CompactLayout` checks the pair and describes it by blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from offload_core.canonical import CanonicalPageMapping
from offload_core.errors import InvalidSpecError, integer, positive_int

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KVCacheTensor:
    """One device tensor of the KV cache, seen as int8 pages, one per block.

    Args:
        tensor: a device tensor whose first dimension is the block index. Each row (block) is
            contiguous; rows may lie further apart than a row is long (vLLM's strided views of
            interleaved K and V): only each row's bytes are ever copied.
        page_size_bytes: bytes of each row (the padded page; a `KVCacheRef` copies a prefix
            of it).

    Raises:
        InvalidSpecError: not a tensor, a page size that is not a positive integer, a tensor
            without blocks, rows that are not contiguous or not `page_size_bytes` long, or rows
            that overlap (a pitch below the page size).
    """

    tensor: torch.Tensor
    page_size_bytes: int

    def __post_init__(self) -> None:
        import torch

        t = self.tensor
        if not isinstance(t, torch.Tensor):
            raise InvalidSpecError(f"KVCacheTensor.tensor must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided or t.is_nested or t.is_quantized or t.device.type == "meta":
            raise InvalidSpecError(
                f"KV tensor must be a dense (strided) tensor with memory, got layout {t.layout} on {t.device}"
            )
        object.__setattr__(self, "page_size_bytes", positive_int(self.page_size_bytes, "KVCacheTensor.page_size_bytes"))
        if t.dim() < 1 or t.shape[0] < 1:
            raise InvalidSpecError(f"KV tensor needs a leading block dimension, got shape {tuple(t.shape)}")
        try:
            nbytes = t.nbytes
            t.data_ptr()
        except Exception as exc:  # dtypes without a size (bits8), tensors without storage
            raise InvalidSpecError(f"KV tensor of dtype {t.dtype} cannot be addressed as bytes: {exc}") from None
        if nbytes != t.shape[0] * self.page_size_bytes:
            raise InvalidSpecError(
                f"KV tensor of {nbytes} bytes is not {t.shape[0]} pages of page_size_bytes={self.page_size_bytes}"
            )
        if not t[0].is_contiguous():
            raise InvalidSpecError(
                f"KV tensor rows must each be contiguous (pages are copied as bytes), got strides {tuple(t.stride())}"
            )
        pitch = self.pitch_bytes
        if t.shape[0] > 1 and pitch < self.page_size_bytes:
            raise InvalidSpecError(
                f"KV tensor rows overlap: a pitch of {pitch} bytes (stride(0)={t.stride(0)}) is below "
                f"page_size_bytes={self.page_size_bytes}"
            )
        # The caller's tensor may be re-viewed later (`as_strided_`, `set_`): keep the checked geometry.
        object.__setattr__(self, "tensor", t.detach().as_strided(t.size(), t.stride(), t.storage_offset()))

    @property
    def num_blocks(self) -> int:
        return int(self.tensor.shape[0])

    @property
    def pitch_bytes(self) -> int:
        """Bytes from one block's page to the next (`page_size_bytes` for a contiguous tensor)."""
        t = self.tensor
        return int(t.stride(0)) * t.element_size() if t.shape[0] > 1 else self.page_size_bytes


@dataclass(frozen=True)
class KVCacheRef:
    """One layer's use of a KV tensor: it copies `page_size_bytes` from the start of each page.

    Args:
        tensor_idx: index into `KVCaches.tensors`.
        page_size_bytes: bytes of each page that hold data (the unpadded page).
        mapping: where this rank's page goes in the canonical (TP-independent) host page, used
            by ``OffloadWorker(..., canonical_layout=True)``; see `offload_core.canonical`.

    Raises:
        InvalidSpecError: an index or size that is not an integer, a negative index, or a
            size that is not positive.
    """

    tensor_idx: int
    page_size_bytes: int
    mapping: CanonicalPageMapping | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensor_idx", integer(self.tensor_idx, "KVCacheRef.tensor_idx", 0))
        object.__setattr__(self, "page_size_bytes", positive_int(self.page_size_bytes, "KVCacheRef.page_size_bytes"))


@dataclass(frozen=True)
class KVCaches:
    """Everything a worker transfers.

    Args:
        tensors: the device KV tensors.
        group_refs: ``group_refs[g]`` lists the refs of KV-cache group ``g``.

    Attributes:
        memory: per tensor, the first tensor over the same blocks (itself where none is): the
            same memory wrapped twice is one tensor to the checks of where copies land.

    Raises:
        InvalidSpecError: no tensors, a group without refs, a tensor (or its memory) named
            twice in one group (both refs would copy into the same host page), a ref to a
            missing tensor, a ref larger than its tensor's page, tensors on different devices,
            tensors whose rows overlap other than as the same memory, or a mapping of another
            page size.
    """

    tensors: Sequence[KVCacheTensor]
    group_refs: Sequence[Sequence[KVCacheRef]]

    def __post_init__(self) -> None:
        # Tuples: the caller's lists must not drop or swap a tensor after validation.
        object.__setattr__(self, "tensors", _tuple(self.tensors, "KVCaches.tensors"))
        groups = _tuple(self.group_refs, "KVCaches.group_refs")
        object.__setattr__(
            self, "group_refs", tuple(_tuple(g, f"KVCaches.group_refs[{i}]") for i, g in enumerate(groups))
        )
        if not self.tensors:
            raise InvalidSpecError("KVCaches needs at least one tensor")
        if not self.group_refs:
            raise InvalidSpecError("KVCaches needs at least one KV-cache group")
        for i, t in enumerate(self.tensors):
            if not isinstance(t, KVCacheTensor):
                raise InvalidSpecError(f"KVCaches.tensors[{i}] must be a KVCacheTensor, got {type(t).__name__}")
        devices = {t.tensor.device for t in self.tensors}
        if len(devices) != 1:
            raise InvalidSpecError(f"KV tensors live on several devices: {sorted(map(str, devices))}")
        object.__setattr__(self, "memory", _memory(self.tensors))
        for g, refs in enumerate(self.group_refs):
            if not refs:
                raise InvalidSpecError(f"KV-cache group {g} has no refs; every group needs at least one")
            seen: set[int] = set()
            for ref in refs:
                if not isinstance(ref, KVCacheRef):
                    raise InvalidSpecError(f"group {g}: refs must be KVCacheRef, got {type(ref).__name__}")
                if not 0 <= ref.tensor_idx < len(self.tensors):
                    raise InvalidSpecError(
                        f"group {g}: ref to tensor {ref.tensor_idx}, but there are {len(self.tensors)}"
                    )
                if self.memory[ref.tensor_idx] in seen:
                    raise InvalidSpecError(
                        f"group {g} names tensor {ref.tensor_idx} (or its memory) twice: both refs would copy "
                        f"into the same host page; list each tensor once per group"
                    )
                seen.add(self.memory[ref.tensor_idx])
                page = self.tensors[ref.tensor_idx].page_size_bytes
                if not 0 < ref.page_size_bytes <= page:
                    raise InvalidSpecError(
                        f"group {g}: ref copies {ref.page_size_bytes} bytes of tensor {ref.tensor_idx}, "
                        f"whose page is {page} bytes"
                    )
                if ref.mapping is not None and (
                    not isinstance(ref.mapping, CanonicalPageMapping)
                    or ref.mapping.local_page_size_bytes != ref.page_size_bytes
                ):
                    raise InvalidSpecError(
                        f"group {g}: ref to tensor {ref.tensor_idx} copies {ref.page_size_bytes} bytes, "
                        f"its mapping expects a CanonicalPageMapping of that local page"
                    )

    @property
    def device(self) -> torch.device:
        return self.tensors[0].tensor.device


def _memory(tensors: tuple[KVCacheTensor, ...]) -> tuple[int, ...]:
    """`KVCaches.memory`: tensors from one address with one pitch are one memory (vLLM overlays
    KV-cache groups so, their views' pages of any size); raises `InvalidSpecError` where two
    tensors' rows overlap otherwise (a copy into one would change the other's pages unseen).
    Rows one pitch apart in both, at offsets whose pages do not meet, interleave without
    overlapping (vLLM's K and V views)."""
    memory = list(range(len(tensors)))
    spans = [
        (t.tensor.data_ptr(), t.tensor.data_ptr() + (t.num_blocks - 1) * t.pitch_bytes + t.page_size_bytes, i)
        for i, t in enumerate(tensors)
    ]
    spans.sort(key=lambda span: (span[0], span[2]))  # from one address, the first tensor first
    for k, (start, end, i) in enumerate(spans):
        a = tensors[i]
        for start_b, _, j in spans[k + 1 :]:
            if start_b >= end:
                break
            b = tensors[j]
            pitch, offset = a.pitch_bytes, start_b - start
            if offset == 0 and pitch == b.pitch_bytes:  # block k of one is block k of the other
                memory[j] = memory[i]
            elif not (pitch == b.pitch_bytes and a.page_size_bytes <= offset % pitch <= pitch - b.page_size_bytes):
                raise InvalidSpecError(
                    f"KV tensors {min(i, j)} and {max(i, j)} share memory without being the same rows: a copy into "
                    "one would change the other's pages; give each tensor its own memory, or the same tensor once"
                )
    return tuple(memory)


def _tuple(values: Any, what: str) -> tuple:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidSpecError(f"{what} must be a sequence, got {values!r}")
    return tuple(values)


def _ids(values: Any, what: str) -> np.ndarray:
    """`values` as a frozen 1-D int64 array; raises InvalidSpecError for any other dtype or shape, a
    bool in a list or tuple, or raw bytes (bytes, bytearray, a memoryview of bytes) or str."""
    # The usual, an engine's int64 or int32 (vLLM's) array, in as few steps as possible.
    if type(values) is np.ndarray and values.ndim == 1 and (values.dtype is _INT64 or values.dtype is _INT32):
        return _frozen(values)
    # numpy reads bytes as uint8s
    if isinstance(values, (bytes, bytearray, str)) or (isinstance(values, memoryview) and values.format in "Bbc"):
        raise InvalidSpecError(
            f"{what} must be integers (list, numpy array or CPU tensor), got a {type(values).__name__}: "
            f"its bytes or characters are not ids"
        )
    listed = isinstance(values, (list, tuple))
    try:
        arr = np.asarray(values)
    except Exception as exc:  # e.g. a device tensor: ids must live on the host
        raise InvalidSpecError(f"{what} must be host integers (list, numpy array or CPU tensor): {exc}") from exc
    if arr.ndim != 1:
        raise InvalidSpecError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        if arr.dtype.kind not in "iu" and not listed:  # [] is float64 to numpy
            raise InvalidSpecError(f"{what} must be integers, got dtype {arr.dtype}")
        return _ZEROS[0]
    if arr.dtype.kind in "fO" and listed:
        # numpy made floats or objects of Python ints beyond int64, or of mixed numpy integer types
        ids = [integer(v, f"{what}[{i}]") for i, v in enumerate(values)]
        bad = next((v for v in ids if not -(1 << 63) <= v < (1 << 63)), None)
        if bad is not None:
            raise InvalidSpecError(f"{what} holds {bad}, beyond any block id")
        return _frozen(np.array(ids, dtype=np.int64))
    kind = arr.dtype.kind
    if listed and kind in "iub":
        at = _first_bool(values, arr)
        if at is not None:
            raise InvalidSpecError(
                f"{what} must be integers, got {values[at]!r} at position {at} (bools are not taken for integers)"
            )
    if kind not in "iu":
        raise InvalidSpecError(f"{what} must be integers, got dtype {arr.dtype}")
    if kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > np.iinfo(np.int64).max:
        raise InvalidSpecError(f"{what} holds {int(arr.max())}, beyond any block id")
    # A copy nothing can change: the caller's array may change after validation.
    return _frozen(arr.astype(np.int64, copy=False))


def _first_bool(values: list | tuple, arr: np.ndarray) -> int | None:
    """Where the first bool (Python's or numpy's) of `values` stands, or None: numpy made each a 0 or
    a 1 of `arr`. A few ids are looked at by type; more only where `arr` holds a 0 or a 1."""
    if arr.size <= _SCANNED:
        if _BOOLS.isdisjoint(map(type, values)):
            return None
        suspects: Iterable[int] = range(len(values))
    elif _MIN(arr) > 1:
        return None
    else:
        suspects = np.flatnonzero(arr <= 1).tolist()
    return next((i for i in suspects if type(values[i]) in _BOOLS), None)


@dataclass(frozen=True, init=False)
class DeviceBlocks:
    """Device side of a transfer: block ids concatenated in KV-cache group order.

    Args:
        block_ids: device block ids, group 0 first.
        group_sizes: how many ids belong to each group (0 allowed); None means one group.
        block_indices: per group, the logical index within the request of the group's
            first block; ``block_indices[g] % blocks_per_chunk`` sub-pages of the group's
            first host chunk are skipped. None means all zero.

    Raises:
        InvalidSpecError: non-integer (a bool among them, or a bytes-like object) or non-1-D ids,
            negative sizes or indices, sizes that do not add up to the number of ids, or lengths
            of sizes and indices that differ.
    """

    block_ids: np.ndarray
    group_sizes: np.ndarray
    block_indices: np.ndarray

    def __init__(self, block_ids: Any, group_sizes: Any = None, block_indices: Any = None):
        ids = _ids(block_ids, "DeviceBlocks.block_ids")
        # One group, left implicit or spelled out (as vLLM's specs do): nothing more to check
        size = ids.size if group_sizes is None else _single(group_sizes)
        index = 0 if block_indices is None else _single(block_indices)
        if size == ids.size and index is not None and 0 <= index < 1 << 63:
            indices = _ZEROS[1] if index == 0 else _one(index)
            self.__dict__.update(block_ids=ids, group_sizes=_one(ids.size), block_indices=indices)
            return
        sizes = _one(ids.size) if group_sizes is None else _ids(group_sizes, "DeviceBlocks.group_sizes")
        if block_indices is None:
            indices = _ZEROS[sizes.size] if sizes.size < len(_ZEROS) else _frozen(np.zeros(sizes.size, dtype=np.int64))
        else:
            indices = _ids(block_indices, "DeviceBlocks.block_indices")
        # A few groups: plain Python on lists is cheaper than numpy reductions here.
        size_list, index_list = sizes.tolist(), indices.tolist()
        if len(index_list) != len(size_list):
            raise InvalidSpecError(f"{len(size_list)} group sizes but {len(index_list)} block indices")
        if size_list and (min(size_list) < 0 or min(index_list) < 0):
            name, values = ("group_sizes", size_list) if min(size_list) < 0 else ("block_indices", index_list)
            g = next(i for i, v in enumerate(values) if v < 0)
            raise InvalidSpecError(f"DeviceBlocks.{name}[{g}] must be non-negative, got {values[g]}")
        if sum(size_list) != ids.size:
            raise InvalidSpecError(f"group sizes add up to {sum(size_list)}, but there are {ids.size} block ids")
        self.__dict__.update(block_ids=ids, group_sizes=sizes, block_indices=indices)

    def __eq__(self, other: object) -> bool:  # the ids, the sizes and the indices alike
        return type(other) is DeviceBlocks and all(
            np.array_equal(a, b) for a, b in zip(self._fields(), other._fields())
        )

    def __hash__(self) -> int:
        return hash(tuple(a.tobytes() for a in self._fields()))

    def _fields(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.block_ids, self.group_sizes, self.block_indices


def _frozen(array: np.ndarray) -> np.ndarray:
    """A copy of `array` (int32 widened to int64) over an immutable buffer, which numpy refuses to
    make writeable (a job reads its ids when it launches, after they were checked)."""
    if array.dtype is _INT32:
        array = array.astype(_INT64)
    return np.frombuffer(array.tobytes(), array.dtype)  # dtype by position: numpy parses keywords slower


_INT64, _INT32 = np.dtype(np.int64), np.dtype(np.int32)
_BOOLS = frozenset((bool, np.bool_))  # neither can be subclassed: a type test finds them
_SCANNED, _MIN = 48, np.minimum.reduce  # up to 48 listed ids, a scan for bools costs less than numpy's min

_ZEROS = [_frozen(np.zeros(n, dtype=np.int64)) for n in range(17)]  # shared block_indices of few groups
_ONE: dict[int, np.ndarray] = {}  # shared ``[n]`` arrays: the group_sizes and block_indices of one-group specs


def _one(n: int) -> np.ndarray:
    found = _ONE.get(n)
    if found is None:
        found = _frozen(np.array([n], dtype=np.int64))
        if n < 4096:  # the sizes and indices an engine's jobs have; larger ones are not worth keeping
            _ONE[n] = found
    return found


def _single(values: Any) -> int | None:
    """The one value of a one-element list, tuple or int64 array of plain ints, else None."""
    if type(values) in (list, tuple):
        if len(values) == 1 and type(values[0]) is int:
            return values[0]
    elif type(values) is np.ndarray and values.dtype is _INT64 and values.shape == (1,):
        return int(values[0])
    return None


@dataclass(frozen=True, init=False)
class HostBlocks:
    """Host side of a transfer: host block (chunk) ids, concatenated in group order.

    Group ``g`` consumes ``ceil((group_sizes[g] + skip_g) / blocks_per_chunk)`` ids.

    Raises:
        InvalidSpecError: non-integer (a bool among them, or a bytes-like object) or non-1-D ids.
    """

    block_ids: np.ndarray

    def __init__(self, block_ids: Any):
        object.__setattr__(self, "block_ids", _ids(block_ids, "HostBlocks.block_ids"))

    def __eq__(self, other: object) -> bool:
        return type(other) is HostBlocks and np.array_equal(self.block_ids, other.block_ids)

    def __hash__(self) -> int:
        return hash(self.block_ids.tobytes())
