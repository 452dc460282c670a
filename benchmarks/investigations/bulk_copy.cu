// A simple job's direct copy by the Tensor Memory Accelerator's bulk copies (sm_90), for
// benchmarks/investigations/bulk_rate.py. Each of `lanes` lanes of every warp (an "issuer")
// moves its share of the pages through its own ring of D shared-memory slots: a bulk load into
// the slot (its completion counted on the slot's mbarrier), then, D/2 pages later, a bulk store
// out of it. The bytes in flight are the rings', not registers. Issuer j of a program takes its
// items j, j + issuers, ..., so a warp's lanes compute consecutive items' addresses at once
// (with one lane a warp, 2026-12-03, each issuer moved a page per ~370 ns whatever its size).
//
// Item t of a job of n blocks over `tensors` tensors is tensor t % tensors of block t / tensors:
// device page dev_base[k] + dev_id * dev_stride, host page host_base + host_id * row + k * page.
// Dynamic shared memory: every issuer's barriers (D each, the total rounded up to 128 bytes),
// then their rings (D slots of `slot` bytes each). Pages are multiples of 16 bytes, 16-byte
// aligned.
#include <cstdint>

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

struct Cursor {  // item t as (block, tensor), advanced by a fixed step without a division
    int64_t b, k;
    __device__ void advance(int64_t db, int64_t dk, int64_t tensors) {  // a step of db * tensors + dk
        b += db;
        k += dk;
        if (k >= tensors) {
            k -= tensors;
            ++b;
        }
    }
};

template <int D>
__device__ void ring_copy(const int64_t *__restrict__ table, int64_t n, const int64_t *__restrict__ dev_base,
                          int64_t dev_stride, int64_t page, int64_t tensors, int64_t host_base, int64_t row, int store,
                          int64_t slot, int lanes) {
    constexpr int L = D / 2;
    extern __shared__ __align__(128) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (lane >= lanes) return;
    const int me = warp * lanes + lane, here = warps * lanes;  // issuers in this program
    uint64_t *bars = reinterpret_cast<uint64_t *>(smem) + me * D;
    const int64_t bar_bytes = (static_cast<int64_t>(here) * D * 8 + 127) / 128 * 128;
    unsigned char *ring = smem + bar_bytes + static_cast<int64_t>(me) * D * slot;
    for (int s = 0; s < D; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bars[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    const int64_t total = n * tensors;
    const int64_t step = static_cast<int64_t>(gridDim.x) * here;
    const int64_t first = static_cast<int64_t>(blockIdx.x) * here + me;
    const int64_t mine = total > first ? (total - first + step - 1) / step : 0;
    const int64_t db = step / tensors, dk = step % tensors;
    const uint32_t bytes = static_cast<uint32_t>(page);
    Cursor in{first / tensors, first % tensors}, out = in;
    for (int64_t q = 0; q < mine + L; ++q) {
        if (q < mine) {
            const int s = static_cast<int>(q % D);
            if (q >= D) asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(D - L - 1) : "memory");
            const int64_t dev = dev_base[in.k] + table[in.b] * dev_stride;
            const int64_t host = host_base + table[n + in.b] * row + in.k * page;
            const uint32_t bar = smem_addr(&bars[s]);
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                    smem_addr(ring + s * slot)),
                "l"(store ? dev : host), "r"(bytes), "r"(bar)
                : "memory");
            in.advance(db, dk, tensors);
        }
        const int64_t r = q - L;
        if (r >= 0 && r < mine) {
            const int s = static_cast<int>(r % D);
            const uint32_t bar = smem_addr(&bars[s]), parity = static_cast<uint32_t>((r / D) & 1);
            asm volatile(
                "{\n.reg .pred p;\nwait_%=:\n"
                "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                "@!p bra wait_%=;\n}" ::"r"(bar),
                "r"(parity)
                : "memory");
            const int64_t dev = dev_base[out.k] + table[out.b] * dev_stride;
            const int64_t host = host_base + table[n + out.b] * row + out.k * page;
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(store ? host : dev),
                         "r"(smem_addr(ring + s * slot)), "r"(bytes)
                         : "memory");
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
            out.advance(db, dk, tensors);
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

#define RING(D)                                                                                                     \
    extern "C" __global__ void __launch_bounds__(256) bulk_ring_##D(                                                \
        const int64_t *table, int64_t n, const int64_t *dev_base, int64_t dev_stride, int64_t page, int64_t tensors, \
        int64_t host_base, int64_t row, int store, int64_t slot, int lanes) {                                        \
        ring_copy<D>(table, n, dev_base, dev_stride, page, tensors, host_base, row, store, slot, lanes);             \
    }
RING(2)
RING(4)
RING(8)
RING(16)
RING(32)
