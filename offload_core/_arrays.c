/* What the compiled modules do to the arrays they are passed: offload_core._native (_native.c)
 * and a backend's own module are each built with this file (setup.py). An int64 buffer's checks,
 * a call's count of arguments, runs of consecutive ids, and the stable sort of id pairs that puts
 * a launch's blocks in host order.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* `obj`'s buffer as C-contiguous native int64 values in `view` (writable where asked), which the
 * caller releases; -1 with an exception naming it `name` otherwise. */
int offload_int64_buffer(PyObject *obj, Py_buffer *view, int writable, const char *name) {
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
int offload_arity(const char *name, Py_ssize_t nargs, Py_ssize_t least, Py_ssize_t most) {
    if (nargs >= least && nargs <= most) return 1;
    if (least == most)
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, least, nargs);
    else
        PyErr_Format(PyExc_TypeError, "%s takes %zd %s %zd arguments (%zd given)", name, least,
                     most == least + 1 ? "or" : "to", most, nargs);
    return 0;
}

/* Runs of consecutive values: a run continues where a value is the one before plus 1. */
Py_ssize_t offload_runs_of(const uint64_t *h, Py_ssize_t n) {
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
void offload_sort_pairs(uint64_t *kh, uint64_t *kd, uint64_t *th, uint64_t *td, Py_ssize_t n) {
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
