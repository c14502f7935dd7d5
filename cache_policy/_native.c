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
 * hash_packed(buf, block_size, parent, salt, seed) -> list[int]
 * split_ids(raw, key, also) -> (cut_start, cut_end, packed, min, max, value_start, value_end, has_also) | None
 * lane_head(data, end, max_body) -> (pairs, content_length, close) | None
 * held_run(entries, hashes, start, replica) -> int
 * surviving_run(refs, stamps, old, hashes, matched, freed, free_final[, low_freed, low_bound]) -> int
 * taken_run(refs, stamps, old, hashes) -> list[int]
 * insert_run(entries, hashes, replica) -> (stop, added)
 *
 * The last four are the decision core's per-block walks on a prefix-cache hit (a 4,000-token
 * prompt that hits walks 250 blocks in each): the Python loops in cache_policy.prefix_index and
 * cache_policy.free_queue stay their reference.
 *
 * split_ids reads a request body's token-ID list straight from its JSON bytes, so a 4,000-token
 * prompt never becomes 4,000 Python ints (decoding them is most of a body's decode time); the
 * router decodes the rest of the body as before and forwards the list's JSON text verbatim.
 *
 * lane_head judges a request head for the router's fast lane (router.fastlane._parse_head is its
 * Python reference, run without the extension; tests/router/test_fastlane.py holds both to the
 * same answers): one pass over the bytes instead of a decode, two regular expressions and a
 * Python loop, which a router that wakes cold to each request paid ~70 us for.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
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

/* The hash of one block whose tokens are already at scratch + 8 (le u32 each, ``stride`` bytes):
   xxh3_64(le_u64(parent) || tokens || salt on block 0, seed). ``scratch`` has room for the salt. */
static inline uint64_t
hash_block(unsigned char *scratch, uint64_t parent, Py_ssize_t stride, int first, const char *salt,
           Py_ssize_t salt_len, uint64_t seed)
{
    put_le64(scratch, parent);
    size_t len = (size_t)(8 + stride);
    if (first && salt_len > 0) {
        memcpy(scratch + len, salt, (size_t)salt_len);
        len += (size_t)salt_len;
    }
    return XXH3_64bits_withSeed(scratch, len, (XXH64_hash_t)seed);
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
        h = hash_block(scratch, h, stride, b == 0, salt, salt_len, (uint64_t)seed);
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

PyDoc_STRVAR(hash_packed_doc,
"hash_packed(buf, block_size, parent, salt, seed, /)\n--\n\n"
"``hash_chain`` of token IDs already packed as little-endian uint32 (``buf``: any contiguous\n"
"bytes-like object, e.g. an ``array('I')`` on a little-endian machine; its length must be a\n"
"multiple of 4, else ValueError): ``len(buf) // 4 // block_size`` ints, in block order.");

static PyObject *
hash_packed(PyObject *module, PyObject *args)
{
    Py_buffer buf;
    Py_ssize_t block_size;
    unsigned long long parent, seed;
    const char *salt;
    Py_ssize_t salt_len;
    if (!PyArg_ParseTuple(args, "y*nKy#K:hash_packed", &buf, &block_size, &parent, &salt, &salt_len, &seed)) {
        return NULL;
    }
    PyObject *out = NULL;
    unsigned char *scratch = NULL;
    if (block_size <= 0) {
        PyErr_Format(PyExc_ValueError, "block_size must be a positive number of tokens, got %zd", block_size);
        goto done;
    }
    if (buf.len % 4 != 0) {
        PyErr_Format(PyExc_ValueError, "hash_packed: %zd bytes is not a whole number of uint32 tokens", buf.len);
        goto done;
    }
    Py_ssize_t stride = 4 * block_size;
    Py_ssize_t blocks = buf.len / stride;
    scratch = PyMem_Malloc((size_t)(8 + stride + salt_len));
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    out = PyList_New(blocks);
    if (out == NULL) {
        goto done;
    }
    uint64_t h = (uint64_t)parent;
    const unsigned char *tokens = (const unsigned char *)buf.buf;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        memcpy(scratch + 8, tokens + b * stride, (size_t)stride);
        h = hash_block(scratch, h, stride, b == 0, salt, salt_len, (uint64_t)seed);
        PyObject *value = PyLong_FromUnsignedLongLong(h);
        if (value == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, b, value);
    }
done:
    PyMem_Free(scratch);
    PyBuffer_Release(&buf);
    return out;
}

/* JSON whitespace (RFC 8259: space, tab, line feed, carriage return) from s[i]; the next index. */
static inline Py_ssize_t
skip_ws(const unsigned char *s, Py_ssize_t i, Py_ssize_t n)
{
    while (i < n && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) i++;
    return i;
}

/* Past the JSON string opening at s[i] ('"'); -1 when it does not close (or holds a raw control
   character). *escaped is set when it holds a backslash. */
static Py_ssize_t
skip_string(const unsigned char *s, Py_ssize_t i, Py_ssize_t n, int *escaped)
{
    for (i++; i < n; i++) {
        unsigned char c = s[i];
        if (c == '"') return i + 1;
        if (c == '\\') { *escaped = 1; i++; continue; }
        if (c < 0x20) return -1;
    }
    return -1;
}

/* Past the JSON value starting at s[i]: a string exactly, anything else by bracket depth up to
   the ',' '}' or ']' (or whitespace) that ends it at depth 0. Lenient: whether the value is valid
   JSON is for the decoder of the rest of the body to say. -1 when it runs off the end. */
static Py_ssize_t
skip_value(const unsigned char *s, Py_ssize_t i, Py_ssize_t n)
{
    Py_ssize_t depth = 0;
    while (i < n) {
        unsigned char c = s[i];
        if (c == '"') {
            int escaped = 0;
            i = skip_string(s, i, n, &escaped);
            if (i < 0) return -1;
            if (depth == 0) return i;
            continue;
        }
        if (c == '[' || c == '{') {
            depth++;
        } else if (c == ']' || c == '}') {
            if (depth == 0) return i;
            if (--depth == 0) return i + 1;
        } else if (depth == 0 && (c == ',' || c == ' ' || c == '\t' || c == '\n' || c == '\r')) {
            return i;
        }
        i++;
    }
    return depth == 0 ? i : -1;
}

PyDoc_STRVAR(split_ids_doc,
"split_ids(raw, key, also=b'', /)\n--\n\n"
"Find the top-level member ``key`` of the JSON object ``raw`` (bytes) whose value is a non-empty\n"
"list of token IDs: JSON integers in [0, 2**32), written plainly (no sign, fraction, exponent or\n"
"leading zero). Returns ``(cut_start, cut_end, packed, min, max, value_start, value_end, has_also)``:\n"
"``raw[:cut_start] + raw[cut_end:]`` is the object without that member (and its comma),\n"
"``packed`` the IDs as little-endian uint32 bytes, ``raw[value_start:value_end]`` the list's\n"
"JSON text, ``has_also`` whether the object has a top-level member ``also`` (written without\n"
"escapes, as every key must be here). None whenever that is not certain (no such member, another value, an ID out of\n"
"range, a key written with an escape, the key twice, text after the object): the caller then\n"
"decodes ``raw`` whole. The rest of ``raw`` is skipped leniently: decoding the object without\n"
"the member is what judges it (if that is valid JSON, so is ``raw``).");

static PyObject *
split_ids(PyObject *module, PyObject *args)
{
    const unsigned char *s;
    Py_ssize_t n;
    const char *key, *also = "";
    Py_ssize_t key_len, also_len = -1;
    int has_also = 0;
    if (!PyArg_ParseTuple(args, "y#y#|y#:split_ids", &s, &n, &key, &key_len, &also, &also_len)) {
        return NULL;
    }
    Py_ssize_t i = skip_ws(s, 0, n);
    if (i >= n || s[i] != '{') Py_RETURN_NONE;
    Py_ssize_t open = i;
    Py_ssize_t cut_start = -1, cut_end = -1, value_start = -1, value_end = -1;
    uint32_t *ids = NULL;
    Py_ssize_t count = 0;
    uint32_t lo = 0, hi = 0;
    i++;
    for (;;) {
        Py_ssize_t member = i;  /* just past '{' or ',' */
        i = skip_ws(s, i, n);
        if (i < n && s[i] == '}' && member == open + 1) {
            i++;
            break;  /* {} */
        }
        if (i >= n || s[i] != '"') goto decline;
        int escaped = 0;
        Py_ssize_t key_start = i + 1;
        i = skip_string(s, i, n, &escaped);
        if (i < 0 || escaped) goto decline;
        int is_key = (i - 1 - key_start == key_len) && memcmp(s + key_start, key, (size_t)key_len) == 0;
        if (i - 1 - key_start == also_len && memcmp(s + key_start, also, (size_t)also_len) == 0) has_also = 1;
        i = skip_ws(s, i, n);
        if (i >= n || s[i] != ':') goto decline;
        i = skip_ws(s, i + 1, n);
        if (is_key) {
            if (ids != NULL || i >= n || s[i] != '[') goto decline;  /* twice, or not a list */
            value_start = i;
            ids = PyMem_Malloc(sizeof(uint32_t) * (size_t)((n - i) / 2 + 1));
            if (ids == NULL) return PyErr_NoMemory();
            i = skip_ws(s, i + 1, n);
            lo = 0xFFFFFFFFu;
            for (;;) {  /* the hot loop: a 4,000-token prompt is ~25 KB of digits and commas */
                unsigned int d = i < n ? (unsigned int)s[i] - '0' : 10u;
                if (d > 9) goto decline;  /* also '-', ']' (empty) */
                Py_ssize_t start = i++;
                uint64_t v = d;
                while (i < n && (d = (unsigned int)s[i] - '0') <= 9) {
                    if (i - start >= 10) goto decline;  /* 11 digits: past 2**32 (or a leading-zero run) */
                    v = v * 10 + d;
                    i++;
                }
                if ((s[start] == '0' && i - start > 1) || v > 0xFFFFFFFFULL) goto decline;
                if (i < n && (s[i] == '.' || s[i] == 'e' || s[i] == 'E')) goto decline;
                uint32_t t = (uint32_t)v;
                if (t < lo) lo = t;
                if (t > hi) hi = t;
                ids[count++] = t;
                if (i < n && s[i] == ',') {  /* "1,2" and "1, 2": the common separators first */
                    i++;
                    if (i < n && s[i] == ' ') i++;
                    i = skip_ws(s, i, n);
                    continue;
                }
                i = skip_ws(s, i, n);
                if (i < n && s[i] == ',') {
                    i = skip_ws(s, i + 1, n);
                    continue;
                }
                if (i < n && s[i] == ']') break;
                goto decline;
            }
            value_end = ++i;
        } else {
            i = skip_value(s, i, n);
            if (i < 0) goto decline;
        }
        i = skip_ws(s, i, n);
        if (i >= n) goto decline;
        if (s[i] == ',') {
            if (is_key) { cut_start = member; cut_end = i + 1; }
            i++;
            continue;
        }
        if (s[i] != '}') goto decline;
        if (is_key) {  /* the last member: its comma is the one before it, if any */
            cut_start = member == open + 1 ? member : member - 1;
            cut_end = i;
        }
        i++;
        break;
    }
    if (skip_ws(s, i, n) != n || ids == NULL) goto decline;
    PyObject *packed = PyBytes_FromStringAndSize(NULL, 4 * count);
    if (packed == NULL) {
        PyMem_Free(ids);
        return NULL;
    }
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(packed);
#if PY_LITTLE_ENDIAN
    memcpy(p, ids, 4 * (size_t)count);
#else
    for (Py_ssize_t k = 0; k < count; k++) put_le32(p + 4 * k, ids[k]);
#endif
    PyMem_Free(ids);
    return Py_BuildValue("(nnNkknnO)", cut_start, cut_end, packed, (unsigned long)lo, (unsigned long)hi,
                         value_start, value_end, has_also ? Py_True : Py_False);
decline:
    PyMem_Free(ids);
    Py_RETURN_NONE;
}

/* RFC 9110 token characters (a field name): !#$%&'*+-.^_`|~ digits letters */
static inline int
is_tchar(unsigned char c)
{
    if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return 1;
    switch (c) {
    case '!': case '#': case '$': case '%': case '&': case '\'': case '*': case '+': case '-':
    case '.': case '^': case '_': case '`': case '|': case '~':
        return 1;
    default:
        return 0;
    }
}

/* Whether s[0:n] equals the lower-case ASCII word ``lower`` ignoring ASCII case. */
static inline int
name_is(const unsigned char *s, Py_ssize_t n, const char *lower)
{
    Py_ssize_t k = 0;
    for (; k < n && lower[k]; k++) {
        unsigned char c = s[k];
        if (c >= 'A' && c <= 'Z') c = (unsigned char)(c + 32);
        if (c != (unsigned char)lower[k]) return 0;
    }
    return k == n && lower[k] == '\0';
}

static const char LANE_REQUEST_LINE[] = "POST /v1/completions HTTP/1.1";

/* The items of ``hashes`` (a tuple of block hashes: immutable, so the items stay put while a
   key's __eq__ runs; a list could be resized under the walk) and their count; -1 with a
   TypeError naming ``fn`` for anything else. */
static int
block_hash_items(PyObject *hashes, const char *fn, PyObject ***items, Py_ssize_t *n)
{
    if (!PyTuple_Check(hashes)) {
        PyErr_Format(PyExc_TypeError, "%s: hashes must be a tuple", fn);
        return -1;
    }
    *items = PySequence_Fast_ITEMS(hashes);
    *n = PyTuple_GET_SIZE(hashes);
    return 0;
}

/* Whether a prefix-index entry (``cache_policy.prefix_index``: a replica id held alone, or a
   {replica: state} dict) names ``replica``; -1 with an exception set. */
static int
entry_holds(PyObject *entry, PyObject *replica)
{
    if (entry == replica) return 1;
    if (PyUnicode_CheckExact(entry)) return PyObject_RichCompareBool(entry, replica, Py_EQ);
    if (PyDict_CheckExact(entry)) return PyDict_Contains(entry, replica);
    return PySequence_Contains(entry, replica);
}

PyDoc_STRVAR(held_run_doc,
"held_run(entries, hashes, start, replica, /)\n--\n\n"
"The first index ``i >= start`` of ``hashes`` (a tuple of block hashes) whose entry in\n"
"``entries`` (a dict: hash -> replica id, or -> dict of replica ids) is missing or does not name\n"
"``replica``; ``len(hashes)`` when every one from ``start`` on does. The one-holder walk of\n"
"``cache_policy.prefix_index.PrefixIndex.match`` (``_held_run_py`` there is its Python reference).");

static PyObject *
held_run(PyObject *module, PyObject *args)
{
    PyObject *entries, *hashes, *replica;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "O!OnO:held_run", &PyDict_Type, &entries, &hashes, &start, &replica)) {
        return NULL;
    }
    PyObject **items;
    Py_ssize_t n;
    if (block_hash_items(hashes, "held_run", &items, &n) < 0) return NULL;
    Py_ssize_t i = start < 0 ? 0 : start;
    for (; i < n; i++) {
        PyObject *entry = PyDict_GetItemWithError(entries, items[i]);  /* borrowed */
        if (entry == NULL) {
            if (PyErr_Occurred()) return NULL;
            break;
        }
        Py_INCREF(entry);
        int held = entry_holds(entry, replica);
        Py_DECREF(entry);
        if (held < 0) return NULL;
        if (!held) break;
    }
    return PyLong_FromSsize_t(i < n ? i : n);
}

/* dict[key] as a C long long; 0 when absent, 1 when found, -1 with an exception set (also for a
   value that is no int within 64 bits). */
static int
stamp_of(PyObject *dict, PyObject *key, long long *out)
{
    PyObject *value = PyDict_GetItemWithError(dict, key);  /* borrowed */
    if (value == NULL) return PyErr_Occurred() ? -1 : 0;
    if (!PyLong_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "surviving_run: a stamp is not an int");
        return -1;
    }
    *out = PyLong_AsLongLong(value);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 1;
}

PyDoc_STRVAR(surviving_run_doc,
"surviving_run(refs, stamps, old, hashes, matched, freed, free_final, low_freed=None, low_bound=None, /)\n--\n\n"
"``cache_policy.free_queue.FreeQueueModel.surviving`` past its replica lookup (``_surviving``\n"
"there is its Python reference): of ``hashes[:matched]``, how many leading blocks survive.\n"
"A block in ``refs`` (held by a request in flight) survives; else its release stamp (``stamps``,\n"
"then ``old``; one less than the block before it when neither has one and that block had one)\n"
"must be known and at most ``free_final`` releases old, and not evicted at a past low point\n"
"(``low_freed``/``low_bound``: lists of ints, ``_ReplicaQueue.evicted_before``). OverflowError\n"
"past 64 bits.");

static PyObject *
surviving_run(PyObject *module, PyObject *args)
{
    PyObject *refs, *stamps, *old, *hashes, *low_freed = NULL, *low_bound = NULL;
    Py_ssize_t matched;
    long long freed, free_final;
    if (!PyArg_ParseTuple(args, "O!O!O!OnLL|O!O!:surviving_run", &PyDict_Type, &refs, &PyDict_Type, &stamps,
                          &PyDict_Type, &old, &hashes, &matched, &freed, &free_final,
                          &PyList_Type, &low_freed, &PyList_Type, &low_bound)) {
        return NULL;
    }
    PyObject **items;
    Py_ssize_t n;
    if (block_hash_items(hashes, "surviving_run", &items, &n) < 0) return NULL;
    if (matched > n) matched = n;
    /* the past low points (FreeQueueModel.note), read once: nondecreasing counters and the
       least stamp a block released before each needed to survive it */
    Py_ssize_t nlow = low_freed == NULL ? 0 : PyList_GET_SIZE(low_freed);
    if (low_freed != NULL && (low_bound == NULL || PyList_GET_SIZE(low_bound) != nlow)) {
        PyErr_SetString(PyExc_ValueError, "surviving_run: low_freed and low_bound differ in length");
        return NULL;
    }
    long long *lows = NULL;
    if (nlow > 0) {
        lows = PyMem_Malloc(sizeof(long long) * 2 * (size_t)nlow);
        if (lows == NULL) return PyErr_NoMemory();
        for (Py_ssize_t k = 0; k < nlow; k++) {
            PyObject *a = PyList_GET_ITEM(low_freed, k), *b = PyList_GET_ITEM(low_bound, k);
            if (!PyLong_Check(a) || !PyLong_Check(b)) {
                PyMem_Free(lows);
                PyErr_SetString(PyExc_TypeError, "surviving_run: a low point is not an int");
                return NULL;
            }
            lows[2 * k] = PyLong_AsLongLong(a);
            lows[2 * k + 1] = PyLong_AsLongLong(b);
            if (PyErr_Occurred()) {
                PyMem_Free(lows);
                return NULL;
            }
        }
    }
    int have_prev = 0;
    long long prev = 0;
    Py_ssize_t i = 0;
    for (; i < matched; i++) {
        PyObject *h = items[i];
        int held = PyDict_Contains(refs, h);
        if (held < 0) goto fail;
        if (held) {
            have_prev = 0;
            continue;
        }
        long long stamp;
        int found = stamp_of(stamps, h, &stamp);
        if (found == 0) found = stamp_of(old, h, &stamp);
        if (found < 0) goto fail;
        if (!found && have_prev) {
            if (prev == LLONG_MIN) {
                PyErr_SetString(PyExc_OverflowError, "surviving_run: a stamp past 64 bits");
                goto fail;
            }
            stamp = prev - 1;  /* an output block of the request that released the one before */
            found = 1;
        }
        if (!found || (__int128)freed - stamp > free_final) break;  /* 128 bits: no overflow */
        if (nlow > 0) {  /* evicted at a low point since its release (_ReplicaQueue.evicted_before) */
            Py_ssize_t lo = 0, hi = nlow;  /* bisect_right(low_freed, stamp) */
            while (lo < hi) {
                Py_ssize_t mid = lo + (hi - lo) / 2;
                if (stamp < lows[2 * mid]) hi = mid; else lo = mid + 1;
            }
            if (lo < nlow && stamp < lows[2 * lo + 1]) break;
        }
        prev = stamp;
        have_prev = 1;
    }
    PyMem_Free(lows);
    return PyLong_FromSsize_t(i);
fail:
    PyMem_Free(lows);
    return NULL;
}

PyDoc_STRVAR(taken_run_doc,
"taken_run(refs, stamps, old, hashes, /)\n--\n\n"
"The release stamps of the leading blocks of ``hashes`` a prefix-cache hit takes out of the free\n"
"queue: blocks in ``refs`` (held by a request in flight) are skipped, the others give their stamp\n"
"(``stamps``, then ``old``) up to the first one with none. The walk of\n"
"``cache_policy.free_queue.FreeQueueModel.hold`` (``_taken_py`` there is its Python reference).");

static PyObject *
taken_run(PyObject *module, PyObject *args)
{
    PyObject *refs, *stamps, *old, *hashes;
    if (!PyArg_ParseTuple(args, "O!O!O!O:taken_run", &PyDict_Type, &refs, &PyDict_Type, &stamps,
                          &PyDict_Type, &old, &hashes)) {
        return NULL;
    }
    PyObject **items;
    Py_ssize_t n;
    if (block_hash_items(hashes, "taken_run", &items, &n) < 0) return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = items[i];
        int held = PyDict_Contains(refs, h);
        if (held < 0) goto fail;
        if (held) continue;
        PyObject *stamp = PyDict_GetItemWithError(stamps, h);  /* borrowed */
        if (stamp == NULL) {
            if (PyErr_Occurred()) goto fail;
            stamp = PyDict_GetItemWithError(old, h);
            if (stamp == NULL) {
                if (PyErr_Occurred()) goto fail;
                break;
            }
        }
        if (PyList_Append(out, stamp) < 0) goto fail;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

PyDoc_STRVAR(insert_run_doc,
"insert_run(entries, hashes, replica, /)\n--\n\n"
"The prefix index's insert of ``hashes`` for a replica that holds its blocks alone (an entry\n"
"that is the replica id itself), from the last block back: a missing block gets the entry\n"
"``replica``, a block whose entry is ``replica`` alone moves to the most recently used end.\n"
"Stops before the first block with any other entry and returns ``(i, added)``: Python goes on\n"
"with ``hashes[:i + 1]`` (``i`` is -1 when every block was done), ``added`` blocks were new.\n"
"``cache_policy.prefix_index.PrefixIndex.insert``'s loop is its reference.");

static PyObject *
insert_run(PyObject *module, PyObject *args)
{
    PyObject *entries, *hashes, *replica;
    if (!PyArg_ParseTuple(args, "O!OU:insert_run", &PyDict_Type, &entries, &hashes, &replica)) {
        return NULL;
    }
    if (!PyUnicode_CheckExact(replica)) {  /* a str subclass's __eq__ could run mid-walk */
        PyErr_SetString(PyExc_TypeError, "insert_run: replica must be a str");
        return NULL;
    }
    PyObject **items;
    Py_ssize_t n;
    if (block_hash_items(hashes, "insert_run", &items, &n) < 0) return NULL;
    Py_ssize_t i = n - 1, added = 0;
    for (; i >= 0; i--) {
        PyObject *h = items[i];
        PyObject *entry = PyDict_GetItemWithError(entries, h);  /* borrowed */
        if (entry == NULL) {
            if (PyErr_Occurred()) return NULL;
            if (PyDict_SetItem(entries, h, replica) < 0) return NULL;
            added++;
            continue;
        }
        Py_INCREF(entry);  /* ours before anything else runs: it moves out and in again */
        if (entry != replica) {
            int same = PyUnicode_CheckExact(entry) ? PyObject_RichCompareBool(entry, replica, Py_EQ) : 0;
            if (same <= 0) {
                Py_DECREF(entry);
                if (same < 0) return NULL;
                break;
            }
        }
        /* to the most recently used end */
        if (PyDict_DelItem(entries, h) < 0 || PyDict_SetItem(entries, h, entry) < 0) {
            Py_DECREF(entry);
            return NULL;
        }
        Py_DECREF(entry);
    }
    return Py_BuildValue("(nn)", i, added);
}

PyDoc_STRVAR(lane_head_doc,
"lane_head(data, end, max_body, /)\n--\n\n"
"Judge the request head ``data[:end]`` (bytes or bytearray, without its blank line) for the router's fast lane,\n"
"as ``router.fastlane._parse_head`` does (its reference): ``(pairs, content_length, close)`` when\n"
"the head is ``POST /v1/completions HTTP/1.1`` then lines ``name:value`` (an RFC 9110 token, then\n"
"printable ASCII and tabs, the spaces and tabs around the value dropped, none inside it) with one\n"
"Host, one Content-Length of 1 to 12 digits and at most ``max_body``, at most one Connection\n"
"(``close`` among its tokens sets ``close``; ``upgrade`` declines) and no Transfer-Encoding,\n"
"Content-Encoding, Expect or Upgrade; ``pairs``: ``[(name, value)]`` as str, in order. None\n"
"otherwise. ValueError when ``end`` is outside ``data``.");

static PyObject *judge_head(const unsigned char *s, Py_ssize_t n, long long max_body);

static PyObject *
lane_head(PyObject *module, PyObject *args)
{
    Py_buffer buf;
    Py_ssize_t n;
    long long max_body;
    if (!PyArg_ParseTuple(args, "y*nL:lane_head", &buf, &n, &max_body)) {
        return NULL;
    }
    PyObject *found = NULL;
    if (n < 0 || n > buf.len) {
        PyErr_SetString(PyExc_ValueError, "lane_head: end is outside data");
    } else {
        found = judge_head((const unsigned char *)buf.buf, n, max_body);
    }
    PyBuffer_Release(&buf);
    return found;
}

/* lane_head on s[0:n] (a buffer the caller holds). */
static PyObject *
judge_head(const unsigned char *s, Py_ssize_t n, long long max_body)
{
    Py_ssize_t line_len = (Py_ssize_t)(sizeof(LANE_REQUEST_LINE) - 1);
    if (n < line_len || memcmp(s, LANE_REQUEST_LINE, (size_t)line_len) != 0) Py_RETURN_NONE;
    PyObject *pairs = PyList_New(0);
    if (pairs == NULL) return NULL;
    long long length = -1;
    int close = 0, host = 0, connection = 0;
    Py_ssize_t i = line_len;
    while (i < n) {
        if (i + 1 >= n || s[i] != '\r' || s[i + 1] != '\n') goto decline;
        i += 2;
        Py_ssize_t name = i;
        while (i < n && is_tchar(s[i])) i++;
        Py_ssize_t name_len = i - name;
        if (name_len == 0 || i >= n || s[i] != ':') goto decline;
        i++;
        Py_ssize_t value = i;
        while (i < n && ((s[i] >= 0x20 && s[i] <= 0x7e) || s[i] == '\t')) i++;
        Py_ssize_t value_end = i;  /* at the line's "\r\n", or the head's end */
        while (value < value_end && (s[value] == ' ' || s[value] == '\t')) value++;
        while (value_end > value && (s[value_end - 1] == ' ' || s[value_end - 1] == '\t')) value_end--;
        if (memchr(s + value, '\t', (size_t)(value_end - value)) != NULL) goto decline;
        const unsigned char *nm = s + name, *v = s + value;
        Py_ssize_t vlen = value_end - value;
        if (name_is(nm, name_len, "transfer-encoding") || name_is(nm, name_len, "content-encoding")
                || name_is(nm, name_len, "expect") || name_is(nm, name_len, "upgrade")) {
            goto decline;
        }
        if (name_is(nm, name_len, "content-length")) {
            if (length >= 0 || vlen == 0 || vlen > 12) goto decline;
            length = 0;
            for (Py_ssize_t k = 0; k < vlen; k++) {
                if (v[k] < '0' || v[k] > '9') goto decline;
                length = length * 10 + (v[k] - '0');
            }
        } else if (name_is(nm, name_len, "host")) {
            if (host) goto decline;
            host = 1;
        } else if (name_is(nm, name_len, "connection")) {
            if (connection) goto decline;
            connection = 1;
            Py_ssize_t k = 0;
            while (k <= vlen) {  /* its comma-separated tokens, spaces around each dropped */
                Py_ssize_t t = k;
                while (k < vlen && v[k] != ',') k++;
                Py_ssize_t a = t, b = k;
                while (a < b && v[a] == ' ') a++;
                while (b > a && v[b - 1] == ' ') b--;
                if (name_is(v + a, b - a, "upgrade")) goto decline;
                if (name_is(v + a, b - a, "close")) close = 1;
                k++;
            }
        }
        PyObject *pair = Py_BuildValue("(NN)", PyUnicode_DecodeASCII((const char *)nm, name_len, NULL),
                                       PyUnicode_DecodeASCII((const char *)v, vlen, NULL));
        if (pair == NULL || PyList_Append(pairs, pair) < 0) {
            Py_XDECREF(pair);
            Py_DECREF(pairs);
            return NULL;
        }
        Py_DECREF(pair);
    }
    if (length < 0 || length > max_body || !host) goto decline;
    return Py_BuildValue("(NLO)", pairs, length, close ? Py_True : Py_False);
decline:
    Py_DECREF(pairs);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"int_bounds", (PyCFunction)int_bounds, METH_O, int_bounds_doc},
    {"hash_chain", (PyCFunction)hash_chain, METH_VARARGS, hash_chain_doc},
    {"hash_packed", (PyCFunction)hash_packed, METH_VARARGS, hash_packed_doc},
    {"split_ids", (PyCFunction)split_ids, METH_VARARGS, split_ids_doc},
    {"lane_head", (PyCFunction)lane_head, METH_VARARGS, lane_head_doc},
    {"held_run", (PyCFunction)held_run, METH_VARARGS, held_run_doc},
    {"surviving_run", (PyCFunction)surviving_run, METH_VARARGS, surviving_run_doc},
    {"taken_run", (PyCFunction)taken_run, METH_VARARGS, taken_run_doc},
    {"insert_run", (PyCFunction)insert_run, METH_VARARGS, insert_run_doc},
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
