/* A simple compact job's submit in one call: `OffloadWorker._submit`, `CompactLayout._job_single`
 * and `TransferQueue.submit` (offload_core/worker.py, compact.py, queue.py) for the common
 * case, which stays their twin: the Python path is the reference, and takes every other case.
 *
 * `submit_simple` returns NotImplemented, having changed nothing, wherever the Python path would
 * do anything but queue the job at once: a spec it would refuse or plan otherwise, a region check
 * due, a lock another thread holds, a closed worker or queue, a job id in flight, back-pressure,
 * no launcher thread yet, state of an unexpected type, or a call into Python that failed before
 * any of the Python path's checks could refuse the job (it then makes the call again; anything
 * but an Exception, such as Ctrl-C, is raised instead). Past those checks, a failure is raised
 * as the Python path's would be: before the job is queued (the ready event's record) with
 * nothing changed, after it (the launch's bookkeeping) with the job queued. It holds the worker's
 * and then the queue's lock while it queues the job, in the order the worker takes them, so
 * that to other threads it is the Python path. It does not call the queue's `_event`,
 * `_burst_full` or `_ensure_launcher`, nor the layout's `job`: a test that replaces them turns
 * the compiled steps off (`OFFLOAD_CORE_NATIVE=0`).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#ifdef _WIN32
#include <process.h>
#define getpid _getpid
#else
#include <unistd.h>
#endif

/* _native.c's, shared */
int offload_single_fit(PyObject *dev_ids, PyObject *host_ids, int64_t dev_limit, int64_t host_limit,
                       int unique_dev); /* 1, 0, or -1 with an exception */
int offload_as_limit(PyObject *obj, int64_t *out);
int offload_arity(const char *name, Py_ssize_t nargs, Py_ssize_t least, Py_ssize_t most);

/* What `submit_setup` was given. */
enum { DEVICE_BLOCKS, HOST_BLOCKS, COMPACT_JOB, PENDING, QUEUE, STORE, PERF_COUNTER, MONOTONIC, GIVEN };
static PyObject *given[GIVEN];
/* CompactJob's slots, every one of which the job gets */
static const char *const JOB_SLOTS[] = {"layout", "direction", "dev_ids", "host_ids", "groups",
                                        "nbytes", "items",     "_blocks", "jobs",    "_copies"};

#define NAMES(X)                                                                                                   \
    X(_pid) X(_region) X(_next_region_check) X(_layout) X(_prepared) X(_lock) X(_closed) X(_in_flight)               \
    X(_submitting) X(_single_limit) X(host_blocks) X(_periods) X(_entry_bytes) X(_single_entries) X(block_ids)        \
    X(group_sizes) X(direction) X(backend) X(current_stream) X(new_event) X(_pending) X(max_pending) X(_launcher)    \
    X(_free_events) X(record) X(_pending_bytes) X(_ids) X(_last_submit) X(_launch_s) X(_launching) X(burst_jobs)     \
    X(burst_bytes) X(_device_idle) X(_take) X(_launched) X(notify_all) X(acquire) X(release) X(append) X(layout)     \
    X(dev_ids) X(host_ids) X(groups) X(nbytes) X(items) X(_blocks) X(jobs) X(_copies)
#define DECLARE(name) static PyObject *s_##name;
NAMES(DECLARE)

static int intern_names(void) {
#define INTERN(name) \
    if (s_##name == NULL && (s_##name = PyUnicode_InternFromString(#name)) == NULL) return -1;
    NAMES(INTERN)
    return 0;
}

PyDoc_STRVAR(submit_setup_doc,
             "submit_setup(DeviceBlocks, HostBlocks, CompactJob, Pending, TransferQueue, STORE, perf_counter,\n"
             "             monotonic) -> None\n\n"
             "The types and functions `submit_simple` works with (offload_core.worker calls it).\n"
             "Raises TypeError for anything it could not work with.");

static int slots_are(PyObject *type) {
    PyObject *slots = PyObject_GetAttrString(type, "__slots__");
    if (slots == NULL) return -1;
    PyObject *seq = PySequence_Fast(slots, "__slots__");
    Py_DECREF(slots);
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), want = sizeof(JOB_SLOTS) / sizeof(JOB_SLOTS[0]);
    int same = n == want;
    for (Py_ssize_t i = 0; same && i < n; i++) {
        const char *have = PyUnicode_Check(PySequence_Fast_GET_ITEM(seq, i))
                               ? PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i)) : NULL;
        int found = 0;
        for (Py_ssize_t j = 0; have != NULL && j < want; j++) found |= strcmp(have, JOB_SLOTS[j]) == 0;
        same = found;
    }
    Py_DECREF(seq);
    if (PyErr_Occurred()) return -1;
    return same;
}

static PyObject *submit_setup(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!offload_arity("submit_setup", nargs, GIVEN, GIVEN)) return NULL;
    for (int i = DEVICE_BLOCKS; i <= QUEUE; i++)
        if (!PyType_Check(args[i])) return PyErr_Format(PyExc_TypeError, "submit_setup: argument %d must be a type", i);
    if (!PyType_IsSubtype((PyTypeObject *)args[PENDING], &PyTuple_Type))
        return PyErr_Format(PyExc_TypeError, "submit_setup: Pending must be a tuple type");
    if (!PyCallable_Check(args[PERF_COUNTER]) || !PyCallable_Check(args[MONOTONIC]))
        return PyErr_Format(PyExc_TypeError, "submit_setup: the clocks must be callable");
    int same = slots_are(args[COMPACT_JOB]);
    if (same < 0) return NULL;
    if (!same) return PyErr_Format(PyExc_TypeError, "submit_setup: CompactJob's __slots__ are not the ones _submit.c sets");
    if (intern_names() < 0) return NULL;
    for (int i = 0; i < GIVEN; i++) {
        Py_INCREF(args[i]);
        Py_XSETREF(given[i], args[i]);
    }
    Py_RETURN_NONE;
}

/* obj.name as a C long; -1 with an exception if it is not an int. */
static long long long_attr(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    long long out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return out;
}

/* Whether obj.name is true; -1 with an exception. */
static int true_attr(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    int out = PyObject_IsTrue(v);
    Py_DECREF(v);
    return out;
}

/* A lock's acquire(False): 1 taken, 0 held elsewhere, -1 with an exception. */
static int try_lock(PyObject *lock) {
    PyObject *r = PyObject_CallMethodOneArg(lock, s_acquire, Py_False);
    if (r == NULL) return -1;
    int taken = r == Py_True;
    Py_DECREF(r);
    return taken;
}

/* An exception set aside while cleanup calls into Python, then raised again. */
typedef struct {
    PyObject *type, *value, *trace;
} Raised;

static Raised set_aside(void) {
    Raised r = {NULL, NULL, NULL};
#if PY_VERSION_HEX >= 0x030C0000
    r.value = PyErr_GetRaisedException();
#else
    PyErr_Fetch(&r.type, &r.value, &r.trace);
#endif
    return r;
}

static void raise_again(Raised r) {
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(r.value);
#else
    PyErr_Restore(r.type, r.value, r.trace);
#endif
}

/* A lock's release, keeping an exception already raised (a release cannot fail on a lock this
 * thread holds). */
static void unlock(PyObject *lock) {
    Raised raised = set_aside();
    PyObject *r = PyObject_CallMethodNoArgs(lock, s_release);
    if (r == NULL) PyErr_WriteUnraisable(lock);
    Py_XDECREF(r);
    raise_again(raised);
}

/* Where a call into Python failed before the job was queued: NotImplemented for an Exception
 * (the Python path makes the call again), NULL to raise anything else (Ctrl-C). */
static PyObject *not_queued(void) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
    PyErr_Clear();
    Py_RETURN_NOTIMPLEMENTED;
}

/* The job as `CompactJob(layout, direction, None, host_ids, groups, nbytes, items, dev_ids)`. */
static PyObject *compact_job(PyObject *layout, PyObject *direction, PyObject *dev_ids, PyObject *host_ids,
                             Py_ssize_t n, long long nbytes, long long items) {
    PyTypeObject *type = (PyTypeObject *)given[COMPACT_JOB];
    PyObject *job = type->tp_alloc(type, 0);
    if (job == NULL) return NULL;
    PyObject *groups = Py_BuildValue("((iinini))", 0, 0, n, 0, n, 0);
    PyObject *nb = PyLong_FromLongLong(nbytes), *it = PyLong_FromLongLong(items), *one = PyLong_FromLong(1);
    int bad = groups == NULL || nb == NULL || it == NULL || one == NULL ||
              PyObject_SetAttr(job, s_layout, layout) < 0 || PyObject_SetAttr(job, s_direction, direction) < 0 ||
              PyObject_SetAttr(job, s_dev_ids, dev_ids) < 0 || PyObject_SetAttr(job, s_host_ids, host_ids) < 0 ||
              PyObject_SetAttr(job, s_groups, groups) < 0 || PyObject_SetAttr(job, s_nbytes, nb) < 0 ||
              PyObject_SetAttr(job, s_items, it) < 0 || PyObject_SetAttr(job, s__blocks, Py_None) < 0 ||
              PyObject_SetAttr(job, s_jobs, one) < 0 || PyObject_SetAttr(job, s__copies, Py_None) < 0;
    Py_XDECREF(groups);
    Py_XDECREF(nb);
    Py_XDECREF(it);
    Py_XDECREF(one);
    if (bad) Py_CLEAR(job);
    return job;
}

/* The ids' checks of `_job_single`: 1 fit, 0 not (the Python path names the rule), -1 error. */
static int ids_fit(PyObject *dev_ids, PyObject *host_ids, PyObject *layout, int store, Py_ssize_t *n) {
    if ((*n = PyObject_Length(dev_ids)) < 0) return -1;
    int64_t dev_limit, host_limit;
    PyObject *a = PyObject_GetAttr(layout, s__single_limit), *b = PyObject_GetAttr(layout, s_host_blocks);
    int fit = 0;
    if (a == NULL || b == NULL)
        fit = -1;
    else if (a != Py_None && offload_as_limit(a, &dev_limit) == 0 && offload_as_limit(b, &host_limit) == 0)
        fit = offload_single_fit(dev_ids, host_ids, dev_limit, host_limit, !store);
    else if (PyErr_Occurred())
        fit = -1;
    Py_XDECREF(a);
    Py_XDECREF(b);
    return fit;
}

/* obj.name[0] as a C long long; -1 with an exception. */
static long long first_of(PyObject *obj, PyObject *name) {
    PyObject *seq = PyObject_GetAttr(obj, name);
    if (seq == NULL) return -1;
    PyObject *first = PySequence_GetItem(seq, 0);
    Py_DECREF(seq);
    if (first == NULL) return -1;
    long long out = PyLong_AsLongLong(first);
    Py_DECREF(first);
    return out;
}

/* Bytes and copies of a simple job of n blocks; 0 where a store elects writers (the Python path's). */
static int job_size(PyObject *layout, int store, Py_ssize_t n, long long *nbytes, long long *items) {
    if (store) {
        long long period = first_of(layout, s__periods);
        if (period == -1 && PyErr_Occurred()) return -1;
        if (period > 1) return 0;
    }
    long long per_block = first_of(layout, s__entry_bytes);
    if (per_block == -1 && PyErr_Occurred()) return -1;
    long long copies = long_attr(layout, s__single_entries);
    if (PyErr_Occurred()) return -1;
    *nbytes = per_block * (long long)n;
    *items = copies * (long long)n;
    return 1;
}

/* The queue's `_event()`: the pool's last event (`pool`, a list), or the backend's new one. */
static PyObject *take_event(PyObject *pool, PyObject *backend) {
    Py_ssize_t size = PyList_GET_SIZE(pool);
    if (size == 0) return PyObject_CallMethodNoArgs(backend, s_new_event);
    PyObject *event = PyList_GET_ITEM(pool, size - 1);
    Py_INCREF(event);
    if (PyList_SetSlice(pool, size - 1, size, NULL) < 0) Py_CLEAR(event);
    return event;
}

/* A clock's reading; -1.0 with an exception. */
static double seconds(PyObject *clock) {
    PyObject *t = PyObject_CallNoArgs(clock);
    if (t == NULL) return -1.0;
    double out = PyFloat_AsDouble(t);
    Py_DECREF(t);
    return out;
}

/* obj.name if it is exactly a float (`*out`) or an int (`*whole`, if whole is not NULL) that fits
 * int64: 1; 0 if it is not; -1 with an exception. */
static int number_attr(PyObject *obj, PyObject *name, double *out, long long *whole) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    int fit = 0;
    if (whole == NULL && PyFloat_CheckExact(v)) {
        *out = PyFloat_AS_DOUBLE(v);
        fit = 1;
    } else if (whole != NULL && PyLong_CheckExact(v)) {
        int overflow = 0;
        *whole = PyLong_AsLongLongAndOverflow(v, &overflow);
        fit = !overflow && !(*whole == -1 && PyErr_Occurred());
    }
    Py_DECREF(v);
    return PyErr_Occurred() ? -1 : fit;
}

/* obj.name += delta */
static int add_to(PyObject *obj, PyObject *name, long delta) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    PyObject *d = PyLong_FromLong(delta);
    PyObject *sum = d == NULL ? NULL : PyNumber_Add(v, d);
    Py_DECREF(v);
    Py_XDECREF(d);
    if (sum == NULL) return -1;
    int r = PyObject_SetAttr(obj, name, sum);
    Py_DECREF(sum);
    return r;
}

/* obj.name = value, taking the reference (NULL: the error that made it) */
static int set_number(PyObject *obj, PyObject *name, PyObject *value) {
    if (value == NULL) return -1;
    int r = PyObject_SetAttr(obj, name, value);
    Py_DECREF(value);
    return r;
}

PyDoc_STRVAR(submit_simple_doc,
             "submit_simple(worker, queue, job_id, device, host) -> None, a list or NotImplemented\n\n"
             "`OffloadWorker._submit` of a simple compact job onto `queue`, in one call: None once it is\n"
             "queued, the batch this submit must launch (`TransferQueue._take`; the worker counts it\n"
             "as a submit under way until then), or NotImplemented, with nothing changed, where the\n"
             "Python path must take it (see the file's comment).");

static PyObject *submit_simple(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!offload_arity("submit_simple", nargs, 5, 5)) return NULL;
    PyObject *worker = args[0], *queue = args[1], *job_id = args[2], *device = args[3], *host = args[4];
    if (given[0] == NULL || !PyLong_CheckExact(job_id) || (PyObject *)Py_TYPE(device) != given[DEVICE_BLOCKS] ||
        (PyObject *)Py_TYPE(host) != given[HOST_BLOCKS] || (PyObject *)Py_TYPE(queue) != given[QUEUE])
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *result = NULL, *layout = NULL, *direction = NULL, *dev_ids = NULL, *host_ids = NULL, *sizes = NULL;
    PyObject *job = NULL, *backend = NULL, *compute = NULL, *prepared = NULL, *wlock = NULL, *qlock = NULL;
    PyObject *in_flight = NULL, *pending = NULL, *pool = NULL, *ready = NULL, *item = NULL, *ids = NULL;
    PyObject *obj = NULL;
    int wlocked = 0, qlocked = 0, t;
    double last = 0, took = 0, now = 0, due = 0;
    long long jobs = 0, most_bytes = 0, waiting_bytes = 0, most = 0, nbytes = 0, items = 0;
    Py_ssize_t n = 0;

    long long pid = long_attr(worker, s__pid);
    if (pid == -1 && PyErr_Occurred()) goto not_queued;
    if (pid != (long long)getpid()) goto decline;
    if ((obj = PyObject_GetAttr(worker, s__region)) == NULL) goto not_queued;
    if (obj != Py_None) { /* a shared region: checked every so often, by the Python path */
        if ((t = number_attr(worker, s__next_region_check, &due, NULL)) <= 0) goto refused;
        if ((now = seconds(given[MONOTONIC])) == -1.0 && PyErr_Occurred()) goto not_queued;
        if (now >= due) goto decline;
    }
    if ((layout = PyObject_GetAttr(worker, s__layout)) == NULL) goto not_queued;
    if (layout == Py_None) goto decline; /* shut down */
    if ((direction = PyObject_GetAttr(queue, s_direction)) == NULL) goto not_queued;
    int store = direction == given[STORE];
    if ((sizes = PyObject_GetAttr(device, s_group_sizes)) == NULL) goto not_queued;
    Py_ssize_t groups = PyObject_Length(sizes);
    if (groups < 0) goto not_queued;
    if (groups != 1) goto decline;
    if ((dev_ids = PyObject_GetAttr(device, s_block_ids)) == NULL) goto not_queued;
    if ((host_ids = PyObject_GetAttr(host, s_block_ids)) == NULL) goto not_queued;
    if ((t = ids_fit(dev_ids, host_ids, layout, store, &n)) <= 0) goto refused;
    if ((t = job_size(layout, store, n, &nbytes, &items)) <= 0) goto refused;
    if ((job = compact_job(layout, direction, dev_ids, host_ids, n, nbytes, items)) == NULL) goto not_queued;
    if ((backend = PyObject_GetAttr(queue, s_backend)) == NULL) goto not_queued;
    if ((compute = PyObject_CallMethodNoArgs(backend, s_current_stream)) == NULL) goto not_queued;
    if ((prepared = PyObject_GetAttr(worker, s__prepared)) == NULL) goto not_queued;

    if ((wlock = PyObject_GetAttr(worker, s__lock)) == NULL) goto not_queued;
    if ((t = try_lock(wlock)) <= 0) goto refused;
    wlocked = 1;
    if ((t = true_attr(worker, s__closed)) != 0) goto refused_if_true;
    if ((in_flight = PyObject_GetAttr(worker, s__in_flight)) == NULL) goto not_queued;
    if (!PySet_CheckExact(in_flight)) goto decline;
    if ((t = PySet_Contains(in_flight, job_id)) != 0) goto refused_if_true;
    if ((qlock = PyObject_GetAttr(queue, s__lock)) == NULL) goto not_queued;
    if ((t = try_lock(qlock)) <= 0) goto refused;
    qlocked = 1;
    if ((t = true_attr(queue, s__closed)) != 0) goto refused_if_true;
    if ((pending = PyObject_GetAttr(queue, s__pending)) == NULL) goto not_queued;
    Py_ssize_t waiting = PyObject_Length(pending);
    if (waiting < 0) goto not_queued;
    if ((t = number_attr(queue, s_max_pending, NULL, &most)) <= 0) goto refused;
    if (waiting >= most) goto decline; /* back-pressure: the Python path waits */
    Py_CLEAR(obj);
    if ((obj = PyObject_GetAttr(queue, s__launcher)) == NULL) goto not_queued;
    if (obj == Py_None) goto decline; /* the Python path starts one */
    /* what the launch decision reads, of the kinds the queue keeps, before anything changes */
    if ((t = number_attr(queue, s__last_submit, &last, NULL)) <= 0) goto refused;
    if ((t = number_attr(queue, s__launch_s, &took, NULL)) <= 0) goto refused;
    if ((t = number_attr(queue, s_burst_jobs, NULL, &jobs)) <= 0) goto refused;
    if ((t = number_attr(queue, s_burst_bytes, NULL, &most_bytes)) <= 0) goto refused;
    if ((t = number_attr(queue, s__pending_bytes, NULL, &waiting_bytes)) <= 0) goto refused;
    if (waiting_bytes > LLONG_MAX - nbytes) goto decline;
    int launching = true_attr(queue, s__launching);
    if (launching < 0) goto not_queued;
    if ((pool = PyObject_GetAttr(queue, s__free_events)) == NULL) goto not_queued;
    if ((ids = PyObject_GetAttr(queue, s__ids)) == NULL) goto not_queued;
    if (!PyList_CheckExact(pool) || !PySet_CheckExact(ids)) goto decline;

    /* Every check of the Python path passed: a failure from here on is reported as its would be. */
    if ((ready = take_event(pool, backend)) == NULL) goto raise;
    Py_CLEAR(obj);
    /* recorded under the lock: per compute stream, the pending order is the recording order */
    if ((obj = PyObject_CallMethodOneArg(ready, s_record, compute)) == NULL) goto raise;
    PyObject *fields = PyTuple_Pack(5, job_id, job, prepared, ready, compute);
    PyObject *pack = fields == NULL ? NULL : PyTuple_Pack(1, fields);
    Py_XDECREF(fields);
    item = pack == NULL ? NULL : PyTuple_Type.tp_new((PyTypeObject *)given[PENDING], pack, NULL);
    Py_XDECREF(pack);
    if (item == NULL) goto raise;
    /* The launch decision (`TransferQueue._queue`'s): a burst follows the last submit closer than a
     * launch takes; this submit launches if nothing is launching and either a burst's worth
     * waits or, outside a burst, the device is idle. */
    if ((now = seconds(given[PERF_COUNTER])) == -1.0 && PyErr_Occurred()) goto raise;
    int go = 0;
    if (!launching) {
        go = waiting + 1 >= jobs || waiting_bytes + nbytes >= most_bytes;
        if (!go && !(now - last < took)) {
            Py_CLEAR(obj);
            if ((obj = PyObject_CallMethodNoArgs(queue, s__device_idle)) == NULL) goto raise;
            if ((go = PyObject_IsTrue(obj)) < 0) goto raise;
        }
    }

    /* queued from here on: what fails now is the job's to report, as on the Python path */
    if (PySet_Add(in_flight, job_id) < 0) goto raise;
    Py_CLEAR(obj);
    if ((obj = PyObject_CallMethodOneArg(pending, s_append, item)) == NULL) {
        PySet_Discard(in_flight, job_id); /* nothing queued after all */
        goto raise;
    }
    if (set_number(queue, s__pending_bytes, PyLong_FromLongLong(waiting_bytes + nbytes)) < 0) goto raise;
    if (PySet_Add(ids, job_id) < 0) goto raise;
    if (go) { /* counted as a submit under way before the jobs are taken: `shutdown` waits for it */
        if (add_to(worker, s__submitting, 1) < 0) goto raise;
        if ((result = PyObject_CallMethodNoArgs(queue, s__take)) == NULL) {
            Raised raised = set_aside();
            if (add_to(worker, s__submitting, -1) < 0) PyErr_WriteUnraisable(worker);
            raise_again(raised);
            goto raise;
        }
        goto done;
    }
    if ((now = seconds(given[PERF_COUNTER])) == -1.0 && PyErr_Occurred()) goto raise;
    if (set_number(queue, s__last_submit, PyFloat_FromDouble(now)) < 0) goto raise;
    if (waiting == 0) { /* the launcher takes it; with more, it already knows of some */
        PyObject *cond = PyObject_GetAttr(queue, s__launched);
        PyObject *r = cond == NULL ? NULL : PyObject_CallMethodNoArgs(cond, s_notify_all);
        Py_XDECREF(cond);
        if (r == NULL) goto raise;
        Py_DECREF(r);
    }
    result = Py_None;
    Py_INCREF(result);
    goto done;

refused_if_true: /* t: 1 refused, -1 an error */
    if (t > 0) goto decline;
refused: /* t: 0 refused, -1 an error */
    if (t < 0) goto not_queued;
decline:
    result = Py_NotImplemented;
    Py_INCREF(result);
    goto done;
not_queued:
    result = not_queued();
    goto done;
raise:
    result = NULL;
done:
    if (qlocked) unlock(qlock);
    if (wlocked) unlock(wlock);
    Py_XDECREF(layout);
    Py_XDECREF(direction);
    Py_XDECREF(dev_ids);
    Py_XDECREF(host_ids);
    Py_XDECREF(sizes);
    Py_XDECREF(job);
    Py_XDECREF(backend);
    Py_XDECREF(compute);
    Py_XDECREF(prepared);
    Py_XDECREF(wlock);
    Py_XDECREF(qlock);
    Py_XDECREF(in_flight);
    Py_XDECREF(pending);
    Py_XDECREF(pool);
    Py_XDECREF(ready);
    Py_XDECREF(item);
    Py_XDECREF(ids);
    Py_XDECREF(obj);
    return result;
}

static PyMethodDef submit_methods[] = {
    {"submit_setup", (PyCFunction)(void (*)(void))submit_setup, METH_FASTCALL, submit_setup_doc},
    {"submit_simple", (PyCFunction)(void (*)(void))submit_simple, METH_FASTCALL, submit_simple_doc},
    {NULL, NULL, 0, NULL},
};

int add_submit(PyObject *module) {
    if (intern_names() < 0) return -1;
    return PyModule_AddFunctions(module, submit_methods);
}
