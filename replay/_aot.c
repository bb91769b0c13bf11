/* replay._aot: ahead-of-time compiled twins of the kernels a plain LRU replay runs, so `moe-replay
 * cache` can replay without importing Numba (importing it and loading its cached machine code costs
 * about 0.4 s, more than the replay of a 4.8 M-routing trace).
 *
 *   rows_ok    == replay.load_kernel.rows_ok
 *   cut_loads  == replay.load_kernel.cut_loads
 *   replay_lru == replay.cache_kernel._driver compiled by make_kernel(name, replay.policies.lru,
 *                 whatif=False, slots=False) (also the `layer` policy: lru's hooks, one group per
 *                 layer; the driver takes a load's group from layer_info)
 *   replay_lru_rows == cut_loads then replay_lru, in one pass over the rows, without per-batch
 *                 totals (replay.native's replay: no NumPy to hold the loads in between)
 *
 * Same arguments in the same order, same results, same bytes written: tests/test_aot_kernels.py
 * demands exact agreement with the Numba kernels (and with the naive twin tests/naive/cache.py) on
 * random inputs. Whoever changes one of those kernels changes its twin here, or that test fails.
 *
 * Arrays come through the buffer protocol (no NumPy C API: nothing to build against, and any NumPy
 * works): C-contiguous, with the exact element type of each argument (a NumPy array of another
 * dtype is refused with a TypeError naming the argument, never converted: a silent copy of a state
 * array would leave the caller's state unchanged). Shapes are checked (ValueError), and so is every
 * value the kernels read out of an array and use as an index (an entry id, a layer, a group, a
 * batch, a phase, a list link), before it is used: a bad argument raises ValueError, it never
 * reads or writes out of bounds. Values used once per load are checked there (a compare on a value
 * already in a register); entry ids, each layer's group and the policy's list links once per call,
 * before the replay. A replay that raises part way has written part of its state: the state is then
 * garbage (as the caller's arguments were). Numba's kernels check nothing: on input they accept,
 * the two agree byte for byte; a few inputs Numba would read out of bounds on are refused here.
 *
 * The loops run without the GIL (a streamed replay runs its cells on threads).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* replay.cache_state: ent rows and grp columns */
#define ENT_RESIDENT 0
#define ENT_PIN 7
#define ENT_BYTES 9
#define N_ENT 14
#define GRP_BUDGET 1
#define GRP_USED 2
#define GRP_COUNT 3
#define N_GRP 5
/* replay.cache_kernel: acc fields, stats, opts */
#define ACC_LOOKUPS 0
#define ACC_HITS 1
#define ACC_READ 2
#define N_ACC 7
#define STAT_EVICTIONS 0
#define STAT_OVERFLOW 1
#define STAT_TICKS 3
#define STAT_PEAK_BYTES 11
#define N_STATS 12
#define OPT_TICK0 5
#define OPT_LOAD0 6
#define OPT_BATCH0 7
#define N_OPTS 8
/* replay.policies.lru: ps pairs */
#define PREV 0
#define NEXT 1
#define HEAD 0
#define TAIL 1

/* ------------------------------------------------------------------------------------------------
 * Arguments */

enum kind { K_INT, K_FLOAT, K_BOOL };

typedef struct {
    Py_buffer view[20];
    const char *name[20];
    int writable[20];
    int n;
} bufs_t;

static void bufs_release(bufs_t *b) {
    for (int i = 0; i < b->n; i++)
        PyBuffer_Release(&b->view[i]);
    b->n = 0;
}

static const char *kind_name(enum kind kind, Py_ssize_t size) {
    if (kind == K_BOOL)
        return "bool";
    if (kind == K_FLOAT)
        return size == 4 ? "float32" : "float64";
    switch (size) {
    case 1: return "int8";
    case 2: return "int16";
    case 4: return "int32";
    default: return "int64";
    }
}

/* The element type a buffer's format names: 1 when it is `kind` of `size` bytes in native order. */
static int format_is(const char *fmt, Py_ssize_t itemsize, enum kind kind, Py_ssize_t size) {
    if (fmt == NULL)
        fmt = "B";
    if (*fmt == '@' || *fmt == '=')
        fmt++;
    else if (*fmt == '<' || *fmt == '>' || *fmt == '!') {
        const int little = PY_LITTLE_ENDIAN;
        if ((*fmt == '<') != little)
            return 0; /* foreign byte order */
        fmt++;
    }
    if (fmt[0] == '\0' || fmt[1] != '\0' || itemsize != size)
        return 0;
    switch (kind) {
    case K_BOOL: return fmt[0] == '?';
    case K_FLOAT: return fmt[0] == (size == 4 ? 'f' : 'd');
    default: return strchr("bhilqn", fmt[0]) != NULL;
    }
}

/* Take `obj` as a C-contiguous array of `ndim` dimensions whose elements are `kind` of `size` bytes
 * (writable if `writable`); on failure set TypeError/ValueError naming `fn` and `name` and return NULL. */
static Py_buffer *take(bufs_t *b, PyObject *obj, const char *fn, const char *name, enum kind kind, Py_ssize_t size,
                       int ndim, int writable) {
    Py_buffer *v = &b->view[b->n];
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be an array of %s, not %.100s", fn, name, kind_name(kind, size),
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, v, flags) < 0) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *why = value ? PyObject_Str(value) : NULL;
        PyErr_Clear();
        if (why)
            PyErr_Format(PyExc_ValueError, "%s: %s must be a C-contiguous%s %s array (%U)", fn, name,
                         writable ? ", writable" : "", kind_name(kind, size), why);
        else
            PyErr_Format(PyExc_ValueError, "%s: %s must be a C-contiguous%s %s array", fn, name,
                         writable ? ", writable" : "", kind_name(kind, size));
        Py_XDECREF(why);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return NULL;
    }
    b->name[b->n] = name;
    b->writable[b->n] = writable;
    b->n++;
    if (!format_is(v->format, v->itemsize, kind, size)) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be %s, got an array of format '%s' (%zd-byte items)", fn, name,
                     kind_name(kind, size), v->format ? v->format : "B", v->itemsize);
        return NULL;
    }
    if (v->ndim != ndim) {
        PyErr_Format(PyExc_ValueError, "%s: %s must have %d dimension%s, got %d", fn, name, ndim, ndim == 1 ? "" : "s",
                     v->ndim);
        return NULL;
    }
    return v;
}

#define DIM(v, i) ((v)->shape[i])

/* 1 when no array the kernel writes shares memory with another argument (the kernels read their
 * inputs after writing outputs, and take them as restrict); else ValueError naming the two. */
static int disjoint(const bufs_t *b, const char *fn) {
    for (int i = 0; i < b->n; i++) {
        if (!b->writable[i] || b->view[i].len == 0)
            continue;
        const char *lo = b->view[i].buf, *hi = lo + b->view[i].len;
        for (int j = 0; j < b->n; j++) {
            if (j == i || b->view[j].len == 0)
                continue;
            const char *lo2 = b->view[j].buf, *hi2 = lo2 + b->view[j].len;
            if (lo < hi2 && lo2 < hi) {
                PyErr_Format(PyExc_ValueError, "%s: %s and %s share memory (each must be an array of its own)", fn,
                             b->name[j < i ? j : i], b->name[j < i ? i : j]);
                return 0;
            }
        }
    }
    return 1;
}

static int need(int ok, const char *fn, const char *what) {
    if (!ok)
        PyErr_Format(PyExc_ValueError, "%s: %s", fn, what);
    return ok;
}

/* ------------------------------------------------------------------------------------------------
 * rows_ok */

/* One row's slots, 0 when bad: ids in range and distinct, weights NaN or finite and >= 0 (IEEE
 * comparisons, as Numba's: NaN compares false, -0.0 is not < 0, a subnormal is > 0), all NaN or
 * none, and in rank order when by_rank. Without a branch per check (k is small; a valid row reads
 * every slot anyway). */
static inline __attribute__((always_inline)) int slots_ok(const int32_t *ex, const float *wt, Py_ssize_t k, int64_t n_expert, int by_rank) {
    int bad = 0;
    Py_ssize_t n_nan = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        const int64_t e = ex[j];
        bad |= (e < 0) | (e >= n_expert);
        for (Py_ssize_t i = 0; i < j; i++)
            bad |= ex[i] == e;
        const float w = wt[j];
        n_nan += isnan(w) != 0;
        bad |= (w < 0) | (w == INFINITY); /* both false for NaN; -inf < 0 */
        if (j > 0)
            bad |= by_rank & (w > wt[j - 1]);
    }
    bad |= (n_nan != 0) & (n_nan != k);
    return !bad;
}

/* Rows are checked in blocks, each row's checks or-ed into one flag without a branch per check
 * (a valid part, the case to be fast, is read to its end anyway); the answer is the same boolean
 * as the Numba kernel's early returns. */
#define ROWS_BLOCK 4096

/* One row's checks at top-1, against the row before it (b0, l0, s0, p0): the same flag as the
 * general loop's for k == 1, in 32-bit arithmetic (every value but n_expert is at most 32 bits wide). */
static inline __attribute__((always_inline)) int row_bad_k1(int32_t b, int32_t lay, int32_t s, int32_t p, int32_t e, float w,
                                               int32_t b0, int32_t l0, int32_t s0, int32_t p0,
                                               const uint8_t *moe, uint32_t n_layer, int64_t n_expert) {
    const int in_range = (uint32_t)lay < n_layer;
    int bad = !in_range | !moe[in_range ? lay : 0];
    bad |= (uint32_t)p > 1;
    bad |= (b < b0) | ((b == b0) & ((lay < l0) | ((lay == l0) & (s <= s0)) | (p != p0)));
    bad |= (e < 0) | ((int64_t)e >= n_expert) | (w < 0) | (w == INFINITY); /* NaN passes both */
    return bad;
}

/* Top-1, the common case made fast: the first row against the previous part's last, then every
 * row against the one before it, without the general loop's per-row choice of predecessor. */
static int rows_ok_k1(const int32_t *batch, const int16_t *layer, const int32_t *step, const int8_t *phase,
                      const int32_t *experts, const float *weights, const uint8_t *moe, Py_ssize_t R,
                      Py_ssize_t n_layer, int64_t n_expert, int has_last, const int64_t *last) {
    if (R == 0)
        return 1;
    const uint32_t nl = (uint32_t)n_layer; /* <= UINT32_MAX: checked by the caller */
    int bad = 0;
    {
        const int64_t b = batch[0], lay = layer[0], s = step[0], p = phase[0];
        const int in_range = (uint64_t)lay < (uint64_t)n_layer;
        bad |= !in_range | !moe[in_range ? lay : 0];
        bad |= (uint64_t)p > 1;
        bad |= has_last & ((b < last[0]) | ((b == last[0]) & ((lay < last[1]) | ((lay == last[1]) & (s <= last[2])) |
                                                              (p != last[3]))));
        const int64_t e = experts[0];
        const float w = weights[0];
        bad |= (e < 0) | (e >= n_expert) | (w < 0) | (w == INFINITY);
    }
    for (Py_ssize_t r0 = 1; r0 < R && !bad; r0 += ROWS_BLOCK) {
        const Py_ssize_t r1 = r0 + ROWS_BLOCK < R ? r0 + ROWS_BLOCK : R;
        for (Py_ssize_t r = r0; r < r1; r++)
            bad |= row_bad_k1(batch[r], layer[r], step[r], phase[r], experts[r], weights[r], batch[r - 1], layer[r - 1],
                              step[r - 1], phase[r - 1], moe, nl, n_expert);
    }
    return !bad;
}

static int rows_ok_loop(const int32_t *batch, const int16_t *layer, const int32_t *step, const int8_t *phase,
                        const int32_t *experts, const float *weights, const uint8_t *moe, Py_ssize_t R, Py_ssize_t k,
                        Py_ssize_t n_layer, int64_t n_expert, int by_rank, int has_last, const int64_t *last) {
    if (k == 1 && (uint64_t)n_layer <= UINT32_MAX)
        return rows_ok_k1(batch, layer, step, phase, experts, weights, moe, R, n_layer, n_expert, has_last, last);
    for (Py_ssize_t r0 = 0; r0 < R; r0 += ROWS_BLOCK) {
        const Py_ssize_t r1 = r0 + ROWS_BLOCK < R ? r0 + ROWS_BLOCK : R;
        int bad = 0;
        for (Py_ssize_t r = r0; r < r1; r++) {
            const int64_t b = batch[r], lay = layer[r], s = step[r], p = phase[r];
            const int in_range = (uint64_t)lay < (uint64_t)n_layer;
            bad |= !in_range | !moe[in_range ? lay : 0];
            bad |= (uint64_t)p > 1;
            int64_t pb, pl, ps, pp;
            int ordered = 1; /* a row with a predecessor (the previous row, or the previous part's last) */
            if (r > 0) {
                pb = batch[r - 1], pl = layer[r - 1], ps = step[r - 1], pp = phase[r - 1];
            } else {
                pb = last[0], pl = last[1], ps = last[2], pp = last[3];
                ordered = has_last;
            }
            bad |= ordered & ((b < pb) | ((b == pb) & ((lay < pl) | ((lay == pl) & (s <= ps)) | (p != pp))));
            if (k == 1) {
                const int64_t e = experts[r];
                const float w = weights[r];
                bad |= (e < 0) | (e >= n_expert) | (w < 0) | (w == INFINITY); /* NaN passes both */
            } else {
                const int32_t *ex = experts + r * k;
                const float *wt = weights + r * k;
                switch (k) { /* the usual widths with k a constant: loops unrolled */
                case 2: bad |= !slots_ok(ex, wt, 2, n_expert, by_rank); break;
                case 4: bad |= !slots_ok(ex, wt, 4, n_expert, by_rank); break;
                case 6: bad |= !slots_ok(ex, wt, 6, n_expert, by_rank); break;
                case 8: bad |= !slots_ok(ex, wt, 8, n_expert, by_rank); break;
                default: bad |= !slots_ok(ex, wt, k, n_expert, by_rank);
                }
            }
        }
        if (bad)
            return 0;
    }
    return 1;
}

PyDoc_STRVAR(rows_ok_doc,
"rows_ok(batch, layer, step, phase, experts, weights, moe, n_expert, by_rank, has_last, last) -> bool\n\n"
"replay.load_kernel.rows_ok, compiled ahead of time. batch int32 [R], layer int16 [R], step int32 [R],\n"
"phase int8 [R], experts int32 [R, k], weights float32 [R, k], moe bool [n_layer], n_expert int,\n"
"by_rank and has_last truth values, last int64 [4] = (batch, layer, step, phase) of the previous part's\n"
"last row (read only when has_last).");

static PyObject *py_rows_ok(PyObject *self, PyObject *args) {
    (void)self;
    static const char *fn = "rows_ok";
    PyObject *o[7], *o_last;
    long long n_expert;
    int by_rank, has_last;
    if (!PyArg_ParseTuple(args, "OOOOOOOLppO:rows_ok", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &n_expert,
                          &by_rank, &has_last, &o_last))
        return NULL;
    bufs_t b = {.n = 0};
    Py_buffer *batch, *layer, *step, *phase, *experts, *weights, *moe, *last;
    if (!(batch = take(&b, o[0], fn, "batch", K_INT, 4, 1, 0)) || !(layer = take(&b, o[1], fn, "layer", K_INT, 2, 1, 0)) ||
        !(step = take(&b, o[2], fn, "step", K_INT, 4, 1, 0)) || !(phase = take(&b, o[3], fn, "phase", K_INT, 1, 1, 0)) ||
        !(experts = take(&b, o[4], fn, "experts", K_INT, 4, 2, 0)) ||
        !(weights = take(&b, o[5], fn, "weights", K_FLOAT, 4, 2, 0)) || !(moe = take(&b, o[6], fn, "moe", K_BOOL, 1, 1, 0)) ||
        !(last = take(&b, o_last, fn, "last", K_INT, 8, 1, 0)))
        goto fail;
    Py_ssize_t R = DIM(experts, 0), k = DIM(experts, 1);
    if (!need(DIM(batch, 0) == R && DIM(layer, 0) == R && DIM(step, 0) == R && DIM(phase, 0) == R, fn,
              "batch, layer, step and phase must have one element per row of experts") ||
        !need(DIM(weights, 0) == R && DIM(weights, 1) == k, fn, "weights must have the shape of experts") ||
        !need(DIM(last, 0) == 4, fn, "last must hold 4 values (batch, layer, step, phase)"))
        goto fail;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = rows_ok_loop(batch->buf, layer->buf, step->buf, phase->buf, experts->buf, weights->buf, moe->buf, R, k,
                      DIM(moe, 0), (int64_t)n_expert, by_rank, has_last, last->buf);
    Py_END_ALLOW_THREADS
    bufs_release(&b);
    return PyBool_FromLong(ok);
fail:
    bufs_release(&b);
    return NULL;
}

/* ------------------------------------------------------------------------------------------------
 * cut_loads */

typedef struct {
    const int32_t *turn, *batch, *step, *experts, *lidx_of;
    const int8_t *phase;
    const int16_t *layer;
    Py_ssize_t R, k, n_lay;
    int64_t n_expert;
    int32_t *entries, *load_lidx, *load_batch, *batch_turn, *batch_step, *batch_tokens;
    int64_t *load_start;
    int8_t *load_phase, *batch_phase;
} cut_t;

/* Status 0 ok, 1 a layer that is not a MoE layer, 2 an expert out of range, 3 batches out of order
 * (replay.load_kernel.CUT_*); the same row-by-row order of checks and writes as the Numba kernel.
 * Every pointer is copied to a restrict local first: the int8 outputs may alias anything as far as
 * C knows (char types), and without that every phase store reloaded the struct and the inputs. */
static int cut_loop(const cut_t *c, int64_t *n_loads, int64_t *n_batches) {
    const int32_t *restrict turn = c->turn, *restrict batch = c->batch, *restrict step = c->step;
    const int32_t *restrict experts = c->experts, *restrict lidx_of = c->lidx_of;
    const int8_t *restrict phase = c->phase;
    const int16_t *restrict layer = c->layer;
    int32_t *restrict entries = c->entries, *restrict load_lidx = c->load_lidx, *restrict load_batch = c->load_batch;
    int32_t *restrict batch_turn = c->batch_turn, *restrict batch_step = c->batch_step;
    int32_t *restrict batch_tokens = c->batch_tokens;
    int64_t *restrict load_start = c->load_start;
    int8_t *restrict load_phase = c->load_phase, *restrict batch_phase = c->batch_phase;
    const Py_ssize_t R = c->R, k = c->k, n_lay = c->n_lay;
    const int64_t n_expert = c->n_expert;
    int64_t G = 0, B = 0;
    /* The previous load's first row and batch, and that batch's most rows in a load so far, kept
     * here rather than read back from the outputs; batch_tokens[prev_batch] is written when it
     * grows (on every way out, so the outputs hold what the Numba kernel's do, errors included). */
    int64_t prev_start = 0, prev_batch = 0, prev_tokens = 0;
    int32_t last_b = 0;
    int16_t last_lay = 0;
    int status = 0;
    for (Py_ssize_t r = 0; r < R; r++) {
        const int16_t lay16 = layer[r];
        const int64_t lay = lay16;
        if (lay < 0 || lay >= n_lay || lidx_of[lay] < 0) {
            status = 1;
            break;
        }
        const int64_t li = lidx_of[lay];
        const int32_t b = batch[r];
        const int new_batch = r == 0 || b != last_b;
        if (r > 0 && b < last_b) {
            status = 3;
            break;
        }
        if (new_batch || lay16 != last_lay) {
            if (G > 0) {
                const int64_t rows = r - prev_start;
                if (rows > prev_tokens) {
                    prev_tokens = rows;
                    batch_tokens[prev_batch] = (int32_t)rows;
                }
            }
            if (new_batch) {
                batch_turn[B] = turn[r];
                batch_step[B] = step[r];
                batch_phase[B] = phase[r];
                batch_tokens[B] = 0;
                B++;
                prev_tokens = 0;
            }
            load_start[G] = r;
            load_lidx[G] = (int32_t)li;
            load_phase[G] = phase[r];
            load_batch[G] = (int32_t)(B - 1);
            prev_start = r;
            prev_batch = B - 1;
            G++;
        }
        last_b = b;
        last_lay = lay16;
        const int32_t *ex = experts + r * k;
        int32_t *out = entries + r * k;
        for (Py_ssize_t j = 0; j < k; j++) {
            const int64_t e = ex[j];
            if (e < 0 || e >= n_expert) {
                status = 2;
                break;
            }
            out[j] = (int32_t)(li * n_expert + e);
        }
        if (status)
            break;
    }
    if (status)
        return status;
    if (G > 0) {
        const int64_t rows = R - prev_start;
        if (rows > prev_tokens)
            batch_tokens[prev_batch] = (int32_t)rows;
    }
    load_start[G] = R;
    *n_loads = G;
    *n_batches = B;
    return 0;
}

PyDoc_STRVAR(cut_loads_doc,
"cut_loads(turn, batch, phase, step, layer, experts, lidx_of, n_expert, entries, load_start, load_lidx,\n"
"          load_phase, load_batch, batch_turn, batch_step, batch_phase, batch_tokens) -> (status, loads, batches)\n\n"
"replay.load_kernel.cut_loads, compiled ahead of time. Inputs: turn int32 [R], batch int32 [R],\n"
"phase int8 [R], step int32 [R], layer int16 [R], experts int32 [R, k], lidx_of int32 [layers],\n"
"n_expert int. Outputs, each with room for one load and one batch per row: entries int32 [>= R, k],\n"
"load_start int64 [>= R + 1], load_lidx int32, load_phase int8, load_batch int32, batch_turn int32,\n"
"batch_step int32, batch_phase int8, batch_tokens int32 (each [>= R]). status 0 ok, 1 a layer that is\n"
"not a MoE layer, 2 an expert id out of range, 3 batches out of order (then loads = batches = 0).");

static PyObject *py_cut_loads(PyObject *self, PyObject *args) {
    (void)self;
    static const char *fn = "cut_loads";
    PyObject *o[17];
    long long n_expert;
    if (!PyArg_ParseTuple(args, "OOOOOOOLOOOOOOOOO:cut_loads", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &n_expert,
                          &o[7], &o[8], &o[9], &o[10], &o[11], &o[12], &o[13], &o[14], &o[15]))
        return NULL;
    bufs_t b = {.n = 0};
    Py_buffer *turn, *batch, *phase, *step, *layer, *experts, *lidx_of, *entries, *load_start, *load_lidx, *load_phase,
        *load_batch, *batch_turn, *batch_step, *batch_phase, *batch_tokens;
    if (!(turn = take(&b, o[0], fn, "turn", K_INT, 4, 1, 0)) || !(batch = take(&b, o[1], fn, "batch", K_INT, 4, 1, 0)) ||
        !(phase = take(&b, o[2], fn, "phase", K_INT, 1, 1, 0)) || !(step = take(&b, o[3], fn, "step", K_INT, 4, 1, 0)) ||
        !(layer = take(&b, o[4], fn, "layer", K_INT, 2, 1, 0)) ||
        !(experts = take(&b, o[5], fn, "experts", K_INT, 4, 2, 0)) ||
        !(lidx_of = take(&b, o[6], fn, "lidx_of", K_INT, 4, 1, 0)) ||
        !(entries = take(&b, o[7], fn, "entries", K_INT, 4, 2, 1)) ||
        !(load_start = take(&b, o[8], fn, "load_start", K_INT, 8, 1, 1)) ||
        !(load_lidx = take(&b, o[9], fn, "load_lidx", K_INT, 4, 1, 1)) ||
        !(load_phase = take(&b, o[10], fn, "load_phase", K_INT, 1, 1, 1)) ||
        !(load_batch = take(&b, o[11], fn, "load_batch", K_INT, 4, 1, 1)) ||
        !(batch_turn = take(&b, o[12], fn, "batch_turn", K_INT, 4, 1, 1)) ||
        !(batch_step = take(&b, o[13], fn, "batch_step", K_INT, 4, 1, 1)) ||
        !(batch_phase = take(&b, o[14], fn, "batch_phase", K_INT, 1, 1, 1)) ||
        !(batch_tokens = take(&b, o[15], fn, "batch_tokens", K_INT, 4, 1, 1)))
        goto fail;
    if (!disjoint(&b, fn))
        goto fail;
    Py_ssize_t R = DIM(experts, 0), k = DIM(experts, 1);
    if (!need(DIM(turn, 0) == R && DIM(batch, 0) == R && DIM(phase, 0) == R && DIM(step, 0) == R && DIM(layer, 0) == R,
              fn, "turn, batch, phase, step and layer must have one element per row of experts") ||
        !need(DIM(entries, 0) >= R && DIM(entries, 1) == k, fn, "entries must have at least the rows of experts and its width") ||
        !need(DIM(load_start, 0) >= R + 1, fn, "load_start must have room for one more than the rows of experts") ||
        !need(DIM(load_lidx, 0) >= R && DIM(load_phase, 0) >= R && DIM(load_batch, 0) >= R, fn,
              "load_lidx, load_phase and load_batch must have room for one load per row of experts") ||
        !need(DIM(batch_turn, 0) >= R && DIM(batch_step, 0) >= R && DIM(batch_phase, 0) >= R && DIM(batch_tokens, 0) >= R,
              fn, "batch_turn, batch_step, batch_phase and batch_tokens must have room for one batch per row of experts"))
        goto fail;
    cut_t c = {
        .turn = turn->buf, .batch = batch->buf, .step = step->buf, .experts = experts->buf, .lidx_of = lidx_of->buf,
        .phase = phase->buf, .layer = layer->buf, .R = R, .k = k, .n_lay = DIM(lidx_of, 0), .n_expert = (int64_t)n_expert,
        .entries = entries->buf, .load_lidx = load_lidx->buf, .load_batch = load_batch->buf, .batch_turn = batch_turn->buf,
        .batch_step = batch_step->buf, .batch_tokens = batch_tokens->buf, .load_start = load_start->buf,
        .load_phase = load_phase->buf, .batch_phase = batch_phase->buf,
    };
    int64_t G = 0, B = 0;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = cut_loop(&c, &G, &B);
    Py_END_ALLOW_THREADS
    bufs_release(&b);
    return Py_BuildValue("(iLL)", status, (long long)G, (long long)B);
fail:
    bufs_release(&b);
    return NULL;
}

/* ------------------------------------------------------------------------------------------------
 * replay_lru */

typedef struct {
    const int32_t *entries, *load_lidx, *load_batch;
    const int64_t *load_start, *layer_info, *opts;
    const int8_t *load_phase;
    int32_t *ent, *ps;
    int64_t *grp, *acc, *bacc, *stats;
    Py_ssize_t R, k, n_load, li_rows, C, n_grp, ps_len, acc1, n_batch;
} lru_t;

enum lru_err {
    E_OK = 0, E_LOAD_START, E_LOAD_LIDX, E_GROUP, E_PHASE, E_BATCH, E_ENTRY, E_LINK, E_CYCLE, E_ROW_LAYER, E_ROW_EXPERT,
    E_ROW_ORDER,
};

static const char *lru_err_text[] = {
    "",
    "load_start must be non-decreasing from >= 0 to at most the rows of entries",
    "load_lidx names a layer outside layer_info's rows or acc's second axis",
    "layer_info names an eviction group outside grp's rows",
    "load_phase must be 0 or 1 (or within acc's first axis)",
    "load_batch names a batch outside bacc's rows",
    "entries names an entry outside ent's columns",
    "ps holds a list link outside the entries (it is not replay.policies.lru's state for this ent)",
    "ps holds a list with a cycle (it is not replay.policies.lru's state for this ent)",
    "a row routes at a layer lidx_of does not map to a MoE layer",
    "a row names an expert outside 0..n_expert-1",
    "batches out of order (a row's batch below the row before it)",
};

/* The lru hooks (replay/policies/lru.py), on ps = entry pairs, then group pairs counted backwards
 * from the end (gp points at group g's pair). Links are checked once, before the replay
 * (lru_links_ok): every link is none (< 0) or an entry < C; the hooks only ever write such values
 * (an entry id checked against C, or another link), so that stays true and no link needs a check
 * when it is followed. */

static inline void lru_unlink(int32_t *ps, int32_t *gp, uint32_t e) {
    int32_t p = ps[2 * (size_t)e + PREV], q = ps[2 * (size_t)e + NEXT];
    if (p >= 0)
        ps[2 * (size_t)p + NEXT] = q;
    else
        gp[HEAD] = q;
    if (q >= 0)
        ps[2 * (size_t)q + PREV] = p;
    else
        gp[TAIL] = p;
}

static inline void lru_append(int32_t *ps, int32_t *gp, uint32_t e) {
    int32_t t = gp[TAIL];
    ps[2 * (size_t)e + PREV] = t;
    ps[2 * (size_t)e + NEXT] = -1;
    if (t >= 0)
        ps[2 * (size_t)t + NEXT] = (int32_t)e;
    else
        gp[HEAD] = (int32_t)e;
    gp[TAIL] = (int32_t)e;
}

static inline void lru_touch(int32_t *ps, int32_t *gp, uint32_t e) {
    if (gp[TAIL] != (int32_t)e) { /* already the most recent: nothing to move */
        lru_unlink(ps, gp, e);
        lru_append(ps, gp, e);
    }
}

/* The eviction step of one load, in group gp: victims from the least recent end, never an entry
 * this load touched (they all sit at the tail, so the walk from the head stops early), until *used
 * fits `budget`. Returns 0 when the walk finds a cycle (ps is not a list). Inlined: a call per
 * load (arguments on the stack, results through memory) measured slower than the stack reloads
 * an inlined victim search pays, in the top-1 trace where each load evicts about one entry. */
static inline __attribute__((always_inline)) int lru_evict(int32_t *ps, int32_t *gp, const int32_t *pin, int32_t *res,
                                               const int32_t *bytes, int64_t load, int64_t *used, int64_t budget,
                                               Py_ssize_t C, int64_t *n_gone, int64_t *n_over) {
    int64_t left = *used, gone = 0;
    while (left > budget) {
        int32_t v = gp[HEAD];
        Py_ssize_t steps = 0;
        while (v >= 0 && (int64_t)pin[v] == load) {
            if (++steps > C)
                return 0;
            v = ps[2 * (size_t)v + NEXT];
        }
        if (v < 0) {
            (*n_over)++; /* everything left was touched by this load */
            break;
        }
        lru_unlink(ps, gp, (uint32_t)v);
        res[v] = 0;
        left -= bytes[v];
        gone++;
    }
    *used = left;
    *n_gone = gone;
    return 1;
}

/* One routed slot of load `load` looking up entry e: a repeat inside the load is only promoted;
 * else one lookup, a hit (promoted) or a miss (admitted at the most recent end). */
static inline __attribute__((always_inline)) void lru_lookup(int32_t *ps, int32_t *gp, int32_t *pin, int32_t *res, uint32_t e,
                                                int64_t load, int64_t *n_look, int64_t *n_hit) {
    if ((int64_t)pin[e] == load) { /* a repeat inside this load: already looked up, only promoted */
        lru_touch(ps, gp, e);
        return;
    }
    (*n_look)++;
    pin[e] = (int32_t)load;
    if (res[e] == 1) {
        (*n_hit)++;
        lru_touch(ps, gp, e);
    } else {
        res[e] = 1;
        lru_append(ps, gp, e);
    }
}

/* After a load's lookups: its misses' bytes join its group `gr`, then eviction, once, in that group,
 * until it fits; never an entry this load touched (they all sit at the tail, so the walk from the
 * head stops early). Returns 0 when the walk finds a cycle. */
static inline __attribute__((always_inline)) int lru_fit(int32_t *ps, int32_t *gp, const int32_t *pin, int32_t *res,
                                            const int32_t *bytes, int64_t *gr, int64_t load, int64_t n_miss,
                                            int64_t n_read, Py_ssize_t C, int64_t *resident, int64_t *peak,
                                            int64_t *n_evict, int64_t *n_over) {
    const int64_t used0 = gr[GRP_USED];
    int64_t used = used0 + n_read;
    int64_t n_gone = 0;
    if (used > gr[GRP_BUDGET]) {
        if (!lru_evict(ps, gp, pin, res, bytes, load, &used, gr[GRP_BUDGET], C, &n_gone, n_over))
            return 0;
    }
    gr[GRP_USED] = used;
    *resident += used - used0;
    if (*resident > *peak)
        *peak = *resident;
    gr[GRP_COUNT] += n_miss - n_gone;
    *n_evict += n_gone;
    return 1;
}

static int entries_ok(const int32_t *e, int64_t n, Py_ssize_t C) {
    uint32_t most = 0; /* as unsigned: a negative id is larger than any C */
    for (int64_t i = 0; i < n; i++)
        most = (uint32_t)e[i] > most ? (uint32_t)e[i] : most;
    return n == 0 || (uint64_t)most < (uint64_t)C;
}

static int lru_links_ok(const int32_t *ps, Py_ssize_t ps_len, Py_ssize_t C, Py_ssize_t n_grp) {
    for (Py_ssize_t i = 0; i < 2 * C; i++)
        if (ps[i] >= C)
            return 0;
    for (Py_ssize_t i = ps_len - 2 * n_grp; i < ps_len; i++)
        if (ps[i] >= C)
            return 0;
    return 1;
}

/* Before a replay (replay_lru and replay_lru_rows alike): the bytes resident now, where the peak
 * starts; the policy's list links and each layer's group checked once. E_OK or the error. */
static int lru_begin(const int32_t *ps, Py_ssize_t ps_len, Py_ssize_t C, const int64_t *grp, Py_ssize_t n_grp,
                     const int64_t *layer_info, Py_ssize_t li_rows, int64_t *resident) {
    *resident = 0;
    for (Py_ssize_t g0 = 0; g0 < n_grp; g0++)
        *resident += grp[g0 * N_GRP + GRP_USED];
    if (!lru_links_ok(ps, ps_len, C, n_grp))
        return E_LINK;
    for (Py_ssize_t l = 0; l < li_rows; l++) /* every layer's group, once, not once per load */
        if ((uint64_t)layer_info[2 * l] >= (uint64_t)n_grp)
            return E_GROUP;
    return E_OK;
}

/* After a replay: the stats it writes (one tick per routed slot: a plain replay drops none). */
static void lru_end(int64_t *stats, const int64_t *opts, int64_t slots, int64_t peak, int64_t n_evict, int64_t n_over) {
    stats[STAT_TICKS] = opts[OPT_TICK0] + slots;
    stats[STAT_PEAK_BYTES] = peak;
    stats[STAT_EVICTIONS] += n_evict;
    stats[STAT_OVERFLOW] += n_over;
}

static int lru_loop(const lru_t *a) {
    /* The shapes checked by the caller make grp's rows N_GRP wide, acc [2, acc1, N_ACC], bacc's rows
     * N_ACC and layer_info's rows 2: constant strides, fewer values live in the load loop. */
    const Py_ssize_t k = a->k, C = a->C, R = a->R, n_load = a->n_load;
    const int32_t *entries = a->entries;
    const int64_t *load_start = a->load_start, *layer_info = a->layer_info;
    const int32_t *load_lidx = a->load_lidx, *load_batch = a->load_batch;
    const int8_t *load_phase = a->load_phase;
    int32_t *ps = a->ps;
    int32_t *gp0 = ps + a->ps_len - 2; /* group g's pair: gp0 - 2 g */
    int32_t *res = a->ent + (size_t)ENT_RESIDENT * C;
    int32_t *pin = a->ent + (size_t)ENT_PIN * C;
    const int32_t *bytes = a->ent + (size_t)ENT_BYTES * C;
    int64_t *grp = a->grp, *acc = a->acc, *bacc = a->bacc;
    const uint64_t n_lid = (uint64_t)(a->li_rows < a->acc1 ? a->li_rows : a->acc1);
    const uint64_t n_batch = (uint64_t)a->n_batch;
    const int64_t acc_phase = (int64_t)a->acc1 * N_ACC; /* acc[1] - acc[0] */
    const int64_t load0 = a->opts[OPT_LOAD0];
    int64_t n_evict = 0, n_over = 0;
    int64_t cur_b = -1, b_look = 0, b_hit = 0, b_read = 0;
    int64_t resident;
    const int err = lru_begin(ps, a->ps_len, C, grp, a->n_grp, layer_info, a->li_rows, &resident);
    if (err)
        return err;
    int64_t peak = resident;
    /* Rows the loads cover: [first, last); a load's rows are checked to lie inside, and every
     * entry id there is checked once, here (a vectorized pass over a few MB), not once per slot. */
    const int64_t first = n_load > 0 ? load_start[0] : 0, last = n_load > 0 ? load_start[n_load] : 0;
    if (first < 0 || last < first || last > R)
        return E_LOAD_START;
    if (!entries_ok(entries + first * k, (last - first) * k, C))
        return E_ENTRY;
    for (Py_ssize_t li = 0; li < n_load; li++) {
        const int64_t lo = load_start[li], hi = load_start[li + 1];
        if (hi == lo)
            continue;
        if ((uint64_t)(hi - lo) > (uint64_t)(last - lo)) /* hi < lo or hi > last (lo <= last: the previous hi) */
            return E_LOAD_START;
        const int64_t load = li + load0;
        const int64_t lid = load_lidx[li];
        if ((uint64_t)lid >= n_lid)
            return E_LOAD_LIDX;
        const int64_t g = layer_info[2 * lid];
        int32_t *gp = gp0 - 2 * g;
        int64_t n_look = 0, n_hit = 0;
        const int32_t *row = entries + lo * k;
        const int32_t *end = entries + hi * k;
        for (; row < end; row++)
            lru_lookup(ps, gp, pin, res, (uint32_t)*row, load, &n_look, &n_hit); /* < C: checked by entries_ok */
        const int64_t n_miss = n_look - n_hit;
        const int64_t n_read = n_miss * layer_info[2 * lid + 1];
        const int64_t ph = load_phase[li];
        if ((uint64_t)ph > 1)
            return E_PHASE;
        int64_t *ac = acc + ph * acc_phase + lid * N_ACC;
        ac[ACC_LOOKUPS] += n_look;
        ac[ACC_HITS] += n_hit;
        ac[ACC_READ] += n_read;
        const int64_t b = load_batch[li];
        if (b != cur_b) { /* a batch's loads are consecutive: its totals are flushed once */
            if ((uint64_t)b >= n_batch)
                return E_BATCH;
            if (cur_b >= 0) {
                int64_t *bc = bacc + cur_b * N_ACC;
                bc[ACC_LOOKUPS] += b_look;
                bc[ACC_HITS] += b_hit;
                bc[ACC_READ] += b_read;
            }
            cur_b = b;
            b_look = b_hit = b_read = 0;
        }
        b_look += n_look;
        b_hit += n_hit;
        b_read += n_read;
        if (!lru_fit(ps, gp, pin, res, bytes, grp + g * N_GRP, load, n_miss, n_read, C, &resident, &peak, &n_evict, &n_over))
            return E_CYCLE;
    }
    if (cur_b >= 0) {
        int64_t *bc = bacc + cur_b * N_ACC;
        bc[ACC_LOOKUPS] += b_look;
        bc[ACC_HITS] += b_hit;
        bc[ACC_READ] += b_read;
    }
    /* An empty load adds no tick. */
    lru_end(a->stats, a->opts, n_load > 0 ? (load_start[n_load] - load_start[0]) * k : 0, peak, n_evict, n_over);
    return E_OK;
}

PyDoc_STRVAR(replay_lru_doc,
"replay_lru(entries, load_start, load_lidx, load_phase, load_batch, layer_info, ent, grp, ps, acc, bacc,\n"
"           stats, opts) -> None\n\n"
"The replay driver (replay.cache_kernel) for the lru hooks, plain (no what-ifs, no per-slot codes):\n"
"the policies `lru` (one group) and `layer` (one group per MoE layer). The arguments of the Numba\n"
"driver without next_load, slot_out, drop and pred: entries int32 [R, k], load_start int64 [G + 1],\n"
"load_lidx int32 [G], load_phase int8 [G], load_batch int32 [G], layer_info int64 [L, 2],\n"
"ent int32 [14, C], grp int64 [groups, 5], ps int32 [2 (C + groups)] (replay.policies.lru.init),\n"
"acc int64 [2, L, 7], bacc int64 [B, 7], stats int64 [12], opts int64 [8] (OPT_TICK0, OPT_LOAD0 read).\n"
"Writes ent, grp, ps, acc, bacc and stats exactly as the Numba kernel does.");

/* The replay state's arguments, common to replay_lru and replay_lru_rows: layer_info, ent, grp,
 * ps, acc, stats, opts (objects o[0..6]), taken and their shapes checked. 0 with an exception set
 * on failure (the caller releases b). */
typedef struct {
    Py_buffer *layer_info, *ent, *grp, *ps, *acc, *stats, *opts;
} state_args_t;

static int take_state(bufs_t *b, PyObject *const *o, const char *fn, state_args_t *st) {
    if (!(st->layer_info = take(b, o[0], fn, "layer_info", K_INT, 8, 2, 0)) ||
        !(st->ent = take(b, o[1], fn, "ent", K_INT, 4, 2, 1)) || !(st->grp = take(b, o[2], fn, "grp", K_INT, 8, 2, 1)) ||
        !(st->ps = take(b, o[3], fn, "ps", K_INT, 4, 1, 1)) || !(st->acc = take(b, o[4], fn, "acc", K_INT, 8, 3, 1)) ||
        !(st->stats = take(b, o[5], fn, "stats", K_INT, 8, 1, 1)) || !(st->opts = take(b, o[6], fn, "opts", K_INT, 8, 1, 0)))
        return 0;
    const Py_ssize_t C = DIM(st->ent, 1), n_grp = DIM(st->grp, 0);
    return need(DIM(st->layer_info, 1) == 2, fn, "layer_info must have 2 columns (eviction group, bytes of one entry)") &&
           need(DIM(st->ent, 0) == N_ENT, fn, "ent must have 14 rows (replay.cache_state.N_ENT fields)") &&
           need(C < INT32_MAX, fn, "ent has more columns than int32 entry ids") &&
           need(DIM(st->grp, 1) == N_GRP, fn, "grp must have 5 columns (replay.cache_state.N_GRP)") &&
           need(DIM(st->ps, 0) >= 2 * (C + n_grp), fn, "ps must hold 2 x (entries + groups) links (replay.policies.lru.init)") &&
           need(DIM(st->acc, 0) == 2 && DIM(st->acc, 2) == N_ACC, fn, "acc must have the shape [2, layers, 7]") &&
           need(DIM(st->stats, 0) == N_STATS, fn, "stats must hold 12 values (replay.cache_kernel.N_STATS)") &&
           need(DIM(st->opts, 0) == N_OPTS, fn, "opts must hold 8 values (replay.cache_kernel.N_OPTS)");
}

static PyObject *py_replay_lru(PyObject *self, PyObject *args) {
    (void)self;
    static const char *fn = "replay_lru";
    PyObject *o[13];
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOO:replay_lru", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8],
                          &o[9], &o[10], &o[11], &o[12]))
        return NULL;
    bufs_t b = {.n = 0};
    Py_buffer *entries, *load_start, *load_lidx, *load_phase, *load_batch, *bacc;
    state_args_t st;
    PyObject *state_objs[7] = {o[5], o[6], o[7], o[8], o[9], o[11], o[12]};
    if (!(entries = take(&b, o[0], fn, "entries", K_INT, 4, 2, 0)) ||
        !(load_start = take(&b, o[1], fn, "load_start", K_INT, 8, 1, 0)) ||
        !(load_lidx = take(&b, o[2], fn, "load_lidx", K_INT, 4, 1, 0)) ||
        !(load_phase = take(&b, o[3], fn, "load_phase", K_INT, 1, 1, 0)) ||
        !(load_batch = take(&b, o[4], fn, "load_batch", K_INT, 4, 1, 0)) ||
        !(bacc = take(&b, o[10], fn, "bacc", K_INT, 8, 2, 1)) || !take_state(&b, state_objs, fn, &st))
        goto fail;
    if (!disjoint(&b, fn))
        goto fail;
    Py_ssize_t n_load = DIM(load_start, 0) - 1;
    if (!need(n_load < 0 || (DIM(load_lidx, 0) >= n_load && DIM(load_phase, 0) >= n_load && DIM(load_batch, 0) >= n_load),
              fn, "load_lidx, load_phase and load_batch must have one element per load (load_start's length - 1)") ||
        !need(DIM(bacc, 1) == N_ACC, fn, "bacc must have the shape [batches, 7]"))
        goto fail;
    lru_t a = {
        .entries = entries->buf, .load_lidx = load_lidx->buf, .load_batch = load_batch->buf, .load_start = load_start->buf,
        .layer_info = st.layer_info->buf, .opts = st.opts->buf, .load_phase = load_phase->buf, .ent = st.ent->buf,
        .ps = st.ps->buf, .grp = st.grp->buf, .acc = st.acc->buf, .bacc = bacc->buf, .stats = st.stats->buf,
        .R = DIM(entries, 0), .k = DIM(entries, 1), .n_load = n_load, .li_rows = DIM(st.layer_info, 0), .C = DIM(st.ent, 1),
        .n_grp = DIM(st.grp, 0), .ps_len = DIM(st.ps, 0), .acc1 = DIM(st.acc, 1), .n_batch = DIM(bacc, 0),
    };
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = lru_loop(&a);
    Py_END_ALLOW_THREADS
    bufs_release(&b);
    if (err) {
        PyErr_Format(PyExc_ValueError, "%s: %s", fn, lru_err_text[err]);
        return NULL;
    }
    Py_RETURN_NONE;
fail:
    bufs_release(&b);
    return NULL;
}

/* ------------------------------------------------------------------------------------------------ */

/* ------------------------------------------------------------------------------------------------
 * replay_lru_rows: cut_loads and replay_lru in one pass over the rows */

typedef struct {
    const int32_t *batch, *experts, *lidx_of;
    const int8_t *phase;
    const int16_t *layer;
    const int64_t *layer_info, *opts;
    int32_t *ent, *ps;
    int64_t *grp, *acc, *stats;
    Py_ssize_t R, k, n_lay, li_rows, C, n_grp, ps_len, acc1;
    int64_t n_expert;
} lru_rows_t;

/* The loads are the runs of equal (batch, layer), as cut_loads cuts them: a load's phase is its
 * first row's, its entries lidx_of[layer] * n_expert + expert; each load is replayed as lru_loop
 * replays it (the same hooks, the same order of writes), without the per-batch totals. Rows are
 * checked as cut_loads checks them (a MoE layer, an expert in range, batches in order), and each
 * entry id against C, before it is used. */
static int lru_rows_loop(const lru_rows_t *a, int64_t *n_loads) {
    const Py_ssize_t k = a->k, C = a->C, R = a->R;
    const int32_t *batch = a->batch, *experts = a->experts, *lidx_of = a->lidx_of;
    const int8_t *phase = a->phase;
    const int16_t *layer = a->layer;
    const int64_t *layer_info = a->layer_info;
    int32_t *ps = a->ps;
    int32_t *gp0 = ps + a->ps_len - 2;
    int32_t *res = a->ent + (size_t)ENT_RESIDENT * C;
    int32_t *pin = a->ent + (size_t)ENT_PIN * C;
    const int32_t *bytes = a->ent + (size_t)ENT_BYTES * C;
    int64_t *grp = a->grp, *acc = a->acc;
    const uint64_t n_lid = (uint64_t)(a->li_rows < a->acc1 ? a->li_rows : a->acc1);
    const int64_t acc_phase = (int64_t)a->acc1 * N_ACC;
    const int64_t load0 = a->opts[OPT_LOAD0], n_expert = a->n_expert;
    int64_t n_evict = 0, n_over = 0, resident;
    const int err = lru_begin(ps, a->ps_len, C, grp, a->n_grp, layer_info, a->li_rows, &resident);
    if (err)
        return err;
    int64_t peak = resident;
    int64_t load = load0;
    Py_ssize_t r = 0;
    while (r < R) {
        const int32_t b = batch[r];
        const int16_t lay16 = layer[r];
        if (lay16 < 0 || lay16 >= a->n_lay || lidx_of[lay16] < 0)
            return E_ROW_LAYER;
        if (r > 0 && b < batch[r - 1])
            return E_ROW_ORDER;
        const int64_t lid = lidx_of[lay16];
        if ((uint64_t)lid >= n_lid)
            return E_LOAD_LIDX;
        const int64_t ph = phase[r];
        if ((uint64_t)ph > 1)
            return E_PHASE;
        const int64_t g = layer_info[2 * lid];
        int32_t *gp = gp0 - 2 * g;
        const int64_t base = lid * n_expert;
        int64_t n_look = 0, n_hit = 0;
        do {
            const int32_t *ex = experts + r * k;
            for (Py_ssize_t j = 0; j < k; j++) {
                const int64_t e = ex[j];
                if (e < 0 || e >= n_expert)
                    return E_ROW_EXPERT;
                if (base + e >= C)
                    return E_ENTRY;
                lru_lookup(ps, gp, pin, res, (uint32_t)(base + e), load, &n_look, &n_hit);
            }
            r++;
        } while (r < R && batch[r] == b && layer[r] == lay16);
        const int64_t n_miss = n_look - n_hit;
        const int64_t n_read = n_miss * layer_info[2 * lid + 1];
        int64_t *ac = acc + ph * acc_phase + lid * N_ACC;
        ac[ACC_LOOKUPS] += n_look;
        ac[ACC_HITS] += n_hit;
        ac[ACC_READ] += n_read;
        if (!lru_fit(ps, gp, pin, res, bytes, grp + g * N_GRP, load, n_miss, n_read, C, &resident, &peak, &n_evict, &n_over))
            return E_CYCLE;
        load++;
    }
    lru_end(a->stats, a->opts, (int64_t)R * k, peak, n_evict, n_over);
    *n_loads = load - load0;
    return E_OK;
}

PyDoc_STRVAR(replay_lru_rows_doc,
"replay_lru_rows(batch, phase, layer, experts, lidx_of, n_expert, layer_info, ent, grp, ps, acc, stats, opts) -> loads\n\n"
"cut_loads on the rows, then replay_lru on its loads, in one pass and without the per-batch totals\n"
"(bacc): batch int32 [R], phase int8 [R], layer int16 [R], experts int32 [R, k], lidx_of int32 [layers],\n"
"n_expert int; then replay_lru's layer_info, ent, grp, ps, acc, stats and opts (OPT_TICK0, OPT_LOAD0 read).\n"
"Writes ent, grp, ps, acc and stats as those two calls do; returns the number of loads. A row cut_loads\n"
"refuses raises ValueError (the state is then garbage, as with replay_lru).");

static PyObject *py_replay_lru_rows(PyObject *self, PyObject *args) {
    (void)self;
    static const char *fn = "replay_lru_rows";
    PyObject *o[12];
    long long n_expert;
    if (!PyArg_ParseTuple(args, "OOOOOLOOOOOOO:replay_lru_rows", &o[0], &o[1], &o[2], &o[3], &o[4], &n_expert, &o[5], &o[6],
                          &o[7], &o[8], &o[9], &o[10], &o[11]))
        return NULL;
    bufs_t b = {.n = 0};
    Py_buffer *batch, *phase, *layer, *experts, *lidx_of;
    state_args_t st;
    if (!(batch = take(&b, o[0], fn, "batch", K_INT, 4, 1, 0)) || !(phase = take(&b, o[1], fn, "phase", K_INT, 1, 1, 0)) ||
        !(layer = take(&b, o[2], fn, "layer", K_INT, 2, 1, 0)) ||
        !(experts = take(&b, o[3], fn, "experts", K_INT, 4, 2, 0)) ||
        !(lidx_of = take(&b, o[4], fn, "lidx_of", K_INT, 4, 1, 0)) || !take_state(&b, o + 5, fn, &st))
        goto fail;
    if (!disjoint(&b, fn))
        goto fail;
    Py_ssize_t R = DIM(experts, 0);
    if (!need(DIM(batch, 0) == R && DIM(phase, 0) == R && DIM(layer, 0) == R, fn,
              "batch, phase and layer must have one element per row of experts") ||
        !need(n_expert >= 0, fn, "n_expert must be >= 0"))
        goto fail;
    lru_rows_t a = {
        .batch = batch->buf, .experts = experts->buf, .lidx_of = lidx_of->buf, .phase = phase->buf, .layer = layer->buf,
        .layer_info = st.layer_info->buf, .opts = st.opts->buf, .ent = st.ent->buf, .ps = st.ps->buf, .grp = st.grp->buf,
        .acc = st.acc->buf, .stats = st.stats->buf, .R = R, .k = DIM(experts, 1), .n_lay = DIM(lidx_of, 0),
        .li_rows = DIM(st.layer_info, 0), .C = DIM(st.ent, 1), .n_grp = DIM(st.grp, 0), .ps_len = DIM(st.ps, 0),
        .acc1 = DIM(st.acc, 1), .n_expert = (int64_t)n_expert,
    };
    int err;
    int64_t n_loads = 0;
    Py_BEGIN_ALLOW_THREADS
    err = lru_rows_loop(&a, &n_loads);
    Py_END_ALLOW_THREADS
    bufs_release(&b);
    if (err) {
        PyErr_Format(PyExc_ValueError, "%s: %s", fn, lru_err_text[err]);
        return NULL;
    }
    return PyLong_FromLongLong((long long)n_loads);
fail:
    bufs_release(&b);
    return NULL;
}

static PyMethodDef methods[] = {
    {"rows_ok", py_rows_ok, METH_VARARGS, rows_ok_doc},
    {"cut_loads", py_cut_loads, METH_VARARGS, cut_loads_doc},
    {"replay_lru", py_replay_lru, METH_VARARGS, replay_lru_doc},
    {"replay_lru_rows", py_replay_lru_rows, METH_VARARGS, replay_lru_rows_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(module_doc,
"Ahead-of-time compiled twins of the Numba kernels a plain LRU replay runs (rows_ok, cut_loads,\n"
"replay_lru): the same arguments and results, no Numba at run time. Use through replay.aot.");

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "replay._aot", .m_doc = module_doc, .m_size = 0, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__aot(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    /* The layout this build was written against (replay.cache_state / replay.cache_kernel): a test
     * compares them with the Python constants, so a changed layout fails loudly, not silently. */
    if (PyModule_AddIntConstant(m, "N_ENT", N_ENT) < 0 || PyModule_AddIntConstant(m, "N_GRP", N_GRP) < 0 ||
        PyModule_AddIntConstant(m, "N_ACC", N_ACC) < 0 || PyModule_AddIntConstant(m, "N_STATS", N_STATS) < 0 ||
        PyModule_AddIntConstant(m, "N_OPTS", N_OPTS) < 0 || PyModule_AddIntConstant(m, "ENT_RESIDENT", ENT_RESIDENT) < 0 ||
        PyModule_AddIntConstant(m, "ENT_PIN", ENT_PIN) < 0 || PyModule_AddIntConstant(m, "ENT_BYTES", ENT_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "GRP_BUDGET", GRP_BUDGET) < 0 || PyModule_AddIntConstant(m, "GRP_USED", GRP_USED) < 0 ||
        PyModule_AddIntConstant(m, "GRP_COUNT", GRP_COUNT) < 0 || PyModule_AddIntConstant(m, "OPT_TICK0", OPT_TICK0) < 0 ||
        PyModule_AddIntConstant(m, "OPT_LOAD0", OPT_LOAD0) < 0 || PyModule_AddIntConstant(m, "STAT_TICKS", STAT_TICKS) < 0 ||
        PyModule_AddIntConstant(m, "STAT_PEAK_BYTES", STAT_PEAK_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "STAT_EVICTIONS", STAT_EVICTIONS) < 0 ||
        PyModule_AddIntConstant(m, "STAT_OVERFLOW", STAT_OVERFLOW) < 0 ||
        PyModule_AddIntConstant(m, "ACC_LOOKUPS", ACC_LOOKUPS) < 0 || PyModule_AddIntConstant(m, "ACC_HITS", ACC_HITS) < 0 ||
        PyModule_AddIntConstant(m, "ACC_READ", ACC_READ) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
