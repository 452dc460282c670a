/* `frozen(buffer)`: a read-only copy of a large spec's ids (`layout._frozen`), in memory reused
 * from earlier copies; `frozen_widened(buffer)` the same of int32 ids (vLLM's), as int64, in one
 * pass instead of numpy's `astype` and then the copy.
 *
 * A spec keeps a private copy of its ids, which lives until its job has launched. A fresh copy
 * of a million ids (8 MB) costs its page faults on top of the memcpy: about 2.5 ms against 0.3
 * on the CI-class CPU, every job, since the copies of the jobs in flight are all still alive
 * and malloc hands out new pages. So the memory of a copy that dies goes to a small pool, and
 * the next copy of about that size takes it, its pages already mapped. The pool holds at most
 * POOL_SLOTS buffers and POOL_BYTES in all; it is touched only with the GIL held (the module
 * declares no free-threading support, so the interpreter keeps the GIL for it).
 *
 * The copy exports a read-only buffer and refuses a writable one, so numpy cannot make an
 * array over it writeable (what a `bytes` object gave before). A large copy is spread over a
 * few threads (_spread.c).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#define HUGE_PAGE ((size_t)2 << 20)
#define POOL_SLOTS 8
#define POOL_BYTES ((size_t)64 << 20)

typedef struct {
    PyObject_HEAD
    char *data;
    Py_ssize_t len;
    size_t cap;
} Frozen;

int offload_parts(Py_ssize_t n); /* _spread.c */
void offload_spread(Py_ssize_t n, int parts, void (*fn)(void *, Py_ssize_t, Py_ssize_t, int), void *ctx);

static struct {
    char *data;
    size_t cap;
} pool[POOL_SLOTS];
static size_t pooled_bytes;

/* A buffer of at least `len` bytes: the smallest pooled one that is not more than twice what
 * is asked, else a new one, in whole huge pages from one on (Linux is asked to back it with
 * them). */
static char *take(size_t len, size_t *cap) {
    int best = -1;
    for (int i = 0; i < POOL_SLOTS; i++)
        if (pool[i].data != NULL && pool[i].cap >= len && pool[i].cap / 2 <= len &&
            (best < 0 || pool[i].cap < pool[best].cap))
            best = i;
    if (best >= 0) {
        char *data = pool[best].data;
        *cap = pool[best].cap;
        pooled_bytes -= pool[best].cap;
        pool[best].data = NULL;
        return data;
    }
    if (len < HUGE_PAGE) { /* specs send 4 MiB and more; smaller buffers are not pooled */
        *cap = len;
        return malloc(len);
    }
    *cap = (len + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
    void *data = NULL;
    if (posix_memalign(&data, HUGE_PAGE, *cap) != 0) return NULL;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    (void)madvise(data, *cap, MADV_HUGEPAGE); /* advice: may be ignored */
#endif
    return data;
}

/* The largest pooled buffer's slot, or -1 where the pool is empty. */
static int largest(void) {
    int k = -1;
    for (int i = 0; i < POOL_SLOTS; i++)
        if (pool[i].data != NULL && (k < 0 || pool[i].cap > pool[k].cap)) k = i;
    return k;
}

/* Into the pool, the largest pooled buffers freed while it would pass POOL_BYTES or has no
 * free slot. */
static void give_back(char *data, size_t cap) {
    if (cap < HUGE_PAGE || cap > POOL_BYTES) {
        free(data);
        return;
    }
    int slot = -1;
    for (int i = 0; i < POOL_SLOTS && slot < 0; i++)
        if (pool[i].data == NULL) slot = i;
    while (pooled_bytes + cap > POOL_BYTES || slot < 0) {
        int k = largest();
        free(pool[k].data);
        pooled_bytes -= pool[k].cap;
        pool[k].data = NULL;
        if (slot < 0) slot = k;
    }
    pool[slot].data = data;
    pool[slot].cap = cap;
    pooled_bytes += cap;
}

static void frozen_dealloc(Frozen *self) {
    if (self->data != NULL) give_back(self->data, self->cap);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Read-only: PyBuffer_FillInfo refuses a request for a writable buffer. */
static int frozen_getbuffer(Frozen *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, self->data, self->len, 1, flags);
}

static PyBufferProcs frozen_buffer = {(getbufferproc)frozen_getbuffer, NULL};

static PyTypeObject FrozenType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "offload_core._native.Frozen",
    .tp_basicsize = sizeof(Frozen),
    .tp_dealloc = (destructor)frozen_dealloc,
    .tp_as_buffer = &frozen_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The read-only bytes of a `frozen` copy (buffer protocol only).",
};

const char offload_frozen_doc[] = "frozen(buffer) -> Frozen\n\n"
                                  "The bytes of a C-contiguous buffer, copied into a read-only buffer object whose\n"
                                  "memory comes from a small pool of earlier copies' (already mapped: no page faults)\n"
                                  "where one fits, else from new memory (huge-page-aligned from 2 MiB).";

/* A copy's source and destination, bytes or int32 values widened to int64 (`spread` parts). */
typedef struct {
    const void *from;
    void *to;
} Copy;

static void copy_part(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int part) {
    const Copy *c = ctx;
    memcpy((char *)c->to + lo, (const char *)c->from + lo, (size_t)(hi - lo));
}

static void widen_part(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int part) {
    const Copy *c = ctx;
    const int32_t *in = c->from;
    int64_t *wide = c->to;
    for (Py_ssize_t i = lo; i < hi; i++) wide[i] = in[i];
}

PyObject *offload_frozen(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Frozen *out = PyObject_New(Frozen, &FrozenType);
    if (out != NULL) {
        out->len = view.len;
        out->data = take(view.len > 0 ? (size_t)view.len : 1, &out->cap);
        if (out->data == NULL) {
            Py_DECREF(out);
            out = (Frozen *)PyErr_NoMemory();
        } else {
            Copy c = {view.buf, out->data};
            offload_spread(view.len, offload_parts(view.len / 8), copy_part, &c);
        }
    }
    PyBuffer_Release(&view);
    return (PyObject *)out;
}

const char offload_frozen_widened_doc[] =
    "frozen_widened(buffer) -> Frozen\n\n"
    "`frozen` of a C-contiguous int32 buffer's values as int64 (what `astype(int64).tobytes()` gives,\n"
    "in one pass: vLLM's specs hold int32 ids). Raises TypeError for a buffer of another type.";

/* Whether `view` holds native int32 values (numpy's format for them: "i", or "l" where long has
 * 32 bits; "=" or "@" before it). */
static int int32_format(const Py_buffer *view) {
    const char *f = view->format;
    if (f == NULL || view->itemsize != 4) return 0;
    if (*f == '=' || *f == '@') f++;
    return (f[0] == 'i' || (f[0] == 'l' && sizeof(long) == 4)) && f[1] == '\0';
}

PyObject *offload_frozen_widened(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    Frozen *out = NULL;
    if (!int32_format(&view)) {
        PyErr_Format(PyExc_TypeError, "frozen_widened takes int32 values, got format %s",
                     view.format != NULL ? view.format : "(none)");
        goto done;
    }
    Py_ssize_t n = view.len / 4;
    if ((out = PyObject_New(Frozen, &FrozenType)) == NULL) goto done;
    out->len = n * 8;
    out->data = take(n > 0 ? (size_t)n * 8 : 1, &out->cap);
    if (out->data == NULL) {
        Py_DECREF(out);
        out = (Frozen *)PyErr_NoMemory();
        goto done;
    }
    Copy c = {view.buf, out->data};
    offload_spread(n, offload_parts(n), widen_part, &c);
done:
    PyBuffer_Release(&view);
    return (PyObject *)out;
}

int add_frozen(PyObject *module) {
    if (PyType_Ready(&FrozenType) < 0) return -1;
    Py_INCREF(&FrozenType);
    if (PyModule_AddObject(module, "Frozen", (PyObject *)&FrozenType) < 0) {
        Py_DECREF(&FrozenType);
        return -1;
    }
    return 0;
}
