/* `Poster`: a thread that issues driver calls in the order they were posted, off the Python
 * thread (the cuda backend's posted enqueues, backends/cuda/posting.py).
 *
 * A launch's driver calls (stream waits, event records, table uploads, batched copies, kernel
 * launches) cost the Python thread that enqueues them 0.5-1 us of host time per host row of a
 * batch, and every call that lets go of the GIL hands it to another thread and back. Posted,
 * each costs a copy into this FIFO; the poster thread, current in the GPU's context, makes the
 * calls in FIFO order, so every stream sees its work in the order the Python side enqueued it.
 *
 * Each post returns a ticket (1, 2, ...); `issued` is the ticket of the last call made. A call
 * that fails is logged with the ticket of the next event record on its stream (the record
 * that brackets it; its own ticket for a record), and `failure(lo, hi)` finds such entries.
 * Only plain C runs on the poster thread, except where the driver itself is Python (the host
 * tests' stand-in libcuda): ctypes callbacks take the GIL themselves.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#include <sys/types.h>
#include <unistd.h>

#define MAX_ARGS 11
#define MAX_PARAMS 24
#define MAX_FAILURES 64 /* the oldest are dropped beyond this: a host asks about recent launches */

enum { OP_CALL = 0, OP_LAUNCH = 1 };
enum { WHAT_RECORD = 1 }; /* the `what` of event records: failures of earlier calls attach to them */

typedef int (*call_fn)(uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                       uint64_t, uint64_t);
typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                         void **, void **);
typedef int (*ctx_in_fn)(void *);
typedef int (*ctx_out_fn)(void **);

typedef struct {
    int kind, what, nparams;
    uint64_t stream;
    void *fn;
    uint64_t a[MAX_ARGS];           /* OP_CALL: the arguments; OP_LAUNCH: function, grid, block, shared */
    uint64_t params[MAX_PARAMS];    /* OP_LAUNCH: each parameter's value, read in place by the driver */
} Op;

typedef struct {
    uint64_t ticket, stream;
    int code, what;
} Failure;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t work, room, done;
    pthread_t thread;
    int started, stop, sleeping, waiting;
    Op *ops;
    size_t cap, head, count; /* ops[head .. head + count) wait, modulo cap */
    uint64_t posted, issued;
    void *context, *push, *pop;
    int push_code;
    Failure failures[MAX_FAILURES];
    size_t nfailures;
    uint64_t dropped; /* the highest ticket of a failure no longer kept: asked about, it fails */
    pid_t pid;        /* the creating process: a forked child has no thread, and its lock may be taken */
    /* failures waiting for the next record on their stream: few streams, so a short list */
    Failure unattached[MAX_FAILURES];
    size_t nunattached;
    unsigned long long room_waits, issue_waits;
} Poster;

static void log_failure(Poster *p, Failure f) {
    if (p->nfailures > 0 && p->failures[p->nfailures - 1].ticket == f.ticket) return; /* one a record: the first */
    if (p->nfailures == MAX_FAILURES) {
        if (p->failures[0].ticket > p->dropped) p->dropped = p->failures[0].ticket;
        memmove(p->failures, p->failures + 1, sizeof(Failure) * (MAX_FAILURES - 1));
        p->nfailures--;
    }
    p->failures[p->nfailures++] = f;
}

/* Under the lock: after op `o` (ticket `t`) returned `code`. */
static void account(Poster *p, const Op *o, uint64_t t, int code) {
    if (o->what == WHAT_RECORD) {
        /* the failures that waited for a record on this stream get its ticket */
        size_t keep = 0;
        for (size_t i = 0; i < p->nunattached; i++) {
            Failure f = p->unattached[i];
            if (f.stream == o->stream) {
                f.ticket = t;
                log_failure(p, f);
            } else {
                p->unattached[keep++] = f;
            }
        }
        p->nunattached = keep;
        if (code != 0) log_failure(p, (Failure){t, o->stream, code, o->what});
    } else if (code != 0 && o->stream != 0) { /* stream 0: event destroys, which no launch waits for */
        if (p->nunattached == MAX_FAILURES) { /* never recorded after: keep the newest */
            memmove(p->unattached, p->unattached + 1, sizeof(Failure) * (MAX_FAILURES - 1));
            p->nunattached--;
        }
        p->unattached[p->nunattached++] = (Failure){t, o->stream, code, o->what};
    }
}

static int issue(const Op *o) {
    if (o->kind == OP_CALL) {
        const uint64_t *a = o->a;
        return ((call_fn)o->fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10]);
    }
    void *args[MAX_PARAMS];
    for (int i = 0; i < o->nparams; i++) args[i] = (void *)&o->params[i]; /* an i32 is the low half: little-endian */
    const uint64_t *a = o->a;
    return ((launch_fn)o->fn)((void *)(uintptr_t)a[0], (unsigned)a[1], (unsigned)a[2], (unsigned)a[3], (unsigned)a[4],
                              (unsigned)a[5], (unsigned)a[6], (unsigned)a[7], (void *)(uintptr_t)o->stream, args, NULL);
}

static void *run(void *arg) {
    Poster *p = arg;
    int pushed = ((ctx_in_fn)p->push)(p->context);
    pthread_mutex_lock(&p->mu);
    p->push_code = pushed;
    for (;;) {
        while (p->count == 0 && !p->stop) {
            p->sleeping = 1;
            pthread_cond_wait(&p->work, &p->mu);
            p->sleeping = 0;
        }
        if (p->count == 0) break; /* stopped, and everything posted was issued */
        Op op = p->ops[p->head];
        uint64_t t = p->issued + 1;
        pthread_mutex_unlock(&p->mu);
        /* without the context every call would fail alike: say so through each */
        int code = pushed != 0 ? pushed : issue(&op);
        pthread_mutex_lock(&p->mu);
        account(p, &op, t, code);
        p->head = (p->head + 1) % p->cap;
        p->count--;
        __atomic_store_n(&p->issued, t, __ATOMIC_RELEASE);
        if (p->waiting) pthread_cond_broadcast(&p->done);
        pthread_cond_signal(&p->room);
    }
    pthread_mutex_unlock(&p->mu);
    if (pushed == 0) {
        void *popped = NULL;
        ((ctx_out_fn)p->pop)(&popped);
    }
    return NULL;
}

static uint64_t as_u64(PyObject *obj, int *bad) {
    if (obj == Py_None) return 0;
    unsigned long long v = PyLong_AsUnsignedLongLongMask(obj); /* negative ints wrap, as C's would */
    if (v == (unsigned long long)-1 && PyErr_Occurred()) *bad = 1;
    return v;
}

static void *as_address(PyObject *obj, const char *name) {
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (v == 0 || v > UINTPTR_MAX) {
        PyErr_Format(PyExc_ValueError, "Poster: %s is 0 or out of range", name);
        return NULL;
    }
    return (void *)(uintptr_t)v;
}

static PyObject *Poster_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *names[] = {"push", "pop", "context", "capacity", NULL};
    PyObject *push, *pop, *context;
    Py_ssize_t capacity = 4096;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|n", names, &push, &pop, &context, &capacity)) return NULL;
    if (capacity < 1) {
        PyErr_SetString(PyExc_ValueError, "Poster: capacity must be positive");
        return NULL;
    }
    void *push_fn = as_address(push, "push"), *pop_fn = push_fn ? as_address(pop, "pop") : NULL;
    if (pop_fn == NULL) return NULL;
    int bad = 0;
    uint64_t ctx = as_u64(context, &bad);
    if (bad) return NULL;
    Poster *p = (Poster *)type->tp_alloc(type, 0);
    if (p == NULL) return NULL;
    p->ops = PyMem_RawCalloc((size_t)capacity, sizeof(Op));
    if (p->ops == NULL) {
        Py_DECREF(p);
        return PyErr_NoMemory();
    }
    p->cap = (size_t)capacity;
    p->pid = getpid();
    p->push = push_fn, p->pop = pop_fn, p->context = (void *)(uintptr_t)ctx;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work, NULL);
    pthread_cond_init(&p->room, NULL);
    pthread_cond_init(&p->done, NULL);
    return (PyObject *)p;
}

/* Stop after everything posted is issued, and join the thread (the GIL released meanwhile). */
static void stop(Poster *p) {
    if (p->pid != getpid()) return; /* a forked child: no thread to stop, and the lock may be held */
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    if (!p->started) {
        pthread_mutex_unlock(&p->mu);
        return;
    }
    pthread_cond_signal(&p->work);
    pthread_mutex_unlock(&p->mu);
    Py_BEGIN_ALLOW_THREADS;
    pthread_join(p->thread, NULL);
    Py_END_ALLOW_THREADS;
    p->started = 0;
}

static void Poster_dealloc(Poster *p) {
    if (p->ops != NULL && p->pid == getpid()) { /* else nothing was set up, or a forked child's lock may be held */
        stop(p);
        pthread_mutex_destroy(&p->mu);
        pthread_cond_destroy(&p->work);
        pthread_cond_destroy(&p->room);
        pthread_cond_destroy(&p->done);
    }
    PyMem_RawFree(p->ops);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

/* Under the lock, with room: queue `op`; its ticket, or 0 where the poster is stopping or its
 * thread cannot start. The thread starts at the first post: a backend that never posts has none. */
static uint64_t insert(Poster *p, const Op *op) {
    if (p->stop) return 0;
    if (!p->started) {
        if (pthread_create(&p->thread, NULL, run, p) != 0) return 0;
        p->started = 1;
    }
    p->ops[(p->head + p->count) % p->cap] = *op;
    p->count++;
    uint64_t t = p->posted + 1;
    __atomic_store_n(&p->posted, t, __ATOMIC_RELEASE);
    if (p->sleeping) pthread_cond_signal(&p->work);
    return t;
}

/* Append `op`, waiting while the FIFO is full. Returns its ticket, 0 with an exception where
 * the poster was closed. The lock is never held while the GIL is taken: a thread holding the GIL
 * may be waiting for the lock. */
static uint64_t append(Poster *p, const Op *op) {
    uint64_t t = 0;
    pthread_mutex_lock(&p->mu);
    if (p->count < p->cap || p->stop) {
        t = insert(p, op);
        pthread_mutex_unlock(&p->mu);
    } else {
        pthread_mutex_unlock(&p->mu);
        Py_BEGIN_ALLOW_THREADS;
        pthread_mutex_lock(&p->mu);
        p->room_waits++;
        while (p->count == p->cap && !p->stop) pthread_cond_wait(&p->room, &p->mu);
        t = insert(p, op);
        pthread_mutex_unlock(&p->mu);
        Py_END_ALLOW_THREADS;
    }
    if (t == 0) PyErr_SetString(PyExc_RuntimeError, "Poster: closed, or its thread cannot start");
    return t;
}

/* A zeroed op of `kind`, named by the int `what`; -1 with an exception where it is not an int. */
static int start_op(Op *op, int kind, PyObject *what) {
    memset(op, 0, sizeof *op);
    op->kind = kind;
    op->what = (int)PyLong_AsLong(what);
    return op->what == -1 && PyErr_Occurred() ? -1 : 0;
}

PyDoc_STRVAR(call_doc, "call(what, stream, fn, *args) -> ticket\n\n"
                       "Post `fn(*args)` (the C function at address `fn`; at most 11 int arguments, passed\n"
                       "as 64-bit words; None for 0), on `stream` (its handle, for failures' attribution).\n"
                       "`what` names the call in failures; 1 marks an event record.");

static PyObject *Poster_call(Poster *p, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 3 || nargs > 3 + MAX_ARGS) {
        PyErr_Format(PyExc_TypeError, "call takes 3 to %d arguments (%zd given)", 3 + MAX_ARGS, nargs);
        return NULL;
    }
    Op op;
    if (start_op(&op, OP_CALL, args[0]) < 0) return NULL;
    int bad = 0;
    op.stream = as_u64(args[1], &bad);
    if (bad || (op.fn = as_address(args[2], "fn")) == NULL) return NULL;
    for (Py_ssize_t i = 3; i < nargs && !bad; i++) op.a[i - 3] = as_u64(args[i], &bad);
    if (bad) return NULL;
    uint64_t t = append(p, &op);
    return t == 0 ? NULL : PyLong_FromUnsignedLongLong(t);
}

PyDoc_STRVAR(launch_doc, "launch(what, fn, function, grid, threads, shared, stream, params) -> ticket\n\n"
                         "Post a kernel launch through cuLaunchKernel at `fn`: `function` (a CUfunction), `grid`\n"
                         "programs of `threads` threads, `shared` bytes of dynamic shared memory, on `stream`,\n"
                         "with `params` (a sequence of ints, each passed from an 8-byte slot of its own).");

static PyObject *Poster_launch(Poster *p, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_Format(PyExc_TypeError, "launch takes 8 arguments (%zd given)", nargs);
        return NULL;
    }
    Op op;
    if (start_op(&op, OP_LAUNCH, args[0]) < 0) return NULL;
    if ((op.fn = as_address(args[1], "fn")) == NULL) return NULL;
    int bad = 0;
    op.a[0] = as_u64(args[2], &bad);
    op.a[1] = as_u64(args[3], &bad), op.a[2] = 1, op.a[3] = 1;
    op.a[4] = as_u64(args[4], &bad), op.a[5] = 1, op.a[6] = 1;
    op.a[7] = as_u64(args[5], &bad);
    op.stream = as_u64(args[6], &bad);
    if (bad) return NULL;
    if (op.a[1] == 0 || op.a[1] > 0x7fffffff || op.a[4] == 0 || op.a[4] > 1024) {
        PyErr_SetString(PyExc_ValueError, "launch: grid must be 1..2**31-1 and threads 1..1024");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[7], "launch: params must be a sequence of ints");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > MAX_PARAMS) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "launch: at most %d params (%zd given)", MAX_PARAMS, n);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n && !bad; i++) op.params[i] = as_u64(PySequence_Fast_GET_ITEM(seq, i), &bad);
    Py_DECREF(seq);
    if (bad) return NULL;
    op.nparams = (int)n;
    uint64_t t = append(p, &op);
    return t == 0 ? NULL : PyLong_FromUnsignedLongLong(t);
}

PyDoc_STRVAR(wait_doc, "wait(ticket) -> None\n\nBlock (the GIL released) until the call of `ticket` was issued.");

static PyObject *Poster_wait(Poster *p, PyObject *arg) {
    unsigned long long t = PyLong_AsUnsignedLongLong(arg);
    if (t == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (__atomic_load_n(&p->issued, __ATOMIC_ACQUIRE) >= t) Py_RETURN_NONE;
    Py_BEGIN_ALLOW_THREADS;
    pthread_mutex_lock(&p->mu);
    if (t > p->posted) t = p->posted; /* nothing beyond what was posted can be waited for */
    if (p->issued < t) {
        p->issue_waits++;
        p->waiting++;
        while (p->issued < t) pthread_cond_wait(&p->done, &p->mu);
        p->waiting--;
    }
    pthread_mutex_unlock(&p->mu);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(failure_doc, "failure(lo, hi) -> (ticket, what, code) or None\n\n"
                          "The first failure logged at a ticket in [lo, hi] (see the module's comment); where\n"
                          "one no longer kept may lie there, (ticket, 0, -1).");

static PyObject *Poster_failure(Poster *p, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "failure takes 2 arguments");
        return NULL;
    }
    unsigned long long lo = PyLong_AsUnsignedLongLong(args[0]), hi = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    Failure found = {0, 0, 0, 0};
    pthread_mutex_lock(&p->mu);
    for (size_t i = 0; i < p->nfailures && found.ticket == 0; i++)
        if (p->failures[i].ticket >= lo && p->failures[i].ticket <= hi) found = p->failures[i];
    if (found.ticket == 0 && p->dropped >= lo) found = (Failure){p->dropped, 0, -1, 0};
    pthread_mutex_unlock(&p->mu);
    /* built after unlocking: an allocation may collect garbage, whose finalizers post */
    if (found.ticket == 0) Py_RETURN_NONE;
    return Py_BuildValue("Kii", (unsigned long long)found.ticket, found.what, found.code);
}

static PyObject *Poster_close(Poster *p, PyObject *unused) {
    stop(p);
    Py_RETURN_NONE;
}

static PyObject *Poster_state(Poster *p, PyObject *unused) {
    pthread_mutex_lock(&p->mu);
    unsigned long long posted = p->posted, issued = p->issued, room = p->room_waits, waits = p->issue_waits;
    int context_error = p->push_code;
    pthread_mutex_unlock(&p->mu);
    return Py_BuildValue("{sKsKsKsKsi}", "posted", posted, "issued", issued, "room_waits", room, "issue_waits", waits,
                         "context_error", context_error);
}

/* Read without the lock: a stale value only makes a caller wait or look again. */
static PyObject *Poster_get_issued(Poster *p, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&p->issued, __ATOMIC_ACQUIRE));
}

static PyObject *Poster_get_posted(Poster *p, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&p->posted, __ATOMIC_ACQUIRE));
}

static PyMethodDef Poster_methods[] = {
    {"call", (PyCFunction)(void (*)(void))Poster_call, METH_FASTCALL, call_doc},
    {"launch", (PyCFunction)(void (*)(void))Poster_launch, METH_FASTCALL, launch_doc},
    {"wait", (PyCFunction)Poster_wait, METH_O, wait_doc},
    {"failure", (PyCFunction)(void (*)(void))Poster_failure, METH_FASTCALL, failure_doc},
    {"close", (PyCFunction)Poster_close, METH_NOARGS, "Issue what was posted, then stop the thread."},
    {"state", (PyCFunction)Poster_state, METH_NOARGS, "Counters: posted, issued, room_waits, issue_waits."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Poster_getset[] = {
    {"issued", (getter)Poster_get_issued, NULL, "The ticket of the last call issued.", NULL},
    {"posted", (getter)Poster_get_posted, NULL, "The ticket of the last call posted.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PosterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "offload_core._native.Poster",
    .tp_basicsize = sizeof(Poster),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Poster(push, pop, context, capacity=4096): a thread issuing posted driver calls in order,\n"
              "`context` current (made so through cuCtxPushCurrent at `push`, undone by `pop` at the end).",
    .tp_new = Poster_new,
    .tp_dealloc = (destructor)Poster_dealloc,
    .tp_methods = Poster_methods,
    .tp_getset = Poster_getset,
};

int add_poster(PyObject *module) {
    if (PyType_Ready(&PosterType) < 0) return -1;
    Py_INCREF(&PosterType);
    if (PyModule_AddObject(module, "Poster", (PyObject *)&PosterType) < 0) {
        Py_DECREF(&PosterType);
        return -1;
    }
    return 0;
}
#else
int add_poster(PyObject *module) { return 0; } /* no pthreads: launches issue their calls themselves */
#endif
