/* Compiled steps of the hot path, each the twin of a numpy function that stays the reference
 * and the fallback: `single_check` does what `CompactLayout._job_single` does (a submit's checks,
 * offload_core/compact.py), `concat` what `CompactJob.concat` does (jobs
 * joined for one launch), `first_clash` what `queue._first_clash` does (which waiting jobs may
 * share a launch, offload_core/queue.py), `host_order` what `CompactJob.in_host_order` does (a
 * launch's blocks in host order), `row_runs` what `compact._row_runs` does (a job's
 * host-contiguous runs, for the cuda backend's choice of mechanism), `frozen` (_frozen.c) what a
 * large array's `tobytes` does (`layout._frozen`, a spec's private copy of its ids), and
 * `frozen_widened` the same of int32 ids widened to int64. `context_call` calls a
 * driver entry point without ctypes, in a given context (the cuda backend's events, stream
 * waits and descriptor-table uploads), `table_launch` a kernel's launch with its table's upload
 * (the cuda backend's expansion kernel), `join_launch` the same for simple jobs joined and put in
 * host order on the way (what `CompactJob.concat` and `in_host_order` do).
 * Built where a C compiler is found (setup.py); offload_core works the same without it.
 *
 * Only the CPython buffer protocol is used (no numpy headers): arrays arrive as int64 buffers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Up to this many ids, pairwise comparison finds duplicates faster than a bitmap or a hash set. */
#define FEW 64
#define MOST_PARTS 8 /* _spread.c's: the most parts a pass is split into */

int offload_parts(Py_ssize_t n); /* _spread.c */
void offload_spread(Py_ssize_t n, int parts, void (*fn)(void *, Py_ssize_t, Py_ssize_t, int), void *ctx);

static int int64_buffer(PyObject *obj, Py_buffer *view, int writable, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    const char *f = view->format;
    int native_order = f != NULL && (strcmp(f, "q") == 0 || strcmp(f, "l") == 0 || strcmp(f, "=q") == 0 ||
                                     strcmp(f, "=l") == 0 || (PY_LITTLE_ENDIAN && (strcmp(f, "<q") == 0 || strcmp(f, "<l") == 0)));
    if (view->itemsize != 8 || !native_order) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous int64 array", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Whether a METH_FASTCALL function got `least` to `most` arguments; a TypeError naming it if not. */
static int arity(const char *name, Py_ssize_t nargs, Py_ssize_t least, Py_ssize_t most) {
    if (nargs >= least && nargs <= most) return 1;
    if (least == most)
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, least, nargs);
    else
        PyErr_Format(PyExc_TypeError, "%s takes %zd %s %zd arguments (%zd given)", name, least,
                     most == least + 1 ? "or" : "to", most, nargs);
    return 0;
}

/* Whether any id lies outside [0, limit): a negative int64 read as uint64 is above any limit.
 * Blocks of ids without a branch, which the compiler vectorizes (a million ids: 0.4 of 2 ms
 * less on the CI-class CPU), and a look at the end of each. */
static int any_outside(const int64_t *ids, Py_ssize_t n, int64_t limit) {
    if (limit <= 0) return n > 0;
    const uint64_t top = (uint64_t)limit;
    for (Py_ssize_t i = 0; i < n; i += 1024) {
        Py_ssize_t end = n - i < 1024 ? n : i + 1024;
        int bad = 0;
        for (Py_ssize_t j = i; j < end; j++) bad |= (uint64_t)ids[j] >= top;
        if (bad) return 1;
    }
    return 0;
}

/* Whether an id occurs twice; every id lies in [0, limit). -1 with an exception on no memory. */
static int has_duplicates(const int64_t *ids, Py_ssize_t n, int64_t limit) {
    if (n < 2) return 0;
    if (n <= FEW) {
        for (Py_ssize_t i = 1; i < n; i++)
            for (Py_ssize_t j = 0; j < i; j++)
                if (ids[i] == ids[j]) return 1;
        return 0;
    }
    if ((uint64_t)n * 64 >= (uint64_t)limit) { /* a bit per possible id */
        uint8_t *seen = calloc((size_t)(limit / 8) + 1, 1);
        if (seen == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        int dup = 0;
        for (Py_ssize_t i = 0; i < n && !dup; i++) {
            uint64_t id = (uint64_t)ids[i];
            uint8_t bit = (uint8_t)(1u << (id & 7));
            dup = (seen[id >> 3] & bit) != 0;
            seen[id >> 3] |= bit;
        }
        free(seen);
        return dup;
    }
    /* Few ids among many possible ones: an open-addressing set of at least 2n slots, -1 empty. */
    size_t slots = 2;
    int bits = 1;
    while (slots < 2 * (size_t)n) slots <<= 1, bits++;
    int64_t *set = malloc(slots * sizeof(int64_t));
    if (set == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(set, 0xff, slots * sizeof(int64_t));
    int dup = 0;
    for (Py_ssize_t i = 0; i < n && !dup; i++) {
        size_t k = (size_t)(((uint64_t)ids[i] * 0x9E3779B97F4A7C15ull) >> (64 - bits)); /* Fibonacci hashing */
        while (set[k] != -1 && set[k] != ids[i]) k = (k + 1) & (slots - 1);
        dup = set[k] == ids[i];
        set[k] = ids[i];
    }
    free(set);
    return dup;
}

static uint64_t popcount(uint64_t x) {
#if defined(__GNUC__) || defined(__clang__)
    return (uint64_t)__builtin_popcountll(x);
#else
    x -= (x >> 1) & 0x5555555555555555ull;
    x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
    return (((x + (x >> 4)) & 0x0F0F0F0F0F0F0F0Full) * 0x0101010101010101ull) >> 56;
#endif
}

/* One part's `outside_or_repeated` (its ids' bits in its own bitset of `words` words). */
typedef struct {
    const int64_t *ids;
    uint64_t top, *seen;
    size_t words;
    uint64_t bad[MOST_PARTS];
} Seen;

static void seen_part(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int part) {
    Seen *c = ctx;
    uint64_t *seen = c->seen + (size_t)part * c->words, bad = 0;
    const uint64_t top = c->top;
    for (Py_ssize_t i = lo; i < hi; i++) {
        uint64_t id = (uint64_t)c->ids[i], in = id < top;
        bad += 1 - in;
        id *= in;
        seen[id >> 6] |= in << (id & 63);
    }
    c->bad[part] = bad;
}

/* Whether an id lies outside [0, limit) or occurs twice, in one pass: a bit per possible id,
 * set without a branch (an id outside sets no bit, it ORs in 0, and is counted as bad), and the
 * bits counted at the end (as many as ids where none repeats). For many ids among few possible
 * ones: a million ids read once instead of twice (`any_outside`, then `has_duplicates`), about
 * 0.7 of 3 ms less on the CI-class CPU. Spread over threads (`offload_spread`) where the bitsets,
 * one per part and ORed at the end, are small against the ids. -1 with an exception on no memory. */
static int outside_or_repeated(const int64_t *ids, Py_ssize_t n, int64_t limit) {
    if (limit <= 0) return n > 0;
    Seen c = {ids, (uint64_t)limit, NULL, ((size_t)limit / 64 + 8) & ~(size_t)7, {0}};
    int parts = c.top <= 8 * (uint64_t)n ? offload_parts(n) : 1; /* a part's bitset at most its ids' bytes */
    if ((c.seen = calloc(c.words * (size_t)parts, sizeof(uint64_t))) == NULL) /* an id outside is still named as such */
        return any_outside(ids, n, limit) ? 1 : has_duplicates(ids, n, limit);
    offload_spread(n, parts, seen_part, &c);
    uint64_t bits = 0, bad = 0;
    for (int k = 0; k < parts; k++) bad += c.bad[k];
    for (size_t w = 0; w < c.words; w++) {
        uint64_t word = c.seen[w];
        for (int k = 1; k < parts; k++) word |= c.seen[(size_t)k * c.words + w];
        bits += popcount(word);
    }
    free(c.seen);
    return bad != 0 || bits != (uint64_t)n;
}

/* One part's `any_outside`. */
typedef struct {
    const int64_t *ids;
    int64_t limit;
    int bad[MOST_PARTS];
} Outside;

static void outside_part(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int part) {
    Outside *c = ctx;
    c->bad[part] = any_outside(c->ids + lo, hi - lo, c->limit);
}

/* `any_outside`, spread over threads for many ids. */
static int any_outside_spread(const int64_t *ids, Py_ssize_t n, int64_t limit) {
    Outside c = {ids, limit, {0}};
    int parts = offload_parts(n), bad = 0;
    offload_spread(n, parts, outside_part, &c);
    for (int k = 0; k < parts; k++) bad |= c.bad[k];
    return bad;
}

/* An int argument as int64: one above every int64 saturates (no id reaches it). */
static int as_limit(PyObject *obj, int64_t *out) {
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (value == -1 && PyErr_Occurred()) return -1;
    *out = overflow > 0 ? INT64_MAX : overflow < 0 ? 0 : (int64_t)value;
    return 0;
}

/* `single_check`'s rule: 1 where a one-group job of these ids may go as it is,
 * 0 where not, -1 with an exception. */
static int single_fit(PyObject *dev_ids, PyObject *host_ids, int64_t dev_limit, int64_t host_limit,
                       int unique_dev) {
    Py_buffer dev, host;
    if (int64_buffer(dev_ids, &dev, 0, "dev_ids") < 0) return -1;
    if (int64_buffer(host_ids, &host, 0, "host_ids") < 0) {
        PyBuffer_Release(&dev);
        return -1;
    }
    const int64_t *d = dev.buf, *h = host.buf;
    Py_ssize_t n = dev.len / 8;
    int fit = 0;
    const int64_t *unique = unique_dev ? d : h, *other = unique_dev ? h : d;
    int64_t unique_limit = unique_dev ? dev_limit : host_limit, other_limit = unique_dev ? host_limit : dev_limit;
    if (n > 0 && host.len == dev.len && !any_outside_spread(other, n, other_limit)) {
        int bad;
        if (n > FEW && (uint64_t)n * 64 >= (uint64_t)unique_limit)
            bad = outside_or_repeated(unique, n, unique_limit);
        else
            bad = any_outside(unique, n, unique_limit) ? 1 : has_duplicates(unique, n, unique_limit);
        fit = bad < 0 ? -1 : !bad;
    }
    PyBuffer_Release(&dev);
    PyBuffer_Release(&host);
    return fit;
}

PyDoc_STRVAR(single_check_doc,
             "single_check(dev_ids, host_ids, dev_limit, host_limit, unique_dev) -> bool\n\n"
             "Whether a one-group job may go as it is: False where the counts differ or are zero,\n"
             "an id is out of range, or the destination side (device ids if `unique_dev`, else host\n"
             "ids) repeats one.");

static PyObject *single_check(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!arity("single_check", nargs, 5, 5)) return NULL;
    int64_t dev_limit, host_limit;
    if (as_limit(args[2], &dev_limit) < 0 || as_limit(args[3], &host_limit) < 0) return NULL;
    int unique_dev = PyObject_IsTrue(args[4]);
    if (unique_dev < 0) return NULL;
    int fit = single_fit(args[0], args[1], dev_limit, host_limit, unique_dev);
    if (fit < 0) return NULL;
    return PyBool_FromLong(fit);
}

PyDoc_STRVAR(first_clash_doc,
             "first_clash(keys) -> int\n\n"
             "How many of consecutive jobs may go in one launch, given each job's destination keys\n"
             "(a sequence of int64 arrays of non-negative keys, in job order): the index of the first\n"
             "job holding a key that an earlier job holds, or len(keys). A job may repeat its own keys.");

static PyObject *first_clash(PyObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "keys must be a sequence of int64 arrays");
    if (seq == NULL) return NULL;
    Py_ssize_t jobs = PySequence_Fast_GET_SIZE(seq), total = 0, answer = jobs;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_buffer view;
    for (Py_ssize_t i = 0; i < jobs; i++) {
        if (int64_buffer(items[i], &view, 0, "keys") < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        total += view.len / 8;
        PyBuffer_Release(&view);
    }
    if (jobs < 2) {
        Py_DECREF(seq);
        return PyLong_FromSsize_t(jobs);
    }
    if (total > PY_SSIZE_T_MAX / 64) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    /* key -> the job that first held it, open addressing over at least 2 x total slots; an
     * owner of -1 marks an empty slot (any int64 may be a key) */
    size_t slots = 2;
    int bits = 1;
    while (slots < 2 * (size_t)total) slots <<= 1, bits++;
    int64_t *keys = malloc(slots * sizeof(int64_t));
    Py_ssize_t *owners = malloc(slots * sizeof(Py_ssize_t));
    if (keys == NULL || owners == NULL) {
        free(keys);
        free(owners);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    memset(owners, 0xff, slots * sizeof(Py_ssize_t));
    for (Py_ssize_t i = 0; i < jobs && answer == jobs; i++) {
        if (int64_buffer(items[i], &view, 0, "keys") < 0) { /* cannot happen: checked above */
            answer = -1;
            break;
        }
        const int64_t *k = view.buf;
        for (Py_ssize_t j = 0, n = view.len / 8; j < n; j++) {
            size_t s = (size_t)(((uint64_t)k[j] * 0x9E3779B97F4A7C15ull) >> (64 - bits));
            while (owners[s] != -1 && keys[s] != k[j]) s = (s + 1) & (slots - 1);
            if (owners[s] == -1) {
                keys[s] = k[j];
                owners[s] = i;
            } else if (owners[s] != i) {
                answer = i;
                break;
            }
        }
        PyBuffer_Release(&view);
    }
    free(keys);
    free(owners);
    Py_DECREF(seq);
    return answer < 0 ? NULL : PyLong_FromSsize_t(answer);
}

PyDoc_STRVAR(concat_doc,
             "concat(blocks, host_ids, out_blocks, out_host_ids) -> None\n\n"
             "Consecutive jobs as one: their block tables (int64, 5 x n each, C order) side by side\n"
             "in `out_blocks` (5 x the n's total), the chunk row (1) of each shifted by the host ids\n"
             "of the jobs before it, and their host ids one after another in `out_host_ids`.");

static PyObject *concat(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!arity("concat", nargs, 4, 4)) return NULL;
    PyObject *tables = PySequence_Fast(args[0], "blocks must be a sequence of int64 arrays");
    if (tables == NULL) return NULL;
    PyObject *hosts = PySequence_Fast(args[1], "host_ids must be a sequence of int64 arrays");
    if (hosts == NULL) {
        Py_DECREF(tables);
        return NULL;
    }
    Py_ssize_t jobs = PySequence_Fast_GET_SIZE(tables), blocks = 0, chunks = 0;
    PyObject *result = NULL;
    Py_buffer out, out_hosts, view;
    int have_out = 0, have_hosts = 0;
    if (PySequence_Fast_GET_SIZE(hosts) != jobs) {
        PyErr_SetString(PyExc_ValueError, "as many host id arrays as block tables, please");
        goto done;
    }
    for (Py_ssize_t i = 0; i < jobs; i++) { /* sizes first: nothing is written unless all fit */
        if (int64_buffer(PySequence_Fast_GET_ITEM(tables, i), &view, 0, "blocks") < 0) goto done;
        int table = view.ndim == 2 && view.shape[0] == 5;
        Py_ssize_t n = view.len / 40;
        PyBuffer_Release(&view);
        if (!table) {
            PyErr_SetString(PyExc_ValueError, "each block table must be 5 x n");
            goto done;
        }
        if (int64_buffer(PySequence_Fast_GET_ITEM(hosts, i), &view, 0, "host_ids") < 0) goto done;
        Py_ssize_t c = view.len / 8;
        PyBuffer_Release(&view);
        if (n > PY_SSIZE_T_MAX / 40 - blocks || c > PY_SSIZE_T_MAX / 8 - chunks) {
            PyErr_NoMemory();
            goto done;
        }
        blocks += n;
        chunks += c;
    }
    if (int64_buffer(args[2], &out, 1, "out_blocks") < 0) goto done;
    have_out = 1;
    if (int64_buffer(args[3], &out_hosts, 1, "out_host_ids") < 0) goto done;
    have_hosts = 1;
    if (out.len != blocks * 40 || out_hosts.len != chunks * 8) {
        PyErr_SetString(PyExc_ValueError, "the outputs must hold 5 x the blocks, and the host ids, of all jobs");
        goto done;
    }
    int64_t *o = out.buf, *oh = out_hosts.buf;
    Py_ssize_t at = 0, chunk = 0;
    for (Py_ssize_t i = 0; i < jobs; i++) {
        if (int64_buffer(PySequence_Fast_GET_ITEM(tables, i), &view, 0, "blocks") < 0) goto done;
        const int64_t *b = view.buf;
        Py_ssize_t n = view.len / 40;
        if (n > blocks - at) { /* an array that grew between the passes */
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_ValueError, "a block table changed size during concat");
            goto done;
        }
        for (int row = 0; row < 5; row++) memcpy(o + row * blocks + at, b + row * n, (size_t)n * 8);
        for (Py_ssize_t j = 0; j < n; j++) o[blocks + at + j] += chunk;
        PyBuffer_Release(&view);
        if (int64_buffer(PySequence_Fast_GET_ITEM(hosts, i), &view, 0, "host_ids") < 0) goto done;
        if (view.len / 8 > chunks - chunk) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_ValueError, "a host id array changed size during concat");
            goto done;
        }
        memcpy(oh + chunk, view.buf, (size_t)view.len);
        chunk += view.len / 8;
        PyBuffer_Release(&view);
        at += n;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    if (have_out) PyBuffer_Release(&out);
    if (have_hosts) PyBuffer_Release(&out_hosts);
    Py_DECREF(tables);
    Py_DECREF(hosts);
    return result;
}

/* Driver entry points of the CUresult fn(void *...) kind, called with a context made current
 * around them (the cuda backend's events; offload_core/backends/cuda/events.py). */
typedef int (*get_ctx_fn)(void **);
typedef int (*push_ctx_fn)(void *);
typedef int (*call1_fn)(void *);
typedef int (*call2_fn)(void *, void *);
typedef int (*call3_fn)(void *, void *, void *);
typedef int (*call4_fn)(void *, void *, void *, void *);

/* The arguments go as pointers: on the ABIs CUDA runs on (x86-64, aarch64), an integer
 * argument of pointer size or smaller (size_t, CUdeviceptr, unsigned int flags) travels in a
 * full register as a pointer does. */
_Static_assert(sizeof(size_t) == sizeof(void *) && sizeof(unsigned long long) == sizeof(void *),
               "context_call passes integers as pointers");

/* Make `context` current in the calling thread through `get` and `push` unless it is: returns
 * whether it was pushed (then `leave_context` pops it), with the push's CUresult in `code`. */
static int enter_context(void *get, void *push, void *context, int *code) {
    void *current = NULL;
    if (((get_ctx_fn)get)(&current) != 0) current = NULL;
    if (current == context) return 0;
    *code = ((push_ctx_fn)push)(context);
    return *code == 0;
}

/* A driver entry point's address: an int, neither 0 nor beyond a pointer; -1 with a ValueError
 * naming `who` (or the conversion's error) otherwise. */
static int entry_point(PyObject *obj, const char *who, void **out) {
    unsigned long long address = PyLong_AsUnsignedLongLong(obj);
    if (address == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    if (address == 0 || address > UINTPTR_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: a driver entry point's address is 0 or out of range", who);
        return -1;
    }
    *out = (void *)(uintptr_t)address;
    return 0;
}

static void leave_context(void *pop) {
    void *popped = NULL;
    ((get_ctx_fn)pop)(&popped);
}

PyDoc_STRVAR(context_call_doc,
             "context_call(keep_gil, get, push, pop, fn, context, a[, b[, c[, d]]]) -> int\n\n"
             "Call the C function at address `fn` with the arguments `a` to `d` (ints, passed as\n"
             "pointers: pointers, handles, or integers of pointer size or smaller; None for null),\n"
             "`context` current in the calling thread (through the cuCtxGetCurrent, cuCtxPushCurrent\n"
             "and cuCtxPopCurrent at `get`, `push`, `pop`; pushed and popped only where another is\n"
             "current), and return its result; -code where the push failed and `fn` was not called.\n"
             "None stands for a null context or handle. The GIL is released around the calls unless\n"
             "`keep_gil`.");

static PyObject *context_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!arity("context_call", nargs, 7, 10)) return NULL;
    int keep_gil = PyObject_IsTrue(args[0]);
    if (keep_gil < 0) return NULL;
    args++, nargs--;
    void *v[9];
    for (Py_ssize_t i = 0; i < nargs; i++) {
        if (i < 4) {
            if (entry_point(args[i], "context_call", &v[i]) < 0) return NULL;
        } else if (args[i] == Py_None) { /* a null context or handle, as ctypes passes None */
            v[i] = NULL;
        } else {
            v[i] = PyLong_AsVoidPtr(args[i]);
            if (v[i] == NULL && PyErr_Occurred()) return NULL;
        }
    }
    int code = 0, result = 0;
    /* keep_gil for an event's record and query, once or twice a job: letting go of the GIL
     * there handed it to the queue's launcher thread and back, 15-20 us more CPU a job at 1 MiB
     * jobs on the H200. Such a call can still wait for the device
     * where a stream's command queue is full; other threads then wait too, for as long. */
    PyThreadState *saved = keep_gil ? NULL : PyEval_SaveThread();
    int pushed = enter_context(v[0], v[1], v[4], &code);
    if (code == 0) {
        switch (nargs) {
        case 6: result = ((call1_fn)v[3])(v[5]); break;
        case 7: result = ((call2_fn)v[3])(v[5], v[6]); break;
        case 8: result = ((call3_fn)v[3])(v[5], v[6], v[7]); break;
        default: result = ((call4_fn)v[3])(v[5], v[6], v[7], v[8]); break;
        }
        if (pushed) leave_context(v[2]);
    }
    if (saved != NULL) PyEval_RestoreThread(saved);
    return PyLong_FromLong(code != 0 ? -(long)code : (long)result);
}

typedef int (*memcpy_fn)(uint64_t, uint64_t, size_t, void *);
typedef int (*launch_kernel_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                                void **, void **);
#define TABLE_COLUMNS 8
#define TABLE_PARAMS 24

/* What a table's upload and its kernel's launch take, as `table_launch` and `join_launch` get it. */
typedef struct {
    void *fn[5]; /* cuCtxGetCurrent, cuCtxPushCurrent, cuCtxPopCurrent, cuMemcpyAsync, cuLaunchKernel */
    void *context, *host, *stream, *function;
    uint64_t device;
    Py_ssize_t room;
    int narrow;
    long grid, threads, shared;
} Launch;

/* The upload of `nbytes` at `l->host` to `l->device` and the launch of `l->function` on
 * `l->stream`, in `l->context`: None, or (the call that failed, its CUresult). */
static PyObject *upload_and_launch(const Launch *l, size_t nbytes, uint64_t *values, Py_ssize_t np_) {
    void *const *fn = l->fn;
    int code = 0, pushed = enter_context(fn[0], fn[1], l->context, &code);
    const char *what = "cuCtxPushCurrent";
    if (code == 0) {
        what = "cuMemcpyAsync";
        code = ((memcpy_fn)fn[3])(l->device, (uint64_t)(uintptr_t)l->host, nbytes, l->stream);
        if (code == 0) {
            void *slots[TABLE_PARAMS];
            for (Py_ssize_t i = 0; i < np_; i++) slots[i] = &values[i]; /* an i32 is the low half: little-endian */
            what = "cuLaunchKernel";
            code = ((launch_kernel_fn)fn[4])(l->function, (unsigned)l->grid, 1, 1, (unsigned)l->threads, 1, 1,
                                             (unsigned)l->shared, l->stream, slots, NULL);
        }
        if (pushed) leave_context(fn[2]);
    }
    return code == 0 ? Py_NewRef(Py_None) : Py_BuildValue("(si)", what, code);
}

PyDoc_STRVAR(table_launch_doc,
             "table_launch(get, push, pop, memcpy, launch, context, host, device, room, columns, narrow, stream,\n"
             "             function, grid, threads, shared, params) -> None or (what, code)\n"
             "\n"
             "A kernel's launch with the upload of its table, in one call that keeps the GIL: the\n"
             "equal-length C-contiguous int64 arrays `columns` (at most 8) are written one after another\n"
             "at `host` (pinned memory of `room` bytes; as int32 where `narrow`), copied to `device` by\n"
             "cuMemcpyAsync (at `memcpy`) on `stream`, and `function` is launched by cuLaunchKernel (at\n"
             "`launch`) on `stream` with `grid` programs of `threads` threads, `shared` bytes of dynamic\n"
             "shared memory and the 64-bit parameter values `params` (at most 24; a 32-bit parameter reads\n"
             "the low half). `context` is made current as `context_call` makes it. Returns None, or the\n"
             "name of the call that failed and its CUresult (after a failed copy nothing is launched).\n"
             "Raises TypeError or ValueError, having called nothing, for arguments outside these rules.");

/* `args` 0-8 and 10-15 of `table_launch` into `l`; -1 with an exception, naming `who`, otherwise. */
static int parse_launch(const char *who, PyObject *const *args, Launch *l) {
    for (int i = 0; i < 5; i++)
        if (entry_point(args[i], who, &l->fn[i]) < 0) return -1;
    /* each conversion checked before the next: a failed one leaves an exception set */
    l->context = args[5] == Py_None ? NULL : PyLong_AsVoidPtr(args[5]);
    if (PyErr_Occurred()) return -1;
    unsigned long long host_at = PyLong_AsUnsignedLongLong(args[6]);
    if (PyErr_Occurred()) return -1;
    l->device = PyLong_AsUnsignedLongLong(args[7]);
    if (PyErr_Occurred()) return -1;
    l->room = PyLong_AsSsize_t(args[8]);
    if (PyErr_Occurred()) return -1;
    l->narrow = PyObject_IsTrue(args[10]);
    if (l->narrow < 0) return -1;
    l->stream = args[11] == Py_None ? NULL : PyLong_AsVoidPtr(args[11]);
    if (PyErr_Occurred()) return -1;
    unsigned long long function_at = PyLong_AsUnsignedLongLong(args[12]);
    if (PyErr_Occurred()) return -1;
    l->grid = PyLong_AsLong(args[13]);
    if (PyErr_Occurred()) return -1;
    l->threads = PyLong_AsLong(args[14]);
    if (PyErr_Occurred()) return -1;
    l->shared = PyLong_AsLong(args[15]);
    if (PyErr_Occurred()) return -1;
    l->host = (void *)(uintptr_t)host_at, l->function = (void *)(uintptr_t)function_at;
    if (host_at > UINTPTR_MAX || function_at > UINTPTR_MAX) l->host = l->function = NULL;
    if (l->host == NULL || l->device == 0 || l->function == NULL || l->room < 0 || l->grid < 1 || l->grid > INT32_MAX ||
        l->threads < 1 || l->threads > 1024 || l->shared < 0 || l->shared > INT32_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "%s: host, device and function must be non-null, room >= 0, 1 <= grid < 2**31, "
                     "1 <= threads <= 1024 and 0 <= shared < 2**31 (got room %zd, grid %ld, threads %ld, shared %ld)",
                     who, l->room, l->grid, l->threads, l->shared);
        return -1;
    }
    return 0;
}

/* `obj` as a tuple (a conversion runs Python code, `__index__`, which cannot shrink a tuple), or
 * NULL with a TypeError naming `who` and `what` it should hold. */
static PyObject *as_tuple(PyObject *obj, const char *who, const char *what) {
    PyObject *t = PySequence_Check(obj) ? PySequence_Tuple(obj) : NULL;
    if (t == NULL && !PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "%s: %s", who, what);
    return t;
}

/* The kernel's parameters: at most TABLE_PARAMS ints, negative ones as two's complement, as the
 * kernel reads them. -1 with an exception otherwise. */
static int parse_params(const char *who, PyObject *params, uint64_t *values, Py_ssize_t *count) {
    Py_ssize_t n = PyTuple_GET_SIZE(params);
    if (n > TABLE_PARAMS) {
        PyErr_Format(PyExc_ValueError, "%s: at most %d params (got %zd)", who, TABLE_PARAMS, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        values[i] = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(params, i));
        if (values[i] == (uint64_t)-1 && PyErr_Occurred()) return -1;
    }
    *count = n;
    return 0;
}

/* `n` int64 values at column `j` of the table at `host`: as int32 where `narrow` (the caller
 * knows every value fits: block ids checked against their counts). */
static void write_column(void *host, int narrow, Py_ssize_t j, Py_ssize_t n, const int64_t *col) {
    if (narrow) {
        int32_t *out = (int32_t *)host + j * n;
        for (Py_ssize_t i = 0; i < n; i++) out[i] = (int32_t)col[i];
    } else {
        memcpy((int64_t *)host + j * n, col, (size_t)n * 8);
    }
}

static PyObject *table_launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!arity("table_launch", nargs, 17, 17)) return NULL;
    Launch l;
    if (parse_launch("table_launch", args, &l) < 0) return NULL;
    PyObject *cols = as_tuple(args[9], "table_launch", "columns must be a sequence of int64 arrays");
    if (cols == NULL) return NULL;
    PyObject *params = as_tuple(args[16], "table_launch", "params must be a sequence of ints");
    if (params == NULL) {
        Py_DECREF(cols);
        return NULL;
    }
    Py_ssize_t k = PyTuple_GET_SIZE(cols), np_ = PyTuple_GET_SIZE(params), got = 0, n = 0;
    Py_buffer views[TABLE_COLUMNS];
    uint64_t values[TABLE_PARAMS];
    PyObject *result = NULL;
    if (k < 1 || k > TABLE_COLUMNS || np_ > TABLE_PARAMS) {
        PyErr_Format(PyExc_ValueError, "table_launch: 1 to %d columns and at most %d params (got %zd and %zd)",
                     TABLE_COLUMNS, TABLE_PARAMS, k, np_);
        goto done;
    }
    if (parse_params("table_launch", params, values, &np_) < 0) goto done;
    for (; got < k; got++) {
        if (int64_buffer(PyTuple_GET_ITEM(cols, got), &views[got], 0, "table_launch: a column") < 0) goto done;
        Py_ssize_t len = views[got].len / 8;
        if (got == 0) n = len;
        if (len != n) {
            PyErr_Format(PyExc_ValueError, "table_launch: columns must have equal lengths (%zd and %zd)", n, len);
            PyBuffer_Release(&views[got]);
            goto done;
        }
    }
    size_t nbytes = (size_t)k * (size_t)n * (l.narrow ? 4 : 8);
    if (nbytes > (size_t)l.room) {
        PyErr_Format(PyExc_ValueError, "table_launch: a table of %zu bytes does not fit the %zd reserved for it", nbytes,
                     l.room);
        goto done;
    }
    for (Py_ssize_t j = 0; j < k; j++) write_column(l.host, l.narrow, j, n, views[j].buf);
    result = upload_and_launch(&l, nbytes, values, np_);
done:
    for (Py_ssize_t j = 0; j < got; j++) PyBuffer_Release(&views[j]);
    Py_DECREF(cols);
    Py_DECREF(params);
    return result;
}

PyDoc_STRVAR(host_order_doc,
             "host_order(hosts, devs, out_hosts, out_devs) -> bool\n"
             "\n"
             "Whether putting the equal-length int64 `hosts` in ascending order (stable; `devs` moved with\n"
             "them) makes fewer runs of consecutive values (as `row_runs` counts them); if so, the sorted\n"
             "pairs are in the writable int64 arrays `out_hosts` and `out_devs` of the same length.\n"
             "Values are compared as unsigned (block ids are never negative).");

/* Runs of consecutive values: a run continues where a value is the one before plus 1. */
static Py_ssize_t runs_of(const uint64_t *h, Py_ssize_t n) {
    Py_ssize_t runs = n > 0;
    for (Py_ssize_t i = 1; i < n; i++) runs += h[i] - h[i - 1] != 1;
    return runs;
}

/* Digits of 8 bits (256 buckets) for up to SMALL_SORT ids, else of 11: the buckets' pass costs
 * about as much as the ids' there. Two passes for ids below 64K or 4M. */
#define DIGIT_BITS 11
#define SMALL_SORT 1024

/* Sort the pairs (kh[i], kd[i]) by kh in place, stably (an LSD radix sort ping-ponging with the
 * scratch th, td of n values each). */
static void sort_pairs(uint64_t *kh, uint64_t *kd, uint64_t *th, uint64_t *td, Py_ssize_t n) {
    uint64_t *const out_h = kh, *const out_d = kd;
    uint64_t top = 0;
    for (Py_ssize_t i = 0; i < n; i++) top |= kh[i];
    const int bits = n <= SMALL_SORT ? 8 : DIGIT_BITS;
    const uint64_t mask = (1u << bits) - 1;
    for (int shift = 0; shift < 64 && (top >> shift) != 0; shift += bits) {
        Py_ssize_t count[1 << DIGIT_BITS];
        memset(count, 0, sizeof(Py_ssize_t) << bits);
        for (Py_ssize_t i = 0; i < n; i++) count[(kh[i] >> shift) & mask]++;
        Py_ssize_t at = 0;
        for (int b = 0; b < (1 << bits); b++) {
            Py_ssize_t c = count[b];
            count[b] = at;
            at += c;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t to = count[(kh[i] >> shift) & mask]++;
            th[to] = kh[i];
            td[to] = kd[i];
        }
        uint64_t *swap = kh;
        kh = th, th = swap;
        swap = kd, kd = td, td = swap;
    }
    if (kh != out_h) { /* an odd number of passes: the sorted pairs are in the scratch */
        memcpy(out_h, kh, (size_t)n * 8);
        memcpy(out_d, kd, (size_t)n * 8);
    }
}

static PyObject *host_order(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!arity("host_order", nargs, 4, 4)) return NULL;
    Py_buffer v[4];
    static const char *const names[] = {"hosts", "devs", "out_hosts", "out_devs"};
    int got = 0;
    PyObject *result = NULL;
    uint64_t *tmp = NULL;
    for (; got < 4; got++)
        if (int64_buffer(args[got], &v[got], got >= 2, names[got]) < 0) goto done;
    Py_ssize_t n = v[0].len / 8;
    if (v[1].len != v[0].len || v[2].len != v[0].len || v[3].len != v[0].len) {
        PyErr_SetString(PyExc_ValueError, "host_order: hosts, devs and both outputs must have equal lengths");
        goto done;
    }
    for (int i = 0; i < 4; i++) /* each output apart from the other three buffers */
        for (int j = 2; j < 4; j++) {
            const char *a = v[i].buf, *b = v[j].buf;
            if (i != j && a < b + v[j].len && b < a + v[i].len && n > 0) {
                PyErr_SetString(PyExc_ValueError, "host_order: an output overlaps another array");
                goto done;
            }
        }
    const uint64_t *hosts = v[0].buf, *devs = v[1].buf;
    Py_ssize_t before = runs_of(hosts, n);
    if (n < 2 || before == 1) {
        result = Py_NewRef(Py_False);
        goto done;
    }
    tmp = malloc(2 * (size_t)n * sizeof(uint64_t));
    if (tmp == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(v[2].buf, hosts, (size_t)n * 8);
    memcpy(v[3].buf, devs, (size_t)n * 8);
    sort_pairs(v[2].buf, v[3].buf, tmp, tmp + n, n);
    result = PyBool_FromLong(runs_of(v[2].buf, n) < before);
done:
    free(tmp);
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    return result;
}

PyDoc_STRVAR(join_launch_doc,
             "join_launch(get, push, pop, memcpy, launch, context, host, device, room, parts, narrow, stream,\n"
             "            function, grid, threads, shared, params, order, least_runs, short[, decide])\n"
             "    -> None, (runs, rows_in_short_runs) or (what, code)\n"
             "\n"
             "`table_launch` of jobs joined into one table, as `CompactJob.concat` and `in_host_order`\n"
             "join and order them: `parts` is (devs, hosts), two sequences of as many C-contiguous int64\n"
             "arrays, the i-th of each of one length; the table is the devs joined, then the hosts joined,\n"
             "the pairs put in ascending (stable) host order where `order` and that makes fewer runs of\n"
             "consecutive hosts (as `host_order` does). Where the hosts then make fewer than `least_runs`\n"
             "runs, it counts how many hosts the runs of at most `short` hosts hold (as `row_runs` counts\n"
             "them) and calls `decide(runs, rows_in_short_runs)` where given: where that is true it goes\n"
             "on, otherwise (or with no `decide`) it returns the two counts, having called nothing (the\n"
             "hosts may be written at `host`, which is the caller's); otherwise as `table_launch`.\n"
             "Raises TypeError, ValueError or MemoryError, having called nothing, for arguments outside\n"
             "these rules, and what `decide` raises.");

/* One job's ids, where the table's columns come from (the jobs' own arrays, or their joined and
 * sorted copies). */
typedef struct {
    const uint64_t *dev, *host;
    Py_ssize_t n;
} Part;

/* Host i of the parts joined (0 <= i < their total). */
static uint64_t host_at(const Part *p, Py_ssize_t i) {
    while (i >= p->n) i -= p->n, p++;
    return p->host[i];
}

/* One part of a pass over rows [lo, hi) of the joined parts: runs of consecutive hosts that start
 * there (a row starts one where it is the first or its host is not the one before plus 1), and
 * how their lengths fall, for `parts_runs` to join with the parts before and after: the length of
 * the first segment (up to the first start after lo, or hi), whether lo itself starts a run,
 * whether one starts after lo, and if so the hosts of the runs wholly between those starts that
 * are at most `shortest` long, and the last segment's length. Where `out` is given, the hosts'
 * column of the table there is written on the same pass. */
typedef struct {
    Py_ssize_t starts, head, inner, tail;
    int lo_starts, split;
} Runs;

typedef struct {
    const Part *p;
    Py_ssize_t m, n;
    long long shortest;
    void *out;
    int narrow;
    Runs runs[MOST_PARTS];
} RunsPass;

static void runs_part(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int part) {
    RunsPass *c = ctx;
    Runs r = {0, 0, 0, 0, lo == 0, 0};
    Py_ssize_t last = lo; /* where the segment under way began */
    uint64_t prev = lo > 0 ? host_at(c->p, lo - 1) : 0;
    for (Py_ssize_t k = 0, at = 0; k < c->m && at < hi; at += c->p[k].n, k++) {
        Py_ssize_t from = lo > at ? lo - at : 0, to = hi - at < c->p[k].n ? hi - at : c->p[k].n;
        if (from >= to) continue;
        const uint64_t *h = c->p[k].host;
        int32_t *o32 = c->out == NULL ? NULL : (int32_t *)c->out + c->n + at;
        uint64_t *o64 = c->out == NULL ? NULL : (uint64_t *)c->out + c->n + at;
        for (Py_ssize_t i = from; i < to; i++) {
            if (c->out != NULL) {
                if (c->narrow)
                    o32[i] = (int32_t)h[i];
                else
                    o64[i] = h[i];
            }
            Py_ssize_t row = at + i;
            if (row == 0 || h[i] - prev != 1) {
                r.starts++;
                if (row == lo) {
                    r.lo_starts = 1;
                } else {
                    if (!r.split)
                        r.head = row - last, r.split = 1;
                    else if (row - last <= c->shortest)
                        r.inner += row - last;
                    last = row;
                }
            }
            prev = h[i];
        }
    }
    if (r.split)
        r.tail = hi - last;
    else
        r.head = hi - lo;
    c->runs[part] = r;
}

/* Runs of consecutive hosts over the parts in turn, as `runs_of` counts them in the joined
 * hosts; where `in_short` is given, also how many hosts the runs of at most `shortest` hold, and
 * where `out` is given, the hosts written on the same pass as column 1 of the `n`-row table there
 * (as `write_parts` writes it). The ids are memory-bound (a million are 8 MB): many of them are
 * spread over threads, each part's runs joined with its neighbours' at the end. */
static Py_ssize_t parts_runs(const Part *p, Py_ssize_t m, long long shortest, Py_ssize_t *in_short, void *out,
                             int narrow, Py_ssize_t n) {
    RunsPass c = {p, m, n, shortest, out, narrow, {{0}}};
    int parts = offload_parts(n);
    offload_spread(n, parts, runs_part, &c);
    Py_ssize_t runs = 0, held = 0, open = 0; /* open: the length of the run not yet ended */
    for (int k = 0; k < parts; k++) {
        const Runs *r = &c.runs[k];
        runs += r->starts;
        if (r->lo_starts) {
            held += open > 0 && open <= shortest ? open : 0;
            open = 0;
        }
        open += r->head;
        if (r->split) {
            held += (open <= shortest ? open : 0) + r->inner;
            open = r->tail;
        }
    }
    if (in_short != NULL) *in_short = held + (open > 0 && open <= shortest ? open : 0);
    return runs;
}

/* One part of `write_parts`: rows [lo, hi) of column `j`. */
typedef struct {
    const Part *p;
    Py_ssize_t m, n, j;
    void *out;
    int narrow, hosts;
} Column;

static void column_part(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int part) {
    const Column *c = ctx;
    for (Py_ssize_t k = 0, at = 0; k < c->m && at < hi; at += c->p[k].n, k++) {
        Py_ssize_t from = lo > at ? lo - at : 0, to = hi - at < c->p[k].n ? hi - at : c->p[k].n;
        if (from >= to) continue;
        const int64_t *col = (const int64_t *)(c->hosts ? c->p[k].host : c->p[k].dev);
        if (c->narrow) {
            int32_t *o = (int32_t *)c->out + c->j * c->n + at;
            for (Py_ssize_t i = from; i < to; i++) o[i] = (int32_t)col[i];
        } else {
            memcpy((int64_t *)c->out + c->j * c->n + at + from, col + from, (size_t)(to - from) * 8);
        }
    }
}

/* The parts' column (`host`s where `hosts`, else `dev`s) as column `j` of the table at `out`,
 * `n` rows long: int32 where `narrow`, as `write_column` writes it; many rows spread over threads. */
static void write_parts(void *out, int narrow, Py_ssize_t j, Py_ssize_t n, const Part *p, Py_ssize_t m, int hosts) {
    Column c = {p, m, n, j, out, narrow, hosts};
    offload_spread(n, offload_parts(n), column_part, &c);
}

static PyObject *join_launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    static const char who[] = "join_launch";
    if (!arity(who, nargs, 20, 21)) return NULL;
    Launch l;
    if (parse_launch(who, args, &l) < 0) return NULL;
    int order = PyObject_IsTrue(args[17]);
    if (order < 0) return NULL;
    Py_ssize_t least = PyLong_AsSsize_t(args[18]);
    if (least == -1 && PyErr_Occurred()) return NULL;
    int overflow = 0;
    long long shortest = PyLong_AsLongLongAndOverflow(args[19], &overflow); /* saturates, as row_runs' */
    if (shortest == -1 && PyErr_Occurred()) return NULL;
    if (overflow) shortest = overflow > 0 ? LLONG_MAX : -1;
    PyObject *decide = nargs > 20 && args[20] != Py_None ? args[20] : NULL;
    if (decide != NULL && !PyCallable_Check(decide)) {
        PyErr_Format(PyExc_TypeError, "%s: decide must be callable or None", who);
        return NULL;
    }
    PyObject *parts = NULL, *devs = NULL, *hosts = NULL, *params = NULL, *result = NULL;
    Py_buffer *views = NULL;
    Part *p = NULL;
    uint64_t *joined = NULL;
    Py_ssize_t m = 0, got = 0, n = 0, np_ = 0;
    uint64_t values[TABLE_PARAMS];
    if ((parts = as_tuple(args[9], who, "parts must be (devs, hosts), two sequences of int64 arrays")) == NULL) goto done;
    if (PyTuple_GET_SIZE(parts) != 2) {
        PyErr_Format(PyExc_ValueError, "%s: parts must be (devs, hosts), got %zd sequences", who, PyTuple_GET_SIZE(parts));
        goto done;
    }
    if ((devs = as_tuple(PyTuple_GET_ITEM(parts, 0), who, "devs must be a sequence of int64 arrays")) == NULL ||
        (hosts = as_tuple(PyTuple_GET_ITEM(parts, 1), who, "hosts must be a sequence of int64 arrays")) == NULL ||
        (params = as_tuple(args[16], who, "params must be a sequence of ints")) == NULL)
        goto done;
    m = PyTuple_GET_SIZE(devs);
    if (m < 1 || PyTuple_GET_SIZE(hosts) != m) {
        PyErr_Format(PyExc_ValueError, "%s: devs and hosts must hold as many arrays, at least one (got %zd and %zd)", who,
                     m, PyTuple_GET_SIZE(hosts));
        goto done;
    }
    if (parse_params(who, params, values, &np_) < 0) goto done;
    if ((views = PyMem_Malloc(2 * (size_t)m * sizeof(Py_buffer))) == NULL ||
        (p = PyMem_Malloc((size_t)m * sizeof(Part))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < 2 * m; got++) { /* devs in views[0, m), hosts in views[m, 2m) */
        PyObject *part = PyTuple_GET_ITEM(got < m ? devs : hosts, got % m);
        if (int64_buffer(part, &views[got], 0, got < m ? "join_launch: a devs array" : "join_launch: a hosts array") < 0)
            goto done;
        if (got >= m && views[got].len != views[got - m].len) {
            PyErr_Format(PyExc_ValueError, "%s: the devs and hosts of part %zd differ in length (%zd and %zd)", who,
                         got - m, views[got - m].len / 8, views[got].len / 8);
            PyBuffer_Release(&views[got]);
            goto done;
        }
        if (got < m) n += views[got].len / 8;
    }
    for (Py_ssize_t k = 0; k < m; k++) p[k] = (Part){views[k].buf, views[m + k].buf, views[k].len / 8};
    size_t nbytes = 2 * (size_t)n * (l.narrow ? 4 : 8);
    if (nbytes > (size_t)l.room) {
        PyErr_Format(PyExc_ValueError, "%s: a table of %zu bytes does not fit the %zd reserved for it", who, nbytes,
                     l.room);
        goto done;
    }
    /* The table is written from the jobs' own arrays; only a sort joins them, into a copy. As
     * given, the hosts' column is written on the pass that counts their runs (memory-bound: a
     * million ids are 8 MB), before the choice: the reserved memory is this call's either way. */
    int sorting = order && n >= 2, hosts_written = !sorting;
    Py_ssize_t in_short = -1;
    Py_ssize_t runs = sorting ? parts_runs(p, m, 0, NULL, NULL, 0, n)
                              : parts_runs(p, m, shortest, &in_short, l.host, l.narrow, n);
    if (sorting && runs > 1) {
        if ((joined = malloc(4 * (size_t)n * 8)) == NULL) { /* sorted hosts, devs, and the sort's scratch */
            PyErr_NoMemory();
            goto done;
        }
        uint64_t *sh = joined, *sd = joined + n;
        for (Py_ssize_t k = 0, at = 0; k < m; at += p[k].n, k++) {
            memcpy(sh + at, p[k].host, (size_t)p[k].n * 8);
            memcpy(sd + at, p[k].dev, (size_t)p[k].n * 8);
        }
        sort_pairs(sh, sd, sd + n, sd + 2 * n, n);
        Py_ssize_t sorted_runs = runs_of(sh, n);
        if (sorted_runs < runs) p[0] = (Part){sd, sh, n}, m = 1, runs = sorted_runs;
    }
    if (runs < least) {
        if (in_short < 0) parts_runs(p, m, shortest, &in_short, NULL, 0, n);
        int go = 0;
        if (decide != NULL) { /* the caller's cost model, on the counts: one pass over the ids, not two */
            PyObject *said = PyObject_CallFunction(decide, "nn", runs, in_short);
            if (said == NULL) goto done;
            go = PyObject_IsTrue(said);
            Py_DECREF(said);
            if (go < 0) goto done;
        }
        if (!go) {
            result = Py_BuildValue("nn", runs, in_short);
            goto done;
        }
    }
    write_parts(l.host, l.narrow, 0, n, p, m, 0);
    if (!hosts_written) write_parts(l.host, l.narrow, 1, n, p, m, 1);
    result = upload_and_launch(&l, nbytes, values, np_);
done:
    free(joined);
    for (Py_ssize_t j = 0; j < got; j++) PyBuffer_Release(&views[j]);
    PyMem_Free(views);
    PyMem_Free(p);
    Py_XDECREF(parts);
    Py_XDECREF(devs);
    Py_XDECREF(hosts);
    Py_XDECREF(params);
    return result;
}

PyDoc_STRVAR(row_runs_doc,
             "row_runs(hosts, short) -> (runs, rows_in_short_runs)\n\n"
             "Runs of consecutive values in `hosts` (int64: a run continues where a value is the one\n"
             "before plus 1), and how many values the runs of at most `short` values hold.");

static PyObject *row_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!arity("row_runs", nargs, 2, 2)) return NULL;
    int overflow = 0;
    long long shortest = PyLong_AsLongLongAndOverflow(args[1], &overflow); /* saturates: no run is longer */
    if (shortest == -1 && PyErr_Occurred()) return NULL;
    if (overflow) shortest = overflow > 0 ? LLONG_MAX : -1;
    Py_buffer view;
    if (int64_buffer(args[0], &view, 0, "hosts") < 0) return NULL;
    const int64_t *h = view.buf;
    Py_ssize_t n = view.len / 8, runs = 0, in_short = 0, start = 0;
    for (Py_ssize_t i = 1; i <= n; i++) {
        /* unsigned: a wrapped difference is a break, as numpy's wrapped one is */
        if (i == n || (uint64_t)h[i] - (uint64_t)h[i - 1] != 1) {
            runs++;
            if (i - start <= shortest) in_short += i - start;
            start = i;
        }
    }
    PyBuffer_Release(&view);
    return Py_BuildValue("nn", runs, in_short);
}

PyObject *offload_frozen(PyObject *self, PyObject *arg); /* _frozen.c */
PyObject *offload_frozen_widened(PyObject *self, PyObject *arg);
extern const char offload_frozen_doc[], offload_frozen_widened_doc[];

extern const char offload_spread_threads_doc[]; /* _spread.c */
PyObject *offload_spread_threads(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

static PyMethodDef methods[] = {
    {"concat", (PyCFunction)(void (*)(void))concat, METH_FASTCALL, concat_doc},
    {"context_call", (PyCFunction)(void (*)(void))context_call, METH_FASTCALL, context_call_doc},
    {"first_clash", first_clash, METH_O, first_clash_doc},
    {"frozen", offload_frozen, METH_O, offload_frozen_doc},
    {"frozen_widened", offload_frozen_widened, METH_O, offload_frozen_widened_doc},
    {"host_order", (PyCFunction)(void (*)(void))host_order, METH_FASTCALL, host_order_doc},
    {"join_launch", (PyCFunction)(void (*)(void))join_launch, METH_FASTCALL, join_launch_doc},
    {"row_runs", (PyCFunction)(void (*)(void))row_runs, METH_FASTCALL, row_runs_doc},
    {"single_check", (PyCFunction)(void (*)(void))single_check, METH_FASTCALL, single_check_doc},
    {"spread_threads", (PyCFunction)(void (*)(void))offload_spread_threads, METH_FASTCALL, offload_spread_threads_doc},
    {"table_launch", (PyCFunction)(void (*)(void))table_launch, METH_FASTCALL, table_launch_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "offload_core._native", "Compiled steps of offload-core's hot path.", -1, methods,
};

int add_frozen(PyObject *module); /* _frozen.c */

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && add_frozen(m) < 0) Py_CLEAR(m);
    return m;
}
