/* A simple compact job's submit in one call: `OffloadWorker._submit`, `CompactLayout._job_single`
 * and `TransferQueue._submit_compact` (offload_core/worker.py, compact.py, queue.py) for the common
 * case, which stays their twin: the Python path is the reference, and takes every other case.
 *
 * `submit_simple` returns NotImplemented, having changed nothing, wherever the Python path would
 * do anything but queue the job at once: a spec it would refuse or plan otherwise, a region check
 * due, a lock another thread holds, a closed worker or queue, a job id in flight, back-pressure,
 * no launcher thread, or a failed call into Python before the job is queued (the Python path then
 * makes the call again and reports it its way; anything but an Exception, such as Ctrl-C, is
 * raised instead). It holds the worker's and then the queue's lock while it queues the job, in the
 * order the worker takes them, so that to other threads it is the Python path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#ifdef _WIN32
#include <process.h>
#define getpid _getpid
#else
#include <unistd.h>
#endif

/* _native.c's, shared */
int offload_single_ids_ok(const int64_t *dev, const int64_t *host, Py_ssize_t n, int64_t dev_limit,
                          int64_t host_limit, int unique_dev); /* 1, 0, or -1 with an exception */
int offload_int64_buffer(PyObject *obj, Py_buffer *view, int writable, const char *name);
int offload_as_limit(PyObject *obj, int64_t *out);

/* What `submit_setup` was given: DeviceBlocks, HostBlocks, CompactJob, the queue's _Pending,
 * Direction.STORE, time.perf_counter, time.monotonic. */
enum { DEVICE_BLOCKS, HOST_BLOCKS, COMPACT_JOB, PENDING, STORE, PERF_COUNTER, MONOTONIC, GIVEN };
static PyObject *given[GIVEN];

#define NAMES(X)                                                                                                   \
    X(_pid) X(_region) X(_next_region_check) X(_layout) X(_prepared) X(_lock) X(_closed) X(_in_flight)               \
    X(_submitting) X(_single_limit) X(host_blocks) X(_periods) X(_entry_bytes) X(_single_entries) X(block_ids)        \
    X(group_sizes) X(direction) X(backend) X(current_stream) X(new_event) X(_pending) X(max_pending) X(_launcher)    \
    X(_free_events) X(record) X(_pending_bytes) X(_ids) X(_last_submit) X(_launch_s) X(_launching) X(burst_jobs)     \
    X(burst_bytes) X(_device_idle) X(_take) X(_launched) X(notify_all) X(acquire) X(release) X(append) X(layout)     \
    X(dev_ids) X(host_ids) X(groups) X(nbytes) X(items) X(_blocks) X(jobs)
#define DECLARE(name) static PyObject *s_##name;
NAMES(DECLARE)

static int intern_names(void) {
#define INTERN(name) \
    if (s_##name == NULL && (s_##name = PyUnicode_InternFromString(#name)) == NULL) return -1;
    NAMES(INTERN)
    return 0;
}

PyDoc_STRVAR(submit_setup_doc,
             "submit_setup(DeviceBlocks, HostBlocks, CompactJob, Pending, STORE, perf_counter, monotonic) -> None\n\n"
             "The types and functions `submit_simple` works with (offload_core.worker calls it once).");

static PyObject *submit_setup(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != GIVEN) {
        PyErr_Format(PyExc_TypeError, "submit_setup takes %d arguments (%zd given)", GIVEN, nargs);
        return NULL;
    }
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

/* A lock's release, keeping an exception already raised (a release cannot fail on a lock this
 * thread holds). */
static void unlock(PyObject *lock) {
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    PyObject *r = PyObject_CallMethodNoArgs(lock, s_release);
    if (r == NULL) PyErr_WriteUnraisable(lock);
    Py_XDECREF(r);
    PyErr_Restore(type, value, trace);
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
    PyObject *groups = Py_BuildValue("((iniini))", 0, 0, n, 0, n, 0);
    PyObject *nb = PyLong_FromLongLong(nbytes), *it = PyLong_FromLongLong(items), *one = PyLong_FromLong(1);
    int bad = groups == NULL || nb == NULL || it == NULL || one == NULL ||
              PyObject_SetAttr(job, s_layout, layout) < 0 || PyObject_SetAttr(job, s_direction, direction) < 0 ||
              PyObject_SetAttr(job, s_dev_ids, dev_ids) < 0 || PyObject_SetAttr(job, s_host_ids, host_ids) < 0 ||
              PyObject_SetAttr(job, s_groups, groups) < 0 || PyObject_SetAttr(job, s_nbytes, nb) < 0 ||
              PyObject_SetAttr(job, s_items, it) < 0 || PyObject_SetAttr(job, s__blocks, Py_None) < 0 ||
              PyObject_SetAttr(job, s_jobs, one) < 0;
    Py_XDECREF(groups);
    Py_XDECREF(nb);
    Py_XDECREF(it);
    Py_XDECREF(one);
    if (bad) Py_CLEAR(job);
    return job;
}

/* The ids' checks of `_job_single`: 1 fit, 0 not (the Python path names the rule), -1 error. */
static int ids_fit(PyObject *dev_ids, PyObject *host_ids, PyObject *layout, int store, Py_ssize_t *n) {
    Py_buffer dev, host;
    if (offload_int64_buffer(dev_ids, &dev, 0, "dev_ids") < 0) return -1;
    if (offload_int64_buffer(host_ids, &host, 0, "host_ids") < 0) {
        PyBuffer_Release(&dev);
        return -1;
    }
    int fit = 0;
    *n = dev.len / 8;
    if (*n > 0 && host.len == dev.len) {
        int64_t dev_limit, host_limit;
        PyObject *a = PyObject_GetAttr(layout, s__single_limit), *b = PyObject_GetAttr(layout, s_host_blocks);
        if (a == NULL || b == NULL)
            fit = -1;
        else if (a != Py_None && offload_as_limit(a, &dev_limit) == 0 && offload_as_limit(b, &host_limit) == 0)
            fit = offload_single_ids_ok(dev.buf, host.buf, *n, dev_limit, host_limit, !store);
        else if (PyErr_Occurred())
            fit = -1;
        Py_XDECREF(a);
        Py_XDECREF(b);
    }
    PyBuffer_Release(&dev);
    PyBuffer_Release(&host);
    return fit;
}

/* Bytes and copies of a simple job of n blocks; 0 where a store elects writers (the Python path's). */
static int job_size(PyObject *layout, int store, Py_ssize_t n, long long *nbytes, long long *items) {
    if (store) {
        PyObject *periods = PyObject_GetAttr(layout, s__periods);
        if (periods == NULL) return -1;
        PyObject *first = PySequence_GetItem(periods, 0);
        Py_DECREF(periods);
        if (first == NULL) return -1;
        long long period = PyLong_AsLongLong(first);
        Py_DECREF(first);
        if (period == -1 && PyErr_Occurred()) return -1;
        if (period > 1) return 0;
    }
    PyObject *entry = PyObject_GetAttr(layout, s__entry_bytes);
    if (entry == NULL) return -1;
    PyObject *first = PySequence_GetItem(entry, 0);
    Py_DECREF(entry);
    if (first == NULL) return -1;
    long long per_block = PyLong_AsLongLong(first);
    Py_DECREF(first);
    long long copies = long_attr(layout, s__single_entries);
    if (PyErr_Occurred()) return -1;
    *nbytes = per_block * (long long)n;
    *items = copies * (long long)n;
    return 1;
}

/* The queue's `_event()`: a pooled event, or the backend's new one. */
static PyObject *take_event(PyObject *queue, PyObject *backend) {
    PyObject *pool = PyObject_GetAttr(queue, s__free_events);
    if (pool == NULL) return NULL;
    PyObject *event = NULL;
    Py_ssize_t size = PyList_Check(pool) ? PyList_GET_SIZE(pool) : -1;
    if (size > 0) {
        event = PyList_GET_ITEM(pool, size - 1);
        Py_INCREF(event);
        if (PyList_SetSlice(pool, size - 1, size, NULL) < 0) Py_CLEAR(event);
    } else {
        event = PyObject_CallMethodNoArgs(backend, s_new_event);
    }
    Py_DECREF(pool);
    return event;
}

static double seconds(PyObject *clock) {
    PyObject *t = PyObject_CallNoArgs(clock);
    if (t == NULL) return -1.0;
    double out = PyFloat_AsDouble(t);
    Py_DECREF(t);
    return out;
}

/* queue.name = value; name += delta where `add`. */
static int set_float(PyObject *obj, PyObject *name, double value) {
    PyObject *v = PyFloat_FromDouble(value);
    if (v == NULL) return -1;
    int r = PyObject_SetAttr(obj, name, v);
    Py_DECREF(v);
    return r;
}

static int add_to(PyObject *obj, PyObject *name, long long delta) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    PyObject *d = PyLong_FromLongLong(delta);
    PyObject *sum = d == NULL ? NULL : PyNumber_Add(v, d);
    Py_DECREF(v);
    Py_XDECREF(d);
    if (sum == NULL) return -1;
    int r = PyObject_SetAttr(obj, name, sum);
    Py_DECREF(sum);
    return r;
}

/* After the job is queued: whether this submit launches what waits (`_submit_compact`'s rule):
 * the batch to run (`queue._take()`), or None; NULL with an exception. */
static PyObject *launch_now(PyObject *queue, PyObject *pending) {
    double now = seconds(given[PERF_COUNTER]);
    if (now == -1.0 && PyErr_Occurred()) return NULL;
    PyObject *last = PyObject_GetAttr(queue, s__last_submit), *took = PyObject_GetAttr(queue, s__launch_s);
    double gap = last == NULL ? 0 : now - PyFloat_AsDouble(last), launch = took == NULL ? 0 : PyFloat_AsDouble(took);
    Py_XDECREF(last);
    Py_XDECREF(took);
    if (PyErr_Occurred()) return NULL;
    int launching = true_attr(queue, s__launching);
    if (launching < 0) return NULL;
    int go = 0;
    if (!launching) {
        long long jobs = long_attr(queue, s_burst_jobs), most = long_attr(queue, s_burst_bytes);
        long long bytes = long_attr(queue, s__pending_bytes);
        if (PyErr_Occurred()) return NULL;
        Py_ssize_t waiting = PyObject_Length(pending);
        if (waiting < 0) return NULL;
        go = waiting >= jobs || bytes >= most;
        if (!go && !(gap < launch)) { /* not a burst: launch if the device is idle */
            PyObject *idle = PyObject_CallMethodNoArgs(queue, s__device_idle);
            if (idle == NULL) return NULL;
            go = PyObject_IsTrue(idle);
            Py_DECREF(idle);
            if (go < 0) return NULL;
        }
    }
    if (go) return PyObject_CallMethodNoArgs(queue, s__take);
    if (set_float(queue, s__last_submit, seconds(given[PERF_COUNTER])) < 0) return NULL;
    if (PyObject_Length(pending) == 1) { /* the launcher takes it; with more, it already knows of some */
        PyObject *cond = PyObject_GetAttr(queue, s__launched);
        PyObject *r = cond == NULL ? NULL : PyObject_CallMethodNoArgs(cond, s_notify_all);
        Py_XDECREF(cond);
        if (r == NULL) return NULL;
        Py_DECREF(r);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(submit_simple_doc,
             "submit_simple(worker, queue, job_id, device, host) -> None, a list or NotImplemented\n\n"
             "`OffloadWorker._submit` of a simple compact job onto `queue`, in one call: None once it is\n"
             "queued, the batch this submit must launch (`TransferQueue._take`; the worker counts it\n"
             "as a submit under way until then), or NotImplemented, with nothing changed, where the\n"
             "Python path must take it (see the file's comment).");

static PyObject *submit_simple(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "submit_simple takes 5 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *worker = args[0], *queue = args[1], *job_id = args[2], *device = args[3], *host = args[4];
    if (given[0] == NULL || !PyLong_CheckExact(job_id) || (PyObject *)Py_TYPE(device) != given[DEVICE_BLOCKS] ||
        (PyObject *)Py_TYPE(host) != given[HOST_BLOCKS])
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *result = NULL, *layout = NULL, *direction = NULL, *dev_ids = NULL, *host_ids = NULL, *sizes = NULL;
    PyObject *job = NULL, *backend = NULL, *compute = NULL, *prepared = NULL, *wlock = NULL, *qlock = NULL;
    PyObject *in_flight = NULL, *pending = NULL, *ready = NULL, *item = NULL, *obj = NULL;
    int wlocked = 0, qlocked = 0, t;

    long long pid = long_attr(worker, s__pid);
    if (pid == -1 && PyErr_Occurred()) goto not_queued;
    if (pid != (long long)getpid()) goto decline;
    if ((obj = PyObject_GetAttr(worker, s__region)) == NULL) goto not_queued;
    if (obj != Py_None) { /* a shared region: checked every so often, by the Python path */
        PyObject *next = PyObject_GetAttr(worker, s__next_region_check);
        double due = next == NULL ? -1.0 : PyFloat_AsDouble(next), now = seconds(given[MONOTONIC]);
        Py_XDECREF(next);
        if (PyErr_Occurred()) goto not_queued;
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
    Py_ssize_t n = 0;
    if ((t = ids_fit(dev_ids, host_ids, layout, store, &n)) <= 0) goto refused;
    long long nbytes = 0, items = 0;
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
    if ((t = PySet_Contains(in_flight, job_id)) != 0) goto refused_if_true;
    if ((qlock = PyObject_GetAttr(queue, s__lock)) == NULL) goto not_queued;
    if ((t = try_lock(qlock)) <= 0) goto refused;
    qlocked = 1;
    if ((t = true_attr(queue, s__closed)) != 0) goto refused_if_true;
    if ((pending = PyObject_GetAttr(queue, s__pending)) == NULL) goto not_queued;
    Py_ssize_t waiting = PyObject_Length(pending);
    long long most = long_attr(queue, s_max_pending);
    if (PyErr_Occurred()) goto not_queued;
    if (waiting >= most) goto decline; /* back-pressure: the Python path waits */
    Py_CLEAR(obj);
    if ((obj = PyObject_GetAttr(queue, s__launcher)) == NULL) goto not_queued;
    if (obj == Py_None) goto decline; /* the Python path starts one */
    if ((ready = take_event(queue, backend)) == NULL) goto not_queued;
    Py_CLEAR(obj);
    /* recorded under the lock: per compute stream, the pending order is the recording order */
    if ((obj = PyObject_CallMethodOneArg(ready, s_record, compute)) == NULL) goto not_queued;

    /* queued from here on: what fails now is the job's to report, as on the Python path */
    if (PySet_Add(in_flight, job_id) < 0) goto raise;
    PyObject *fields = PyTuple_Pack(5, job_id, job, prepared, ready, compute);
    PyObject *pack = fields == NULL ? NULL : PyTuple_Pack(1, fields);
    Py_XDECREF(fields);
    item = pack == NULL ? NULL : PyTuple_Type.tp_new((PyTypeObject *)given[PENDING], pack, NULL);
    Py_XDECREF(pack);
    if (item == NULL) goto raise;
    Py_CLEAR(obj);
    if ((obj = PyObject_CallMethodOneArg(pending, s_append, item)) == NULL) goto raise;
    if (add_to(queue, s__pending_bytes, nbytes) < 0) goto raise;
    Py_CLEAR(obj);
    if ((obj = PyObject_GetAttr(queue, s__ids)) == NULL || PySet_Add(obj, job_id) < 0) goto raise;
    if ((result = launch_now(queue, pending)) == NULL) goto raise;
    if (result != Py_None && add_to(worker, s__submitting, 1) < 0) Py_CLEAR(result);
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
    Py_XDECREF(ready);
    Py_XDECREF(item);
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
