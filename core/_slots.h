/* The fields of a class with slots (a msgspec Struct, a dataclass with slots=True) read and
 * written in place from C, by the offsets of its member descriptors: what core/_kv_decode.c
 * and core/_kv_ingest.c use instead of attribute lookups by name. */
#ifndef URC_SLOTS_H
#define URC_SLOTS_H
#include <Python.h>
#include <structmember.h>

/* The offset of each of `names` in `cls`'s instances into out[]; -1 (TypeError set) where one
 * is not an object slot. */
static int slot_offsets(PyTypeObject *cls, const char *const *names, int n, Py_ssize_t *out) {
    for (int i = 0; i < n; i++) {
        PyObject *descr = PyDict_GetItemString(cls->tp_dict, names[i]);
        if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type) ||
            ((PyMemberDescrObject *)descr)->d_member->type != T_OBJECT_EX) {
            PyErr_Format(PyExc_TypeError, "%s.%s is not a slot", cls->tp_name, names[i]);
            return -1;
        }
        out[i] = ((PyMemberDescrObject *)descr)->d_member->offset;
    }
    return 0;
}

/* The field at `offset`, borrowed; NULL where unset. */
static inline PyObject *slot_get(PyObject *record, Py_ssize_t offset) {
    return *(PyObject **)((char *)record + offset);
}

/* Set a field of a record just made (its slot still NULL), the reference stolen. */
static inline void slot_init(PyObject *record, Py_ssize_t offset, PyObject *value) {
    *(PyObject **)((char *)record + offset) = value;
}

#endif
