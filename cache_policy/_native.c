/*
 * cache_policy._native: the per-token work of a request in one C pass.
 *
 * A 4,000-token prompt is 250 blocks of 16; in Python the chain of block hashes costs one
 * struct pack, two byte concatenations and one xxh3 call per block, and the router's checks
 * (every ID a plain int, its bounds) walk the list again. Here each is one loop over the
 * list's items. Both functions are accelerators of Python code that stays the reference
 * (cache_policy.hashing._hash_chain / _pack_tokens, router.token_ids.all_ints / min_max); the
 * tests compare them on generated inputs (tests/cache_policy/test_native.py).
 *
 * int_bounds(ids)  -> (min, max) | None
 * hash_chain(ids, block_size, parent, salt, seed) -> list[int]
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

PyDoc_STRVAR(int_bounds_doc,
"int_bounds(ids, /)\n--\n\n"
"``(min(ids), max(ids))`` when ``ids`` (a list or tuple) is non-empty and every item is exactly\n"
"an ``int`` (not ``bool`` or another subclass) within a signed 64-bit range; otherwise None (the\n"
"caller's Python loop then gives the exact answer). TypeError when ``ids`` is no list or tuple.");

static PyObject *
int_bounds(PyObject *module, PyObject *ids)
{
    if (!PyList_Check(ids) && !PyTuple_Check(ids)) {
        PyErr_SetString(PyExc_TypeError, "int_bounds: ids must be a list or a tuple");
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
    PyObject **items = PySequence_Fast_ITEMS(ids);
    if (n == 0) {
        Py_RETURN_NONE;
    }
    long long lo = 0, hi = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        if (!PyLong_CheckExact(item)) {
            Py_RETURN_NONE;
        }
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow) {
            Py_RETURN_NONE;
        }
        if (v == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (i == 0) {
            lo = hi = v;
        } else {
            if (v < lo) lo = v;
            if (v > hi) hi = v;
        }
    }
    return Py_BuildValue("(LL)", lo, hi);
}

/* One token ID as uint32: 1; 0 when it is not exactly an int in [0, 2**32) (the caller
   then returns None and the Python reference gives its own answer and error). Never runs
   Python code, so the list cannot change under the loop. */
static inline int
token_u32(PyObject *item, uint32_t *out)
{
    if (!PyLong_CheckExact(item)) {
        return 0;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow || v < 0 || v > 0xFFFFFFFFLL) {
        return 0;
    }
    *out = (uint32_t)v;
    return 1;
}

static inline void
put_le32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)v; p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16); p[3] = (unsigned char)(v >> 24);
}

static inline void
put_le64(unsigned char *p, uint64_t v)
{
    for (int k = 0; k < 8; k++) p[k] = (unsigned char)(v >> (8 * k));
}

PyDoc_STRVAR(hash_chain_doc,
"hash_chain(ids, block_size, parent, salt, seed, /)\n--\n\n"
"The chained hashes of the full blocks of ``ids`` (a list or tuple of token IDs), as\n"
"``cache_policy.hashing``: block i is ``xxh3_64(le_u64(h[i-1]) || le_u32 tokens || salt on\n"
"block 0, seed)`` with ``h[-1] = parent``: ``len(ids) // block_size`` ints, in block order.\n"
"None when an ID (the partial tail block's too) is not exactly an int in [0, 2**32): the\n"
"Python reference then raises its ValueError. ``salt``: bytes (``b''`` for none); ``parent``,\n"
"``seed``: uint64. ValueError for ``block_size <= 0``.");

static PyObject *
hash_chain(PyObject *module, PyObject *args)
{
    PyObject *ids;
    Py_ssize_t block_size;
    unsigned long long parent, seed;
    const char *salt;
    Py_ssize_t salt_len;
    if (!PyArg_ParseTuple(args, "OnKy#K:hash_chain", &ids, &block_size, &parent, &salt, &salt_len, &seed)) {
        return NULL;
    }
    if (!PyList_Check(ids) && !PyTuple_Check(ids)) {
        PyErr_SetString(PyExc_TypeError, "hash_chain: ids must be a list or a tuple");
        return NULL;
    }
    if (block_size <= 0) {
        PyErr_Format(PyExc_ValueError, "block_size must be a positive number of tokens, got %zd", block_size);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
    PyObject **items = PySequence_Fast_ITEMS(ids);
    Py_ssize_t blocks = n / block_size;
    Py_ssize_t stride = 4 * block_size;
    /* scratch: parent (8) + one block of tokens + the salt (block 0 only); the tokens of
       block b are packed in place for each block, the parent written in front of them */
    unsigned char *scratch = PyMem_Malloc((size_t)(8 + stride + salt_len));
    if (scratch == NULL) {
        return PyErr_NoMemory();
    }
    PyObject *out = PyList_New(blocks);
    if (out == NULL) {
        PyMem_Free(scratch);
        return NULL;
    }
    uint64_t h = (uint64_t)parent;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        for (Py_ssize_t k = 0; k < block_size; k++) {
            uint32_t t;
            if (!token_u32(items[b * block_size + k], &t)) {
                goto not_ints;
            }
            put_le32(scratch + 8 + 4 * k, t);
        }
        put_le64(scratch, h);
        size_t len = (size_t)(8 + stride);
        if (b == 0 && salt_len > 0) {
            memcpy(scratch + len, salt, (size_t)salt_len);
            len += (size_t)salt_len;
        }
        h = XXH3_64bits_withSeed(scratch, len, (XXH64_hash_t)seed);
        PyObject *value = PyLong_FromUnsignedLongLong(h);
        if (value == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(out, b, value);
    }
    for (Py_ssize_t i = blocks * block_size; i < n; i++) {  /* the partial tail is checked too */
        uint32_t t;
        if (!token_u32(items[i], &t)) {
            goto not_ints;
        }
    }
    PyMem_Free(scratch);
    return out;
not_ints:
    PyMem_Free(scratch);
    Py_DECREF(out);
    Py_RETURN_NONE;
fail:
    PyMem_Free(scratch);
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"int_bounds", (PyCFunction)int_bounds, METH_O, int_bounds_doc},
    {"hash_chain", (PyCFunction)hash_chain, METH_VARARGS, hash_chain_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cache_policy._native",
    "Per-token work of a request in one C pass (see _native.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    return PyModule_Create(&module);
}
