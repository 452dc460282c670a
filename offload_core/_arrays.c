/* Helpers of the compiled modules, offload_core._native (_native.c) and a backend's own module,
 * each built with this file (setup.py): an int64 buffer's checks and a call's count of arguments.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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
