/* The cuda backend's hot-path calls into the CUDA driver, made from C instead of through ctypes
 * (driver.py makes them through ctypes where this module was not built, or OFFLOAD_CORE_NATIVE=0:
 * that stays the reference and the fallback). `context_call` calls a driver entry point in a
 * given context (the backend's events, stream waits and descriptor-table uploads),
 * `table_launch` a kernel's launch with its table's upload (the expansion kernel). Every entry
 * point's address comes from driver.py, which resolves them: no CUDA header, no libcuda to link.
 * Built where a C compiler is found (setup.py, with a copy of offload_core's _arrays.c: the
 * helpers of offload_core._native); the backend works the same without it.
 *
 * Only the CPython buffer protocol is used (no numpy headers): arrays arrive as int64 buffers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int offload_int64_buffer(PyObject *obj, Py_buffer *view, int writable, const char *name); /* offload_core/_arrays.c */
int offload_arity(const char *name, Py_ssize_t nargs, Py_ssize_t least, Py_ssize_t most);

/* Driver entry points of the CUresult fn(void *...) kind, called with a context made current
 * around them (the backend's events, events.py). */
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
             "context_call(get, push, pop, fn, context, a[, b[, c[, d]]]) -> int\n\n"
             "Call the C function at address `fn` with the arguments `a` to `d` (ints, passed as\n"
             "pointers: pointers, handles, or integers of pointer size or smaller; None for null),\n"
             "`context` current in the calling thread (through the cuCtxGetCurrent, cuCtxPushCurrent\n"
             "and cuCtxPopCurrent at `get`, `push`, `pop`; pushed and popped only where another is\n"
             "current), and return its result; -code where the push failed and `fn` was not called.\n"
             "None stands for a null context or handle. The GIL is held.");

static PyObject *context_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!offload_arity("context_call", nargs, 6, 9)) return NULL;
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
    /* The GIL is held: why, beside `Driver.record_in` in driver.py */
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
    return PyLong_FromLong(code != 0 ? -(long)code : (long)result);
}

typedef int (*memcpy_fn)(uint64_t, uint64_t, size_t, void *);
typedef int (*launch_kernel_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                                void **, void **);
#define TABLE_COLUMNS 8
#define TABLE_PARAMS 24

/* What a table's upload and its kernel's launch take, as `table_launch` gets it. */
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
    if (!offload_arity("table_launch", nargs, 17, 17)) return NULL;
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
        if (offload_int64_buffer(PyTuple_GET_ITEM(cols, got), &views[got], 0, "table_launch: a column") < 0) goto done;
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

static PyMethodDef methods[] = {
    {"context_call", (PyCFunction)(void (*)(void))context_call, METH_FASTCALL, context_call_doc},
    {"table_launch", (PyCFunction)(void (*)(void))table_launch, METH_FASTCALL, table_launch_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "offload_core.backends.cuda._driver", "The cuda backend's driver calls in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__driver(void) {
    return PyModule_Create(&module);
}
