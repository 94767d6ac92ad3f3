/* The KV-aware router's ranking of a uniform fleet in one C call: cluster/routing/native_rank.py
 * loads it. It is a fast path of the one policy, cluster/routing/ranking.py's rank_groups, and
 * equals it decision for decision on generated fleets (tests/cluster/test_native_rank.py).
 *
 *   rank(state, hashes, num_tokens, block_size)
 *     -> (ranks, order, committed, prefix, base, num_blocks, hashes, first_tokens)
 *
 * first_tokens: what the request adds to the first choice's pool (its tokens less the blocks of
 * its prefix cached there), the router's charge (kv_router._PendingDecision.tokens_on).
 *
 * state (one tuple per fleet, built by native_rank.fleet_state; its lists are the fleet's own,
 * moved in place as charges change them):
 *   table      the PrefixIndex's mirror of its masks (prefix_table.h)
 *   among      int    the fleet's group bits (below 2**64)
 *   bit_index  list   64 ints: index in the fleet's loads of the group with that bit, or -1
 *   order      list   the loads' indices by committed blocks, then group id (CommittedOrder)
 *   committed  list   each group's committed blocks
 *   tie        list   each group's place by group id
 *   ranks      list   [replica] per group: what Serve takes
 *   group_block_size, total (ints), target, prefix_weight, load_weight (floats)
 *
 * Scores are the Python expressions in the same order of operations; compiled without
 * floating-point contraction (no FMA), so the doubles are bit for bit Python's.
 * Why C: a decision runs between engine steps with cold caches, where each Python function a
 * decision enters costs a fetch of its code and data (docs/benchmarks/router-decision.md). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "prefix_table.h"

#define MAX_GROUPS 64
#define STATE_FIELDS 12
#define WALK_CHUNK 16
#define FULL_OCCUPANCY 1.0 /* cluster.routing.ranking.FULL_OCCUPANCY */

typedef struct {
    int tier;
    double score, occupancy;
    long tie;
} Key;

typedef struct {
    Table *table;
    PyObject *bit_index, *order, *committed, *tie, *ranks;
    uint64_t among;
    long group_block_size, total;
    double target, prefix_weight, load_weight;
} State;

static int key_less(const Key *a, const Key *b) {
    if (a->tier != b->tier) return a->tier < b->tier;
    if (a->score != b->score) return a->score < b->score;
    if (a->occupancy != b->occupancy) return a->occupancy < b->occupancy;
    return a->tie < b->tie;
}

static long item_long(PyObject *list, Py_ssize_t i) {
    return PyLong_AsLong(PyList_GET_ITEM(list, i));
}

static int read_state(PyObject *tuple, State *s) {
    if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != STATE_FIELDS) {
        PyErr_SetString(PyExc_TypeError, "rank: state must be native_rank.fleet_state's tuple");
        return -1;
    }
    s->table = table_of(PyTuple_GET_ITEM(tuple, 0));
    if (!s->table) return -1;
    if (!s->table->valid) {
        PyErr_SetString(PyExc_ValueError, "rank: the prefix table could not mirror a hash");
        return -1;
    }
    s->among = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(tuple, 1));
    s->bit_index = PyTuple_GET_ITEM(tuple, 2);
    s->order = PyTuple_GET_ITEM(tuple, 3);
    s->committed = PyTuple_GET_ITEM(tuple, 4);
    s->tie = PyTuple_GET_ITEM(tuple, 5);
    s->ranks = PyTuple_GET_ITEM(tuple, 6);
    s->group_block_size = PyLong_AsLong(PyTuple_GET_ITEM(tuple, 7));
    s->total = PyLong_AsLong(PyTuple_GET_ITEM(tuple, 8));
    s->target = PyFloat_AsDouble(PyTuple_GET_ITEM(tuple, 9));
    s->prefix_weight = PyFloat_AsDouble(PyTuple_GET_ITEM(tuple, 10));
    s->load_weight = PyFloat_AsDouble(PyTuple_GET_ITEM(tuple, 11));
    if (PyErr_Occurred()) return -1;
    if (!PyList_Check(s->bit_index) || !PyList_Check(s->order) ||
        !PyList_Check(s->committed) || !PyList_Check(s->tie) || !PyList_Check(s->ranks) ||
        PyList_GET_SIZE(s->bit_index) != MAX_GROUPS || PyList_GET_SIZE(s->order) > MAX_GROUPS ||
        PyList_GET_SIZE(s->committed) != PyList_GET_SIZE(s->order) ||
        PyList_GET_SIZE(s->tie) != PyList_GET_SIZE(s->order) ||
        PyList_GET_SIZE(s->ranks) != PyList_GET_SIZE(s->order) ||
        s->group_block_size <= 0 || s->total <= 0) {
        PyErr_SetString(PyExc_TypeError, "rank: malformed fleet state");
        return -1;
    }
    return 0;
}

/* The keys of hashes[start:end] (a hash that is not an int in [0, 2**64) cannot be in the
 * table: its key is marked absent), their slots asked for ahead of the walk: the lookups of a
 * chunk then wait on memory together, not one after another. -1: a hash is not an int. */
static int read_keys(const Table *t, PyObject *hashes, Py_ssize_t start, Py_ssize_t end,
                     uint64_t *keys, char *absent) {
    for (Py_ssize_t k = start; k < end; k++) {
        PyObject *item = PyTuple_GET_ITEM(hashes, k);
        if (!PyLong_Check(item)) {
            PyErr_SetString(PyExc_TypeError, "rank: block hashes must be ints");
            return -1;
        }
        keys[k - start] = PyLong_AsUnsignedLongLong(item);
        absent[k - start] = keys[k - start] == (uint64_t)-1 && PyErr_Occurred();
        if (absent[k - start]) PyErr_Clear();
        __builtin_prefetch(&t->slots[home_of(keys[k - start], t->capacity)]);
    }
    return 0;
}

/* prefix_split: the fewest leading hashes any fleet group holds (*base) and, for each group
 * holding more, its index (idx) and count (held); returns how many such groups, -1 on error. */
static int walk(const State *s, PyObject *hashes, long *base, long *idx, long *held) {
    Py_ssize_t num = PyTuple_GET_SIZE(hashes), chunk_start = 0, chunk_end = 0;
    uint64_t keys[WALK_CHUNK], alive = 0, mask, gone;
    char absent[WALK_CHUNK];
    int found = 0, base_known = 0;
    *base = 0;
    if (num == 0 || s->among == 0) return 0;
    for (Py_ssize_t pos = 0; pos <= num; pos++) {
        if (pos == chunk_end && pos < num) {
            chunk_start = pos;
            chunk_end = pos + WALK_CHUNK < num ? pos + WALK_CHUNK : num;
            if (read_keys(s->table, hashes, chunk_start, chunk_end, keys, absent) < 0) return -1;
        }
        if (pos < num) {
            Py_ssize_t k = pos - chunk_start;
            mask = absent[k] ? 0 : find_slot(s->table, keys[k])->mask;
        } else {
            mask = 0;  /* the end: name every group still alive */
        }
        if (pos == 0) {
            alive = mask & s->among;
            base_known = alive != s->among;
            if (!alive) return 0;
            continue;
        }
        if (pos == num && !base_known) {
            *base = (long)num;
            return 0;
        }
        mask &= alive;
        if (mask == alive) continue;
        if (!base_known) {
            *base = (long)pos;  /* the groups dropping first hold the base */
            base_known = 1;
        } else {
            for (gone = alive & ~mask; gone; gone &= gone - 1) {
                long index = item_long(s->bit_index, __builtin_ctzll(gone));
                if (index < 0 || index >= PyList_GET_SIZE(s->order) || found >= MAX_GROUPS) {
                    PyErr_SetString(PyExc_ValueError, "rank: a fleet bit has no group");
                    return -1;
                }
                idx[found] = index;
                held[found++] = (long)pos;
            }
        }
        alive = mask;
        if (!alive) break;
    }
    return found;
}

static double occupancy_of(const State *s, long i, long num_blocks, long held) {
    return (double)(item_long(s->committed, i) + num_blocks - held) / (double)s->total;
}

/* history: the group's blocks past the base are over half the request's (cluster.routing.ranking's
 * is_history), so it is scored as under the target while its pool holds the request */
static int is_history(long held, long base, long num_blocks) {
    return 2 * (held - base) > num_blocks - base;
}

static Key key_of(const State *s, long i, long held, long num_blocks, double per_occupancy,
                  double per_block, int history) {
    Key key;
    key.occupancy = occupancy_of(s, i, num_blocks, held);
    key.tie = item_long(s->tie, i);
    if (key.occupancy > FULL_OCCUPANCY) {
        key.tier = 2;
        key.score = 0.0;
        return key;
    }
    key.tier = key.occupancy > s->target && !history;
    if (key.tier)  /* over the target: the load's share of the whole pool */
        per_occupancy = s->load_weight / FULL_OCCUPANCY;
    /* rank_groups' _score expression, term for term */
    key.score = per_occupancy * key.occupancy + 0.0 - per_block * (double)held
                - s->load_weight - 0.0;
    return key;
}

/* The merge: the base-prefix groups (rest, n of them) in kept order, each longer-
 * prefix group (pidx/pheld, np of them) inserted where its key falls; into out. */
static void merge(const State *s, const long *rest, long n, const long *pidx, const long *pheld,
                  int np, long base, long num_blocks, long num_hashes, long *out) {
    long lo = 0, hi = n, start = 0, k = 0;
    double highest, per_block, per_occupancy;
    Key keys[MAX_GROUPS];
    int sorted[MAX_GROUPS];
    while (lo < hi) {  /* how many base-prefix groups are under target */
        long mid = (lo + hi) / 2;
        if (occupancy_of(s, rest[mid], num_blocks, base) <= s->target) lo = mid + 1;
        else hi = mid;
    }
    highest = lo ? occupancy_of(s, rest[lo - 1], num_blocks, base) : 0.0;
    for (int j = 0; j < np; j++) {
        double occupancy = occupancy_of(s, pidx[j], num_blocks, pheld[j]);
        double ceiling = is_history(pheld[j], base, num_blocks) ? FULL_OCCUPANCY : s->target;
        if (highest < occupancy && occupancy <= ceiling) highest = occupancy;
    }
    per_block = num_hashes > base ? s->prefix_weight / (double)(num_hashes - base) : 0.0;
    per_occupancy = highest > 0 ? s->load_weight / highest : 0.0;
    for (int j = 0; j < np; j++) {  /* insertion sort of the longer-prefix groups by key */
        int at = j;
        keys[j] = key_of(s, pidx[j], pheld[j], num_blocks, per_occupancy, per_block,
                         is_history(pheld[j], base, num_blocks));
        while (at > 0 && key_less(&keys[j], &keys[sorted[at - 1]])) {
            sorted[at] = sorted[at - 1];
            at--;
        }
        sorted[at] = j;
    }
    for (int j = 0; j < np; j++) {
        const Key *own = &keys[sorted[j]];
        lo = start;
        hi = n;
        while (lo < hi) {
            long mid = (lo + hi) / 2;
            Key other = key_of(s, rest[mid], base, num_blocks, per_occupancy, per_block, 0);
            if (key_less(&other, own)) lo = mid + 1;
            else hi = mid;
        }
        while (start < lo) out[k++] = rest[start++];
        out[k++] = pidx[sorted[j]];
    }
    while (start < n) out[k++] = rest[start++];
}

static PyObject *build_result(const State *s, const long *order, long n, const long *pidx,
                              const long *pheld, int np, long base, long num_blocks,
                              PyObject *hashes, long first_tokens) {
    PyObject *ranks = PyList_New(n), *order_out = PyList_New(n), *prefix = PyDict_New();
    PyObject *committed = PyList_GetSlice(s->committed, 0, n);
    if (!ranks || !order_out || !prefix || !committed) goto fail;
    for (long k = 0; k < n; k++) {
        PyObject *rank = PyList_GET_ITEM(s->ranks, order[k]);
        PyObject *index = PyLong_FromLong(order[k]);
        if (!index) goto fail;
        Py_INCREF(rank);
        PyList_SET_ITEM(ranks, k, rank);
        PyList_SET_ITEM(order_out, k, index);
    }
    for (int j = 0; j < np; j++) {
        PyObject *key = PyLong_FromLong(pidx[j]), *value = PyLong_FromLong(pheld[j]);
        int failed = !key || !value || PyDict_SetItem(prefix, key, value) < 0;
        Py_XDECREF(key);
        Py_XDECREF(value);
        if (failed) goto fail;
    }
    return Py_BuildValue("(NNNNllOl)", ranks, order_out, committed, prefix, base, num_blocks,
                         hashes, first_tokens);
fail:
    Py_XDECREF(ranks);
    Py_XDECREF(order_out);
    Py_XDECREF(prefix);
    Py_XDECREF(committed);
    return NULL;
}

static PyObject *rank_fleet(const State *s, PyObject *hashes, long num_tokens, long block_size) {
    long n = (long)PyList_GET_SIZE(s->order);
    long num_hashes = (long)PyTuple_GET_SIZE(hashes);
    long num_blocks = (num_tokens + s->group_block_size - 1) / s->group_block_size;
    long base = 0, idx[MAX_GROUPS], held[MAX_GROUPS], pidx[MAX_GROUPS], pheld[MAX_GROUPS];
    long rest[MAX_GROUPS], order[MAX_GROUPS];
    int found = 0, np = 0;
    if (num_hashes && block_size == s->group_block_size) {
        found = walk(s, hashes, &base, idx, held);
        if (found < 0) return NULL;
    }
    if (base > num_blocks) base = num_blocks;
    for (int j = 0; j < found; j++) {
        long h = held[j] < num_blocks ? held[j] : num_blocks;
        if (h > base) {
            pidx[np] = idx[j];
            pheld[np++] = h;
        }
    }
    long m = 0;
    for (long k = 0; k < n; k++) {
        long i = item_long(s->order, k);
        int longer = 0;
        for (int j = 0; j < np; j++) longer |= pidx[j] == i;
        if (i < 0 || i >= n) {
            PyErr_SetString(PyExc_ValueError, "rank: the kept order names no group");
            return NULL;
        }
        if (!longer) rest[m++] = i;
    }
    if (np == 0) {
        for (long k = 0; k < n; k++) order[k] = rest[k];
    } else {
        merge(s, rest, m, pidx, pheld, np, base, num_blocks, num_hashes, order);
    }
    if (PyErr_Occurred()) return NULL;  /* a kept list held something else than ints */
    long cached = base;
    for (int j = 0; j < np; j++) {
        if (n > 0 && pidx[j] == order[0]) cached = pheld[j];
    }
    long first_tokens = num_tokens - cached * block_size;
    return build_result(s, order, n, pidx, pheld, np, base, num_blocks, hashes,
                        first_tokens > 0 ? first_tokens : 0);
}

/* rank(state, hashes, num_tokens, block_size): see the top of this file. Refuses what
 * RequestDemand refuses (TypeError / ValueError), so the caller's Python path can say why. */
static PyObject *rank(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    State s;
    PyObject *hashes, *result;
    long num_tokens, block_size;
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "rank takes (state, hashes, num_tokens, block_size)");
        return NULL;
    }
    if (read_state(args[0], &s) < 0) return NULL;
    if (!PyLong_Check(args[2]) || !PyLong_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "rank: num_tokens and block_size must be integers");
        return NULL;
    }
    num_tokens = PyLong_AsLong(args[2]);
    block_size = PyLong_AsLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    if (num_tokens < 0 || block_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "rank: num_tokens must be >= 0, block_size > 0");
        return NULL;
    }
    hashes = PySequence_Tuple(args[1]);
    if (!hashes) return NULL;
    result = rank_fleet(&s, hashes, num_tokens, block_size);
    Py_DECREF(hashes);
    return result;
}

static PyMethodDef methods[] = {
    {"new_table", new_table, METH_NOARGS, "new_table() -> an empty prefix table"},
    {"table_update", (PyCFunction)(void (*)(void))table_update, METH_FASTCALL,
     "table_update(table, hashes, bit, add): set or clear a group's bit in each hash's mask"},
    {"table_masks", table_masks, METH_O, "table_masks(table) -> {hash: mask} (for tests)"},
    {"rank", (PyCFunction)(void (*)(void))rank, METH_FASTCALL,
     "rank(state, hashes, num_tokens, block_size) -> (ranks, order, committed, prefix, base, "
     "num_blocks, hashes, first_tokens)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tpserve_native_rank", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_tpserve_native_rank(void) { return PyModule_Create(&module); }
