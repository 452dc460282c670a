/* Compiled steps of the hot path, each the twin of a numpy function that stays the reference
 * and the fallback: `single_check` does what `CompactLayout._job_single` does (a submit's checks,
 * offload_core/compact.py), `concat` what `CompactJob.concat` does (jobs
 * joined for one launch), `first_clash` what `queue._first_clash` does (which waiting jobs may
 * share a launch, offload_core/queue.py), `host_order` what `CompactJob.in_host_order` does (a
 * launch's blocks in host order), `row_runs` what `compact._row_runs` does (a job's
 * host-contiguous runs, for a backend's choice of mechanism). Helpers shared with a backend's
 * own compiled module are in _arrays.c.
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
int offload_int64_buffer(PyObject *obj, Py_buffer *view, int writable, const char *name); /* _arrays.c */
int offload_arity(const char *name, Py_ssize_t nargs, Py_ssize_t least, Py_ssize_t most);

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
    if (offload_int64_buffer(dev_ids, &dev, 0, "dev_ids") < 0) return -1;
    if (offload_int64_buffer(host_ids, &host, 0, "host_ids") < 0) {
        PyBuffer_Release(&dev);
        return -1;
    }
    const int64_t *d = dev.buf, *h = host.buf;
    Py_ssize_t n = dev.len / 8;
    int fit = 0;
    const int64_t *unique = unique_dev ? d : h, *other = unique_dev ? h : d;
    int64_t unique_limit = unique_dev ? dev_limit : host_limit, other_limit = unique_dev ? host_limit : dev_limit;
    if (n > 0 && host.len == dev.len && !any_outside(other, n, other_limit)) {
        int bad = any_outside(unique, n, unique_limit) ? 1 : has_duplicates(unique, n, unique_limit);
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
    if (!offload_arity("single_check", nargs, 5, 5)) return NULL;
    int64_t dev_limit, host_limit;
    if (as_limit(args[2], &dev_limit) < 0 || as_limit(args[3], &host_limit) < 0) return NULL;
    int unique_dev = PyObject_IsTrue(args[4]);
    if (unique_dev < 0) return NULL;
    int fit = single_fit(args[0], args[1], dev_limit, host_limit, unique_dev);
    if (fit < 0) return NULL;
    return PyBool_FromLong(fit);
}

PyDoc_STRVAR(first_clash_doc,
             "first_clash(keys, limit) -> int\n\n"
             "How many of consecutive jobs may go in one launch, given each job's destination keys\n"
             "(a sequence of int64 arrays, in job order) and a bound on them: the index of the first\n"
             "job holding a key that an earlier job holds, or len(keys). A job may repeat its own keys.\n"
             "Keys lie in [0, limit) (ValueError otherwise) where the keys number at least limit / 64;\n"
             "then a bitmap of limit bits holds the earlier jobs' keys, else a hash table does.");

/* The bitmap's way: the earlier jobs' keys as bits; each job is looked up whole, then added. */
static Py_ssize_t clash_by_bitmap(PyObject **items, Py_ssize_t jobs, int64_t limit) {
    uint64_t *seen = calloc(((size_t)limit + 63) / 64, sizeof(uint64_t));
    if (seen == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t answer = jobs;
    Py_buffer view;
    for (Py_ssize_t i = 0; i < jobs && answer == jobs; i++) {
        if (offload_int64_buffer(items[i], &view, 0, "keys") < 0) { /* cannot happen: checked before */
            answer = -1;
            break;
        }
        const uint64_t *k = view.buf;
        Py_ssize_t n = view.len / 8;
        for (Py_ssize_t j = 0; j < n; j++) {
            if (k[j] >= (uint64_t)limit) { /* a negative key too */
                PyErr_Format(PyExc_ValueError, "key %lld of job %zd lies outside [0, %lld)", (long long)k[j], i,
                             (long long)limit);
                answer = -1;
                break;
            }
            if (i && (seen[k[j] >> 6] >> (k[j] & 63)) & 1) {
                answer = i;
                break;
            }
        }
        if (answer == jobs)
            for (Py_ssize_t j = 0; j < n; j++) seen[k[j] >> 6] |= 1ull << (k[j] & 63);
        PyBuffer_Release(&view);
    }
    free(seen);
    return answer;
}

/* The hash table's way: key -> the job that first held it, open addressing over at least
 * 2 x total slots; an owner of -1 marks an empty slot (any int64 may be a key). */
static Py_ssize_t clash_by_hash(PyObject **items, Py_ssize_t jobs, Py_ssize_t total) {
    size_t slots = 2;
    int bits = 1;
    while (slots < 2 * (size_t)total) slots <<= 1, bits++;
    int64_t *keys = malloc(slots * sizeof(int64_t));
    Py_ssize_t *owners = malloc(slots * sizeof(Py_ssize_t));
    if (keys == NULL || owners == NULL) {
        free(keys);
        free(owners);
        PyErr_NoMemory();
        return -1;
    }
    memset(owners, 0xff, slots * sizeof(Py_ssize_t));
    Py_ssize_t answer = jobs;
    Py_buffer view;
    for (Py_ssize_t i = 0; i < jobs && answer == jobs; i++) {
        if (offload_int64_buffer(items[i], &view, 0, "keys") < 0) { /* cannot happen: checked before */
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
    return answer;
}

static PyObject *first_clash(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!offload_arity("first_clash", nargs, 2, 2)) return NULL;
    int64_t limit = PyLong_AsLongLong(args[1]);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    PyObject *seq = PySequence_Fast(args[0], "keys must be a sequence of int64 arrays");
    if (seq == NULL) return NULL;
    Py_ssize_t jobs = PySequence_Fast_GET_SIZE(seq), total = 0, answer = jobs;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_buffer view;
    for (Py_ssize_t i = 0; i < jobs; i++) {
        if (offload_int64_buffer(items[i], &view, 0, "keys") < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        total += view.len / 8;
        PyBuffer_Release(&view);
    }
    if (jobs >= 2 && total > PY_SSIZE_T_MAX / 64) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    /* A bitmap costs limit / 8 bytes cleared, a hash table 32 bytes a key and cache misses: with a
     * key for every 64 bits or fewer, the bitmap (as `queue._first_clash` chooses for numpy). */
    if (jobs >= 2)
        answer = limit > 0 && (uint64_t)limit <= 64 * (uint64_t)total ? clash_by_bitmap(items, jobs, limit)
                                                                       : clash_by_hash(items, jobs, total);
    Py_DECREF(seq);
    return answer < 0 ? NULL : PyLong_FromSsize_t(answer);
}

PyDoc_STRVAR(concat_doc,
             "concat(blocks, host_ids, out_blocks, out_host_ids) -> None\n\n"
             "Consecutive jobs as one: their block tables (int64, 5 x n each, C order) side by side\n"
             "in `out_blocks` (5 x the n's total), the chunk row (1) of each shifted by the host ids\n"
             "of the jobs before it, and their host ids one after another in `out_host_ids`.");

static PyObject *concat(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!offload_arity("concat", nargs, 4, 4)) return NULL;
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
        if (offload_int64_buffer(PySequence_Fast_GET_ITEM(tables, i), &view, 0, "blocks") < 0) goto done;
        int table = view.ndim == 2 && view.shape[0] == 5;
        Py_ssize_t n = view.len / 40;
        PyBuffer_Release(&view);
        if (!table) {
            PyErr_SetString(PyExc_ValueError, "each block table must be 5 x n");
            goto done;
        }
        if (offload_int64_buffer(PySequence_Fast_GET_ITEM(hosts, i), &view, 0, "host_ids") < 0) goto done;
        Py_ssize_t c = view.len / 8;
        PyBuffer_Release(&view);
        if (n > PY_SSIZE_T_MAX / 40 - blocks || c > PY_SSIZE_T_MAX / 8 - chunks) {
            PyErr_NoMemory();
            goto done;
        }
        blocks += n;
        chunks += c;
    }
    if (offload_int64_buffer(args[2], &out, 1, "out_blocks") < 0) goto done;
    have_out = 1;
    if (offload_int64_buffer(args[3], &out_hosts, 1, "out_host_ids") < 0) goto done;
    have_hosts = 1;
    if (out.len != blocks * 40 || out_hosts.len != chunks * 8) {
        PyErr_SetString(PyExc_ValueError, "the outputs must hold 5 x the blocks, and the host ids, of all jobs");
        goto done;
    }
    int64_t *o = out.buf, *oh = out_hosts.buf;
    Py_ssize_t at = 0, chunk = 0;
    for (Py_ssize_t i = 0; i < jobs; i++) {
        if (offload_int64_buffer(PySequence_Fast_GET_ITEM(tables, i), &view, 0, "blocks") < 0) goto done;
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
        if (offload_int64_buffer(PySequence_Fast_GET_ITEM(hosts, i), &view, 0, "host_ids") < 0) goto done;
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

PyDoc_STRVAR(host_order_doc,
             "host_order(hosts, devs, out_hosts, out_devs) -> bool\n"
             "\n"
             "Whether putting the equal-length int64 `hosts` in ascending order (stable; `devs` moved with\n"
             "them) makes fewer runs of consecutive values (as `row_runs` counts them); if so, the sorted\n"
             "pairs are in the writable int64 arrays `out_hosts` and `out_devs` of the same length.\n"
             "Values are compared as unsigned (block ids are never negative).");

static PyObject *host_order(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!offload_arity("host_order", nargs, 4, 4)) return NULL;
    Py_buffer v[4];
    static const char *const names[] = {"hosts", "devs", "out_hosts", "out_devs"};
    int got = 0;
    PyObject *result = NULL;
    uint64_t *tmp = NULL;
    for (; got < 4; got++)
        if (offload_int64_buffer(args[got], &v[got], got >= 2, names[got]) < 0) goto done;
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

PyDoc_STRVAR(row_runs_doc,
             "row_runs(hosts, short) -> (runs, rows_in_short_runs)\n\n"
             "Runs of consecutive values in `hosts` (int64: a run continues where a value is the one\n"
             "before plus 1), and how many values the runs of at most `short` values hold.");

static PyObject *row_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!offload_arity("row_runs", nargs, 2, 2)) return NULL;
    int64_t shortest;
    if (as_limit(args[1], &shortest) < 0) return NULL; /* saturates: no run is longer */
    Py_buffer view;
    if (offload_int64_buffer(args[0], &view, 0, "hosts") < 0) return NULL;
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

static PyMethodDef methods[] = {
    {"concat", (PyCFunction)(void (*)(void))concat, METH_FASTCALL, concat_doc},
    {"first_clash", (PyCFunction)(void (*)(void))first_clash, METH_FASTCALL, first_clash_doc},
    {"host_order", (PyCFunction)(void (*)(void))host_order, METH_FASTCALL, host_order_doc},
    {"row_runs", (PyCFunction)(void (*)(void))row_runs, METH_FASTCALL, row_runs_doc},
    {"single_check", (PyCFunction)(void (*)(void))single_check, METH_FASTCALL, single_check_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "offload_core._native", "Compiled steps of offload-core's hot path.", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
