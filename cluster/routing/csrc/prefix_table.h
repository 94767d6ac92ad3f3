/* The C mirror of the router's prefix index (cluster/routing/prefix_index.py), for native_rank.c:
 * new_table, table_update and table_masks, and the lookups its walk makes. */
#ifndef TPSERVE_PREFIX_TABLE_H
#define TPSERVE_PREFIX_TABLE_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>
#include <stdint.h>

#define TABLE_CAPSULE "tpserve_native_rank.table"

/* The mirror of a PrefixIndex: block hash -> the low 64 bits of its group mask, open addressing
 * with linear probing (a slot with mask 0 is empty; a mask cleared to 0 is deleted by backward
 * shift, so lookups never meet tombstones). One slot read per lookup where the dict takes
 * several dependent ones (its index, the entry, the key and value objects): the walk of a
 * request's hashes is what a cold decision spent most in. A hash that is not an int in
 * [0, 2**64) cannot be mirrored: the table is then marked invalid and rank refuses it (the
 * router ranks in Python). */
typedef struct {
    uint64_t key, mask;
} Slot;

typedef struct {
    Slot *slots;
    size_t capacity, used;  /* capacity: a power of two */
    int valid;
} Table;

static size_t home_of(uint64_t key, size_t capacity) {
    key ^= key >> 33;  /* a murmur finalizer: tests use small consecutive hashes */
    key *= 0xff51afd7ed558ccdULL;
    key ^= key >> 33;
    return (size_t)key & (capacity - 1);
}

static Slot *find_slot(const Table *t, uint64_t key) {  /* its slot, or the empty one ending it */
    size_t i = home_of(key, t->capacity);
    while (t->slots[i].mask && t->slots[i].key != key) i = (i + 1) & (t->capacity - 1);
    return &t->slots[i];
}

static int grow(Table *t) {
    size_t old_capacity = t->capacity;
    Slot *old = t->slots;
    Slot *slots = PyMem_Calloc(old_capacity * 2, sizeof(Slot));
    if (!slots) {
        PyErr_NoMemory();
        return -1;
    }
    t->slots = slots;
    t->capacity = old_capacity * 2;
    for (size_t i = 0; i < old_capacity; i++) {
        if (old[i].mask) *find_slot(t, old[i].key) = old[i];
    }
    PyMem_Free(old);
    return 0;
}

static void delete_slot(Table *t, size_t i) {  /* backward-shift deletion */
    size_t m = t->capacity - 1, j = i;
    t->used--;
    for (;;) {
        t->slots[i].mask = 0;
        for (;;) {
            size_t k;
            j = (j + 1) & m;
            if (!t->slots[j].mask) return;
            k = home_of(t->slots[j].key, t->capacity);
            if (i <= j ? (i < k && k <= j) : (i < k || k <= j)) continue;  /* stays */
            break;
        }
        t->slots[i] = t->slots[j];
        i = j;
    }
}

static void free_table(PyObject *capsule) {
    Table *t = PyCapsule_GetPointer(capsule, TABLE_CAPSULE);
    if (t) {
        PyMem_Free(t->slots);
        PyMem_Free(t);
    }
}

static Table *table_of(PyObject *capsule) {
    return PyCapsule_GetPointer(capsule, TABLE_CAPSULE);  /* NULL with an error if not one */
}

/* new_table() -> an empty mirror (a capsule) */
static PyObject *new_table(PyObject *self, PyObject *unused) {
    Table *t = PyMem_Calloc(1, sizeof(Table));
    PyObject *capsule;
    (void)self;
    (void)unused;
    if (!t || !(t->slots = PyMem_Calloc(1024, sizeof(Slot)))) {
        PyMem_Free(t);
        return PyErr_NoMemory();
    }
    t->capacity = 1024;
    t->valid = 1;
    capsule = PyCapsule_New(t, TABLE_CAPSULE, free_table);
    if (!capsule) {
        PyMem_Free(t->slots);
        PyMem_Free(t);
    }
    return capsule;
}

/* table_update(table, hashes, bit, add): set (add true) or clear ``bit`` (a group's, a power
 * of two) in each hash's mask, as PrefixIndex.add / discard do to theirs. Bits from 2**64 up are
 * not mirrored (fleet_state leaves fleets holding such bits to Python). A hash that is not an
 * int in [0, 2**64) invalidates the table (ValueError). */
static PyObject *table_update(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Table *t;
    PyObject *items;
    uint64_t bit;
    int add, overflow = 0;
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "table_update takes (table, hashes, bit, add)");
        return NULL;
    }
    if (!(t = table_of(args[0]))) return NULL;
    bit = PyLong_AsUnsignedLongLong(args[2]);
    if (bit == (uint64_t)-1 && PyErr_ExceptionMatches(PyExc_OverflowError)) {
        PyErr_Clear();  /* a bit from 2**64 up: not mirrored */
        Py_RETURN_NONE;
    }
    add = PyObject_IsTrue(args[3]);
    if (PyErr_Occurred()) return NULL;
    items = PySequence_Fast(args[1], "table_update: hashes must be iterable");
    if (!items) return NULL;
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(items) && t->valid; k++) {
        PyObject *item = PySequence_Fast_GET_ITEM(items, k);
        uint64_t key = PyLong_Check(item) ? PyLong_AsUnsignedLongLong(item) : 0;
        Slot *slot;
        if (!PyLong_Check(item) || (key == (uint64_t)-1 && PyErr_Occurred())) {
            PyErr_Clear();
            t->valid = 0;  /* cannot mirror it: every later rank refuses this table */
            overflow = 1;
            break;
        }
        if (add && 2 * (t->used + 1) > t->capacity && grow(t) < 0) {
            t->valid = 0;
            Py_DECREF(items);
            return NULL;
        }
        slot = find_slot(t, key);
        if (add) {
            if (!slot->mask) {
                slot->key = key;
                t->used++;
            }
            slot->mask |= bit;
        } else if (slot->mask) {
            slot->mask &= ~bit;
            if (!slot->mask) delete_slot(t, (size_t)(slot - t->slots));
        }
    }
    Py_DECREF(items);
    if (overflow) {
        PyErr_SetString(PyExc_ValueError, "table_update: a block hash is not an int in "
                        "[0, 2**64); the table is no longer used");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* table_masks(table) -> {hash: mask}: what the table holds (for tests) */
static PyObject *table_masks(PyObject *self, PyObject *capsule) {
    Table *t = table_of(capsule);
    PyObject *out;
    (void)self;
    if (!t || !(out = PyDict_New())) return NULL;
    for (size_t i = 0; i < t->capacity; i++) {
        PyObject *key, *value;
        int failed;
        if (!t->slots[i].mask) continue;
        key = PyLong_FromUnsignedLongLong(t->slots[i].key);
        value = PyLong_FromUnsignedLongLong(t->slots[i].mask);
        failed = !key || !value || PyDict_SetItem(out, key, value) < 0;
        Py_XDECREF(key);
        Py_XDECREF(value);
        if (failed) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

#endif  /* TPSERVE_PREFIX_TABLE_H */
