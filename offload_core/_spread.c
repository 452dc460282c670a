/* A pass over many ids split into parts that run on a few threads at once: the checks, copies
 * and table writes of a large job (a million ids of one tensor's 256 B pages) are each 1-3 ms of
 * memory and bit work on one core of the H200's host, against 4.9 ms of link a job.
 *
 * The threads live for one pass (no pool: nothing to tear down, nothing a forked child
 * inherits). The caller keeps the GIL throughout: the parts touch raw memory only, never a
 * Python object, so a pass is as atomic for other Python threads as the one-thread pass was.
 * A thread that cannot be started leaves its part to the calling thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#include <unistd.h>
#define SPREAD_THREADS 1
#endif
#if defined(__linux__)
#include <sched.h>
#endif

#define MOST_PARTS 8                  /* per-part results are arrays of this many */
#define DEFAULT_THREADS 4             /* a few cores' memory bandwidth; more cost the engine's threads */
#define PART_IDS ((Py_ssize_t)1 << 17) /* a part's least ids: a thread's start (tens of us) stays small */
#define ALIGN 64                      /* part bounds in items: whole cache lines of int64 and int32 */

typedef void (*part_fn)(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int part);

static int threads = 0; /* 0: not chosen yet (`usable`); touched only with the GIL held */

/* The CPUs this process may run on (its affinity, where Linux tells it), at most DEFAULT_THREADS. */
static int usable(void) {
    long cpus = 1;
#if defined(__linux__) && defined(CPU_COUNT)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) cpus = CPU_COUNT(&set);
#elif defined(SPREAD_THREADS) && defined(_SC_NPROCESSORS_ONLN)
    cpus = sysconf(_SC_NPROCESSORS_ONLN);
#endif
    return cpus < 1 ? 1 : cpus > DEFAULT_THREADS ? DEFAULT_THREADS : (int)cpus;
}

/* How many parts a pass over `n` ids takes: 1 below two parts' worth, else as many as the
 * threads allowed and the ids fill. */
int offload_parts(Py_ssize_t n) {
    if (threads == 0) threads = usable();
    Py_ssize_t parts = n / PART_IDS;
    if (parts > threads) parts = threads;
    return parts < 2 ? 1 : (int)parts;
}

/* Part k's first item of `n` split into `parts`: a multiple of ALIGN, the last part's end `n`. */
static Py_ssize_t bound(Py_ssize_t n, int k, int parts) {
    if (k >= parts) return n;
    Py_ssize_t at = (Py_ssize_t)((long double)n * k / parts);
    return at - at % ALIGN;
}

#ifdef SPREAD_THREADS
typedef struct {
    part_fn fn;
    void *ctx;
    Py_ssize_t lo, hi;
    int part;
} Job;

static void *run_job(void *arg) {
    Job *j = arg;
    j->fn(j->ctx, j->lo, j->hi, j->part);
    return NULL;
}
#endif

/* fn(ctx, lo, hi, k) for each part k of [0, n) split into `parts` (from `offload_parts`), part 0
 * on this thread, the others on threads of their own; returns once every part has run. */
void offload_spread(Py_ssize_t n, int parts, part_fn fn, void *ctx) {
    if (parts > MOST_PARTS) parts = MOST_PARTS;
    if (parts < 2) {
        fn(ctx, 0, n, 0);
        return;
    }
#ifdef SPREAD_THREADS
    Job jobs[MOST_PARTS];
    pthread_t ids[MOST_PARTS];
    int started[MOST_PARTS] = {0};
    for (int k = 1; k < parts; k++) {
        jobs[k] = (Job){fn, ctx, bound(n, k, parts), bound(n, k + 1, parts), k};
        started[k] = pthread_create(&ids[k], NULL, run_job, &jobs[k]) == 0;
    }
    fn(ctx, 0, bound(n, 1, parts), 0);
    for (int k = 1; k < parts; k++) {
        if (started[k])
            pthread_join(ids[k], NULL);
        else
            fn(ctx, jobs[k].lo, jobs[k].hi, k);
    }
#else
    for (int k = 0; k < parts; k++) fn(ctx, bound(n, k, parts), bound(n, k + 1, parts), k);
#endif
}

const char offload_spread_threads_doc[] =
    "spread_threads([threads]) -> int\n\n"
    "The most threads a compiled pass over a large job's ids (its checks, its spec copies, its\n"
    "table) runs on, after setting it to `threads` where given: 1 for the calling thread only, up\n"
    "to 8; 0 for the default, the CPUs this process may run on, at most 4. A pass takes one thread\n"
    "per 131072 ids at most: jobs below 262144 ids always run on the calling thread.";

PyObject *offload_spread_threads(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs > 1) {
        PyErr_Format(PyExc_TypeError, "spread_threads takes at most 1 argument (%zd given)", nargs);
        return NULL;
    }
    if (nargs == 1) {
        long k = PyLong_AsLong(args[0]);
        if (k == -1 && PyErr_Occurred()) return NULL;
        if (k < 0) {
            PyErr_Format(PyExc_ValueError, "spread_threads: threads must be 0 (the default) or more, got %ld", k);
            return NULL;
        }
        threads = k == 0 ? usable() : k > MOST_PARTS ? MOST_PARTS : (int)k;
    } else if (threads == 0) {
        threads = usable();
    }
    return PyLong_FromLong(threads);
}
