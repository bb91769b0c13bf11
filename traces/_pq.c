/* traces._pq: a strict reader of one Parquet column chunk, so a plain replay can read a trace's
 * routing columns without importing NumPy or pyarrow (their import costs about half a second).
 *
 *   read_chunk(fd, offset, size, codec, physical, max_rep, max_def, width, rows, out) -> status
 *
 * reads the `size` bytes at `offset` of the open file `fd` (pread: the file position is left alone,
 * so a reader thread may share the descriptor), decodes the consecutive pages in them and writes
 * every value into `out`. It returns 0 when every value was decoded and written, else a positive
 * status (STATUS[status] says why in a few words): "not mine", the caller then reads the chunk with
 * pyarrow, which either reads it or names the problem.
 *
 * Strict by design: it understands exactly what the trace writer produces (PLAIN values, RLE levels,
 * no dictionary, zstd or no compression, data pages v1 and v2, required scalars and non-null
 * fixed-size lists) and refuses anything else rather than guess, including files pyarrow would read
 * (a dictionary page, snappy, a trailing index page): a refusal costs the fallback's time, a guess
 * could cost a wrong figure. Every value must be proven present by the levels (no null, every list
 * exactly `width` long) and the page headers must tile the chunk exactly.
 *
 * Safety: whatever the file bytes, nothing is read or written out of bounds (tests/test_pq_native.py
 * fuzzes corrupted chunks; it was also run under -fsanitize=address,undefined). Bad arguments raise
 * TypeError / ValueError before anything is read. The pread and the decoding run without the GIL.
 *
 * zstd comes from the system's libzstd, loaded with dlopen at first use (no zstd.h is needed to
 * build): where it cannot be loaded, zstd chunks are refused (status "zstd library unavailable")
 * and uncompressed ones still work.
 *
 * Reference for the formats: parquet.thrift (PageHeader, DataPageHeader, DataPageHeaderV2), the
 * Thrift compact protocol, and Parquet's RLE / bit-packing hybrid encoding; pyarrow is the twin the
 * tests demand exact agreement with.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ------------------------------------------------------------------------------------------------
 * Statuses: index = code. Keep in step with STATUS_TEXT below. */

enum {
    ST_OK = 0,
    ST_CODEC,
    ST_TYPE,
    ST_LAYOUT,
    ST_ZSTD_MISSING,
    ST_ENDIAN,
    ST_READ,
    ST_SHORT,
    ST_NOMEM,
    ST_HEADER,
    ST_PAST,
    ST_DICT,
    ST_PAGE_TYPE,
    ST_ENCODING,
    ST_V2_FLAG,
    ST_DECOMPRESS,
    ST_SIZE,
    ST_LEVELS,
    ST_NULL,
    ST_LIST,
    ST_VALUE_BYTES,
    ST_COUNT,
    ST_RANGE,
    N_STATUS
};

static const char *const STATUS_TEXT[N_STATUS] = {
    [ST_OK] = "ok",
    [ST_CODEC] = "unsupported compression codec",
    [ST_TYPE] = "unsupported physical type, or an output type that does not match it",
    [ST_LAYOUT] = "unsupported column layout (only required scalars and non-null fixed-size lists)",
    [ST_ZSTD_MISSING] = "zstd library unavailable",
    [ST_ENDIAN] = "not a little-endian machine",
    [ST_READ] = "the file could not be read",
    [ST_SHORT] = "truncated: the file ends inside the chunk",
    [ST_NOMEM] = "out of memory",
    [ST_HEADER] = "page header malformed",
    [ST_PAST] = "page header or page runs past the end of the chunk",
    [ST_DICT] = "dictionary page or dictionary-encoded values",
    [ST_PAGE_TYPE] = "unsupported page type",
    [ST_ENCODING] = "unsupported encoding (values must be PLAIN, levels RLE)",
    [ST_V2_FLAG] = "data page v2 with is_compressed unset, or false under a codec",
    [ST_DECOMPRESS] = "decompression failed",
    [ST_SIZE] = "page size does not match its header (decompressed or stored size)",
    [ST_LEVELS] = "repetition or definition levels malformed",
    [ST_NULL] = "a null value (definition level below the maximum)",
    [ST_LIST] = "an empty list or a list of the wrong length",
    [ST_VALUE_BYTES] = "page value bytes differ from num_values times the value size",
    [ST_COUNT] = "value count differs from rows times width",
    [ST_RANGE] = "value out of range for the narrowed output type",
};

/* Parquet enums (parquet.thrift) */
#define CODEC_UNCOMPRESSED 0
#define CODEC_ZSTD 6
#define PT_INT32 1
#define PT_INT64 2
#define PT_FLOAT 4
#define PT_DOUBLE 5
#define PAGE_DATA 0
#define PAGE_INDEX 1
#define PAGE_DICTIONARY 2
#define PAGE_DATA_V2 3
#define ENC_PLAIN 0
#define ENC_PLAIN_DICTIONARY 2
#define ENC_RLE 3
#define ENC_RLE_DICTIONARY 8

/* ------------------------------------------------------------------------------------------------
 * libzstd, loaded once (pthread_once: a reader thread may be the first to need it) */

typedef size_t (*zstd_decompress_fn)(void *, size_t, const void *, size_t);
typedef unsigned (*zstd_iserror_fn)(size_t);
typedef unsigned (*zstd_version_fn)(void);

static zstd_decompress_fn z_decompress;
static zstd_iserror_fn z_iserror;
static zstd_version_fn z_version;
static pthread_once_t z_once = PTHREAD_ONCE_INIT;

static void *sym(void *h, const char *name) { return dlsym(h, name); }

static void z_load(void) {
    static const char *const names[] = {"libzstd.so.1", "libzstd.so", "libzstd.1.dylib", "libzstd.dylib"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        void *h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (!h)
            continue;
        void *d = sym(h, "ZSTD_decompress"), *e = sym(h, "ZSTD_isError"), *v = sym(h, "ZSTD_versionNumber");
        if (d && e && v) {
            /* object pointer -> function pointer: what dlsym is for (POSIX guarantees it works) */
            memcpy(&z_decompress, &d, sizeof d);
            memcpy(&z_iserror, &e, sizeof e);
            memcpy(&z_version, &v, sizeof v);
            return; /* the handle stays open for the life of the process */
        }
        dlclose(h);
    }
}

static int zstd_ready(void) {
    pthread_once(&z_once, z_load);
    return z_decompress != NULL;
}

/* ------------------------------------------------------------------------------------------------
 * Thrift compact protocol, reading only, every read bounds-checked. A malformed or truncated input
 * sets err (ST_HEADER / ST_PAST) and every later read fails too. */

typedef struct {
    const uint8_t *p, *end;
    int err;
} tr_t;

enum { CT_STOP = 0, CT_TRUE = 1, CT_FALSE = 2, CT_BYTE = 3, CT_I16 = 4, CT_I32 = 5, CT_I64 = 6,
       CT_DOUBLE = 7, CT_BINARY = 8, CT_LIST = 9, CT_SET = 10, CT_MAP = 11, CT_STRUCT = 12 };

#define TR_MAX_DEPTH 64

static int tr_fail(tr_t *t, int st) {
    if (!t->err)
        t->err = st;
    return -1;
}

static int tr_byte(tr_t *t, uint8_t *b) {
    if (t->err)
        return -1;
    if (t->p >= t->end)
        return tr_fail(t, ST_PAST);
    *b = *t->p++;
    return 0;
}

/* an unsigned LEB128 varint of at most maxbytes bytes whose value fits in bits bits */
static int tr_varint(tr_t *t, uint64_t *out, int maxbytes, int bits) {
    uint64_t v = 0;
    for (int i = 0; i < maxbytes; i++) {
        uint8_t b;
        if (tr_byte(t, &b) < 0)
            return -1;
        v |= (uint64_t)(b & 0x7f) << (7 * i);
        if (!(b & 0x80)) {
            if (bits < 64 && (v >> bits))
                return tr_fail(t, ST_HEADER); /* Thrift would truncate it silently: refused */
            *out = v;
            return 0;
        }
    }
    return tr_fail(t, ST_HEADER);
}

static int tr_i32(tr_t *t, int32_t *out) {
    uint64_t v;
    if (tr_varint(t, &v, 5, 32) < 0)
        return -1;
    uint32_t u = (uint32_t)v;
    *out = (int32_t)((u >> 1) ^ (0u - (u & 1))); /* zigzag */
    return 0;
}

static int tr_skip_bytes(tr_t *t, uint64_t n) {
    if (t->err)
        return -1;
    if (n > (uint64_t)(t->end - t->p))
        return tr_fail(t, ST_PAST);
    t->p += n;
    return 0;
}

static int tr_skip(tr_t *t, int type, int depth, int in_container);

static int tr_skip_struct(tr_t *t, int depth) {
    if (depth > TR_MAX_DEPTH)
        return tr_fail(t, ST_HEADER);
    for (;;) {
        uint8_t b;
        if (tr_byte(t, &b) < 0)
            return -1;
        if (b == CT_STOP)
            return 0;
        int type = b & 0x0f;
        if (!(b >> 4)) { /* long form: the field id follows as a zigzag i16 */
            uint64_t id;
            if (tr_varint(t, &id, 3, 16) < 0)
                return -1;
        }
        if (tr_skip(t, type, depth + 1, 0) < 0)
            return -1;
    }
}

/* skip one value of compact type `type`; a bool in a list/set/map is one byte, a bool field none */
static int tr_skip(tr_t *t, int type, int depth, int in_container) {
    uint64_t v;
    uint8_t b;
    if (depth > TR_MAX_DEPTH)
        return tr_fail(t, ST_HEADER);
    switch (type) {
    case CT_TRUE:
    case CT_FALSE:
        return in_container ? tr_byte(t, &b) : 0;
    case CT_BYTE:
        return tr_byte(t, &b);
    case CT_I16:
        return tr_varint(t, &v, 3, 16);
    case CT_I32:
        return tr_varint(t, &v, 5, 32);
    case CT_I64:
        return tr_varint(t, &v, 10, 64);
    case CT_DOUBLE:
        return tr_skip_bytes(t, 8);
    case CT_BINARY:
        if (tr_varint(t, &v, 5, 31) < 0)
            return -1;
        return tr_skip_bytes(t, v);
    case CT_LIST:
    case CT_SET: {
        if (tr_byte(t, &b) < 0)
            return -1;
        uint64_t n = b >> 4;
        int et = b & 0x0f;
        if (n == 15 && tr_varint(t, &n, 5, 31) < 0)
            return -1;
        if (et == CT_STOP && n)
            return tr_fail(t, ST_HEADER);
        if (n > (uint64_t)(t->end - t->p)) /* every element takes at least a byte */
            return tr_fail(t, ST_PAST);
        for (uint64_t i = 0; i < n; i++)
            if (tr_skip(t, et, depth + 1, 1) < 0)
                return -1;
        return 0;
    }
    case CT_MAP: {
        uint64_t n;
        if (tr_varint(t, &n, 5, 31) < 0)
            return -1;
        if (!n)
            return 0;
        if (tr_byte(t, &b) < 0)
            return -1;
        int kt = b >> 4, vt = b & 0x0f;
        if (kt == CT_STOP || vt == CT_STOP)
            return tr_fail(t, ST_HEADER);
        if (n > (uint64_t)(t->end - t->p))
            return tr_fail(t, ST_PAST);
        for (uint64_t i = 0; i < n; i++)
            if (tr_skip(t, kt, depth + 1, 1) < 0 || tr_skip(t, vt, depth + 1, 1) < 0)
                return -1;
        return 0;
    }
    case CT_STRUCT:
        return tr_skip_struct(t, depth + 1);
    default:
        return tr_fail(t, ST_HEADER);
    }
}

/* One struct's field headers: returns 1 with *id and *type for a field, 0 at the stop byte, -1 on
 * error. Ids are int16 arithmetic, as Thrift's own reader computes them. */
static int tr_field(tr_t *t, int16_t *last, int16_t *id, int *type) {
    uint8_t b;
    if (tr_byte(t, &b) < 0)
        return -1;
    if (b == CT_STOP)
        return 0;
    *type = b & 0x0f;
    if (b >> 4) {
        *id = (int16_t)(*last + (b >> 4));
    } else {
        uint64_t v;
        if (tr_varint(t, &v, 3, 16) < 0)
            return -1;
        uint16_t u = (uint16_t)v;
        *id = (int16_t)((u >> 1) ^ (0u - (u & 1)));
    }
    *last = *id;
    return 1;
}

/* ------------------------------------------------------------------------------------------------
 * PageHeader (parquet.thrift), the fields this reader needs. A known field seen twice, or with an
 * unexpected type, is refused: Thrift's own reader would overwrite or skip it, and a reader that
 * guessed which one pyarrow used could disagree with it. */

typedef struct {
    int32_t type, usize, csize;
    unsigned seen; /* bit per PageHeader field id 1..8 */
    /* DataPageHeader (v1) */
    int32_t n, enc, def_enc, rep_enc;
    unsigned dp_seen;
    /* DataPageHeaderV2 */
    int32_t v2_n, v2_nulls, v2_rows, v2_enc, v2_dlen, v2_rlen;
    int v2_compressed;
    unsigned v2_seen;
} page_t;

static int mark(tr_t *t, unsigned *seen, int id) {
    if (*seen & (1u << id))
        return tr_fail(t, ST_HEADER);
    *seen |= 1u << id;
    return 0;
}

static int read_i32_field(tr_t *t, int type, unsigned *seen, int id, int32_t *out) {
    if (type != CT_I32)
        return tr_fail(t, ST_HEADER);
    if (mark(t, seen, id) < 0)
        return -1;
    return tr_i32(t, out);
}

static int read_data_page_header(tr_t *t, page_t *h) {
    int16_t last = 0, id;
    int type, r;
    while ((r = tr_field(t, &last, &id, &type)) > 0) {
        switch (id) {
        case 1: r = read_i32_field(t, type, &h->dp_seen, 1, &h->n); break;
        case 2: r = read_i32_field(t, type, &h->dp_seen, 2, &h->enc); break;
        case 3: r = read_i32_field(t, type, &h->dp_seen, 3, &h->def_enc); break;
        case 4: r = read_i32_field(t, type, &h->dp_seen, 4, &h->rep_enc); break;
        default: r = tr_skip(t, type, 1, 0); /* statistics and anything newer */
        }
        if (r < 0)
            return -1;
    }
    if (r < 0)
        return -1;
    if (h->dp_seen != 0x1e) /* the four required fields */
        return tr_fail(t, ST_HEADER);
    return 0;
}

static int read_data_page_header_v2(tr_t *t, page_t *h) {
    int16_t last = 0, id;
    int type, r;
    while ((r = tr_field(t, &last, &id, &type)) > 0) {
        switch (id) {
        case 1: r = read_i32_field(t, type, &h->v2_seen, 1, &h->v2_n); break;
        case 2: r = read_i32_field(t, type, &h->v2_seen, 2, &h->v2_nulls); break;
        case 3: r = read_i32_field(t, type, &h->v2_seen, 3, &h->v2_rows); break;
        case 4: r = read_i32_field(t, type, &h->v2_seen, 4, &h->v2_enc); break;
        case 5: r = read_i32_field(t, type, &h->v2_seen, 5, &h->v2_dlen); break;
        case 6: r = read_i32_field(t, type, &h->v2_seen, 6, &h->v2_rlen); break;
        case 7:
            if (type != CT_TRUE && type != CT_FALSE)
                return tr_fail(t, ST_HEADER);
            r = mark(t, &h->v2_seen, 7);
            h->v2_compressed = type == CT_TRUE;
            break;
        default: r = tr_skip(t, type, 1, 0);
        }
        if (r < 0)
            return -1;
    }
    if (r < 0)
        return -1;
    if ((h->v2_seen & 0x7e) != 0x7e) /* fields 1..6 are required; 7 (is_compressed) is optional */
        return tr_fail(t, ST_HEADER);
    return 0;
}

static int read_page_header(tr_t *t, page_t *h) {
    int16_t last = 0, id;
    int type, r;
    memset(h, 0, sizeof *h);
    while ((r = tr_field(t, &last, &id, &type)) > 0) {
        switch (id) {
        case 1: r = read_i32_field(t, type, &h->seen, 1, &h->type); break;
        case 2: r = read_i32_field(t, type, &h->seen, 2, &h->usize); break;
        case 3: r = read_i32_field(t, type, &h->seen, 3, &h->csize); break;
        case 5:
        case 8:
            if (type != CT_STRUCT)
                return tr_fail(t, ST_HEADER);
            if (mark(t, &h->seen, id) < 0)
                return -1;
            r = id == 5 ? read_data_page_header(t, h) : read_data_page_header_v2(t, h);
            break;
        case 6:
        case 7:
            if (type != CT_STRUCT)
                return tr_fail(t, ST_HEADER);
            r = mark(t, &h->seen, id);
            if (r == 0)
                r = tr_skip(t, type, 1, 0);
            break;
        default: r = tr_skip(t, type, 1, 0); /* crc (4: not verified, as pyarrow by default) and newer fields */
        }
        if (r < 0)
            return -1;
    }
    if (r < 0)
        return -1;
    if ((h->seen & 0xe) != 0xe || h->usize < 0 || h->csize < 0)
        return tr_fail(t, ST_HEADER);
    return 0;
}

/* ------------------------------------------------------------------------------------------------
 * Levels: the RLE / bit-packing hybrid. Nothing is expanded: each run is checked against what the
 * levels must be. Definition levels: every entry == max_def (a value is present). Repetition
 * levels: the entry at global position g (counted across the chunk's pages) is 0 exactly when
 * g % width == 0 (a new list starts every width entries), else 1. Only the first n entries are
 * looked at; bytes after them are never read, as pyarrow never reads them. */

typedef struct {
    int is_rep;
    int want;      /* def: the max level */
    int64_t width; /* rep: the list width */
} lvl_t;

/* why a level is wrong: a repetition level (0 or 1) breaks the lists' length; a definition level
 * of 0 is an empty list (nothing defined below the required list), one below the maximum a null
 * item; a level above its maximum is malformed */
static int level_status(const lvl_t *L, uint32_t v) {
    if (L->is_rep)
        return v <= 1 ? ST_LIST : ST_LEVELS;
    return v == 0 ? ST_LIST : v < (uint32_t)L->want ? ST_NULL : ST_LEVELS;
}

/* The bytes a bit-packed run of repetition levels (bit width 1) must hold: bit i of a byte whose
 * first entry has phase ph (global position % width) is 0 exactly at a list start. */
typedef struct {
    int64_t width;
    uint8_t exp[8], nxt[8]; /* width < 8: by phase, the byte and the next byte's phase */
} rep_bytes_t;

static void rep_bytes_init(rep_bytes_t *R, int64_t width) {
    R->width = width;
    if (width >= 8)
        return;
    for (int ph = 0; ph < width; ph++) {
        uint8_t e = 0;
        for (int i = 0; i < 8; i++)
            if ((ph + i) % width)
                e |= (uint8_t)(1u << i);
        R->exp[ph] = e;
        R->nxt[ph] = (uint8_t)((ph + 8) % width);
    }
}

/* the expected byte at phase *ph, advancing *ph to the next byte's */
static inline uint8_t rep_byte(const rep_bytes_t *R, int64_t *ph) {
    if (R->width < 8) {
        uint8_t e = R->exp[*ph];
        *ph = R->nxt[*ph];
        return e;
    }
    int64_t d = *ph ? R->width - *ph : 0; /* the bit of the list start in this byte, if below 8 */
    *ph += 8;
    if (*ph >= R->width)
        *ph -= R->width;
    return d < 8 ? (uint8_t)~(1u << d) : 0xFF;
}

/* whether the run of m entries of value v starting at global position g is as required */
static int run_ok(const lvl_t *L, uint32_t v, int64_t g, int64_t m) {
    if (!L->is_rep)
        return v == (uint32_t)L->want;
    if (L->width == 1)
        return v == 0;
    int64_t ph = g % L->width;
    if (v == 0)
        return m == 1 && ph == 0;
    if (v == 1)
        return ph != 0 && ph + m <= L->width;
    return 0;
}

static int check_levels(const uint8_t *p, size_t len, int64_t n, int bw, const lvl_t *L, int64_t g) {
    const uint8_t *end = p + len;
    const uint32_t mask = (1u << bw) - 1;
    while (n > 0) {
        uint64_t hdr = 0;
        int i = 0;
        for (;; i++) { /* a varint of at most 5 bytes, fitting 32 bits */
            if (i == 5 || p >= end)
                return ST_LEVELS;
            uint8_t b = *p++;
            hdr |= (uint64_t)(b & 0x7f) << (7 * i);
            if (!(b & 0x80))
                break;
        }
        if (hdr >> 32)
            return ST_LEVELS;
        if (hdr & 1) { /* bit-packed: (hdr >> 1) groups of 8 values, LSB first */
            uint64_t groups = hdr >> 1;
            uint64_t nbytes = groups * (uint64_t)bw;
            if (!groups || nbytes > (uint64_t)(end - p))
                return ST_LEVELS;
            int64_t m = (int64_t)(groups * 8) < n ? (int64_t)(groups * 8) : n;
            int64_t k = 0;
            if (L->is_rep && L->width > 1) {
                /* lists of width > 1: the bytes follow a pattern of period width, compared whole */
                rep_bytes_t R;
                rep_bytes_init(&R, L->width);
                int64_t ph = g % L->width, whole = m / 8, b = 0;
                while (b < whole && p[b] == rep_byte(&R, &ph))
                    b++;
                k = b * 8; /* from a byte that differs, value by value: the loop below names the bad one */
            } else {
                /* every value must be the same: whole bytes compared at once */
                uint32_t v = L->is_rep ? 0 : (uint32_t)L->want;
                if (v > mask)
                    return ST_LEVELS;
                uint8_t full = 0;
                for (int s = 0; s < 8; s += bw)
                    full |= (uint8_t)(v << s);
                int per = 8 / bw;
                int64_t whole = m / per;
                int64_t b = 0;
                while (b < whole && p[b] == full)
                    b++;
                k = b * per; /* from a byte that differs, value by value: the loop below names the bad one */
            }
            for (; k < m; k++) {
                uint64_t bit = (uint64_t)k * bw; /* bw is 1 or 2: a value never straddles bytes */
                uint32_t v = (p[bit >> 3] >> (bit & 7)) & mask;
                if (!run_ok(L, v, g + k, 1))
                    return level_status(L, v);
            }
            p += nbytes;
            n -= m;
            g += m;
        } else { /* a run: (hdr >> 1) repeats of one value in ceil(bw / 8) bytes */
            uint64_t count = hdr >> 1;
            if (!count || p >= end) /* bw <= 8: the value is one byte */
                return ST_LEVELS;
            uint32_t v = *p++;
            int64_t m = (int64_t)count < n ? (int64_t)count : n;
            if (!run_ok(L, v, g, m))
                return level_status(L, v);
            n -= m;
            g += m;
        }
    }
    return ST_OK;
}

/* ------------------------------------------------------------------------------------------------
 * The chunk */

typedef struct {
    int fd;
    int64_t offset, size;
    int codec, physical, max_rep, max_def;
    int64_t width, rows;
    uint8_t *out;
    int osize, psize;  /* bytes per output / stored value */
    int64_t expected;  /* values: rows * max(width, 1) */
    /* state */
    uint8_t *buf;      /* the chunk as read */
    uint8_t *scratch;  /* one decompressed page, reused */
    size_t scap;
    int64_t done;      /* values written */
} job_t;

static int grow(job_t *j, size_t need) {
    if (need <= j->scap)
        return ST_OK;
    size_t cap = need < 4096 ? 4096 : need;
    uint8_t *s = realloc(j->scratch, cap);
    if (!s)
        return ST_NOMEM;
    j->scratch = s;
    j->scap = cap;
    return ST_OK;
}

/* n stored values at src (exactly n * psize bytes) -> out, from value j->done */
static int put_values(job_t *j, const uint8_t *src, int64_t n) {
    uint8_t *dst = j->out + (size_t)j->done * j->osize;
    if (j->osize == j->psize) {
        if (n)
            memcpy(dst, src, (size_t)n * j->psize);
        return ST_OK;
    }
    /* INT32 narrowed to int8 / int16 (how Parquet stores Arrow's int8 / int16): every value must fit */
    if (j->osize == 1) {
        int8_t *d = (int8_t *)dst;
        for (int64_t i = 0; i < n; i++) {
            int32_t v;
            memcpy(&v, src + 4 * i, 4);
            if (v < INT8_MIN || v > INT8_MAX)
                return ST_RANGE;
            d[i] = (int8_t)v;
        }
    } else {
        int16_t *d = (int16_t *)dst;
        for (int64_t i = 0; i < n; i++) {
            int32_t v;
            memcpy(&v, src + 4 * i, 4);
            if (v < INT16_MIN || v > INT16_MAX)
                return ST_RANGE;
            d[i] = (int16_t)v;
        }
    }
    return ST_OK;
}

/* zstd: src -> dst, exactly dlen bytes */
static int unzstd(void *dst, size_t dlen, const void *src, size_t slen) {
    size_t r = z_decompress(dst, dlen, src, slen);
    if (z_iserror(r))
        return ST_DECOMPRESS;
    return r == dlen ? ST_OK : ST_SIZE;
}

/* the level sections of one page: rep (if max_rep) then def (if max_def), each `len` bytes */
static int page_levels(job_t *j, const uint8_t *rep, size_t rlen, const uint8_t *def, size_t dlen, int64_t n) {
    int st;
    if (j->max_rep) {
        lvl_t L = {1, 0, j->width};
        if ((st = check_levels(rep, rlen, n, 1, &L, j->done)) != ST_OK)
            return st;
    }
    if (j->max_def) {
        lvl_t L = {0, j->max_def, j->width};
        if ((st = check_levels(def, dlen, n, 2, &L, j->done)) != ST_OK)
            return st;
    }
    return ST_OK;
}

static int value_encoding(int32_t enc) {
    if (enc == ENC_PLAIN)
        return ST_OK;
    return enc == ENC_PLAIN_DICTIONARY || enc == ENC_RLE_DICTIONARY ? ST_DICT : ST_ENCODING;
}

static int data_page_v1(job_t *j, const page_t *h, const uint8_t *body) {
    int st;
    if ((st = value_encoding(h->enc)) != ST_OK)
        return st;
    if (h->def_enc != ENC_RLE || h->rep_enc != ENC_RLE)
        return ST_ENCODING;
    if (h->n < 0)
        return ST_HEADER;
    int64_t n = h->n;
    if (n > j->expected - j->done)
        return ST_COUNT;
    size_t vbytes = (size_t)n * j->psize;
    size_t usize = (size_t)h->usize, csize = (size_t)h->csize;
    /* the levels of n entries take at most 4 + 6 n + 8 bytes a section (a one-entry run per entry,
     * each with a 5-byte header): a larger page is corrupt; bounding it bounds the scratch buffer */
    size_t lmax = (j->max_rep ? 12 + 6 * (size_t)n : 0) + (j->max_def ? 12 + 6 * (size_t)n : 0);
    if (usize > vbytes + lmax)
        return ST_SIZE;
    const uint8_t *ub;
    if (j->codec == CODEC_UNCOMPRESSED) {
        if (usize != csize)
            return ST_SIZE;
        ub = body;
    } else {
        if (!j->max_rep && !j->max_def && j->osize == j->psize) {
            /* the fast path: a required scalar's page is its values, decompressed into out in place */
            if (usize != vbytes)
                return ST_VALUE_BYTES;
            if ((st = unzstd(j->out + (size_t)j->done * j->osize, vbytes, body, csize)) != ST_OK)
                return st;
            j->done += n;
            return ST_OK;
        }
        if ((st = grow(j, usize ? usize : 1)) != ST_OK)
            return st;
        if ((st = unzstd(j->scratch, usize, body, csize)) != ST_OK)
            return st;
        ub = j->scratch;
    }
    size_t q = 0, lens[2] = {0, 0};
    const uint8_t *secs[2] = {NULL, NULL};
    for (int s = 0; s < 2; s++) {
        if (s == 0 ? !j->max_rep : !j->max_def)
            continue;
        if (usize - q < 4)
            return ST_LEVELS;
        uint32_t len = (uint32_t)ub[q] | (uint32_t)ub[q + 1] << 8 | (uint32_t)ub[q + 2] << 16 | (uint32_t)ub[q + 3] << 24;
        q += 4;
        if (len > usize - q)
            return ST_LEVELS;
        secs[s] = ub + q;
        lens[s] = len;
        q += len;
    }
    if ((st = page_levels(j, secs[0], lens[0], secs[1], lens[1], n)) != ST_OK)
        return st;
    if (usize - q != vbytes)
        return ST_VALUE_BYTES;
    if ((st = put_values(j, ub + q, n)) != ST_OK)
        return st;
    j->done += n;
    return ST_OK;
}

static int data_page_v2(job_t *j, const page_t *h, const uint8_t *body) {
    int st;
    if ((st = value_encoding(h->v2_enc)) != ST_OK)
        return st;
    if (h->v2_n < 0 || h->v2_nulls < 0 || h->v2_rows < 0 || h->v2_dlen < 0 || h->v2_rlen < 0)
        return ST_HEADER;
    int64_t n = h->v2_n;
    if (n > j->expected - j->done)
        return ST_COUNT;
    size_t vbytes = (size_t)n * j->psize;
    size_t usize = (size_t)h->usize, csize = (size_t)h->csize;
    size_t rlen = (size_t)h->v2_rlen, dlen = (size_t)h->v2_dlen, lv = rlen + dlen;
    /* no level section without a level; the levels are stored as is, inside both sizes */
    if ((!j->max_rep && rlen) || (!j->max_def && dlen))
        return ST_LEVELS;
    if (lv > csize || lv > usize)
        return ST_HEADER;
    if ((st = page_levels(j, body, rlen, body + rlen, dlen, n)) != ST_OK)
        return st;
    if (h->v2_nulls) /* the levels say none: the header disagrees with them */
        return ST_NULL;
    /* pyarrow reads values as uncompressed when is_compressed is unset or false, unless the file
     * was written by an Arrow older than 3.0.0 (which set false and compressed anyway): the writer
     * is in the footer, not here, so under a codec only an explicit true is taken */
    if (!(h->v2_seen & (1u << 7)) || (j->codec != CODEC_UNCOMPRESSED && !h->v2_compressed))
        return ST_V2_FLAG;
    if (usize - lv != vbytes)
        return ST_VALUE_BYTES;
    if (j->codec == CODEC_UNCOMPRESSED) {
        if (usize != csize)
            return ST_SIZE;
        st = put_values(j, body + lv, n);
    } else if (j->osize == j->psize) {
        st = unzstd(j->out + (size_t)j->done * j->osize, vbytes, body + lv, csize - lv);
    } else {
        if ((st = grow(j, vbytes ? vbytes : 1)) != ST_OK)
            return st;
        if ((st = unzstd(j->scratch, vbytes, body + lv, csize - lv)) != ST_OK)
            return st;
        st = put_values(j, j->scratch, n);
    }
    if (st != ST_OK)
        return st;
    j->done += n;
    return ST_OK;
}

static int read_all(job_t *j) {
    size_t got = 0, size = (size_t)j->size;
    while (got < size) {
        ssize_t r = pread(j->fd, j->buf + got, size - got, (off_t)(j->offset + (int64_t)got));
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return ST_READ;
        }
        if (r == 0)
            return ST_SHORT;
        got += (size_t)r;
    }
    return ST_OK;
}

static int decode(job_t *j) {
    int st;
    if (j->size == 0) /* pyarrow writes an empty row group's chunks as 0 bytes at offset 0 */
        return j->expected == 0 ? ST_OK : ST_COUNT;
    struct stat sb; /* a range past the end of a regular file: refused before allocating it */
    if (fstat(j->fd, &sb) == 0 && S_ISREG(sb.st_mode) && j->offset + j->size > (int64_t)sb.st_size)
        return ST_SHORT;
    if ((uint64_t)j->size > SIZE_MAX || !(j->buf = malloc((size_t)j->size)))
        return ST_NOMEM;
    if ((st = read_all(j)) != ST_OK)
        return st;
    const uint8_t *end = j->buf + j->size;
    const uint8_t *p = j->buf;
    while (p < end) {
        tr_t t = {p, end, 0};
        page_t h;
        if (read_page_header(&t, &h) < 0)
            return t.err;
        if ((size_t)h.csize > (size_t)(end - t.p))
            return ST_PAST;
        switch (h.type) {
        case PAGE_DATA:
            if (!(h.seen & (1u << 5)))
                return ST_HEADER;
            st = data_page_v1(j, &h, t.p);
            break;
        case PAGE_DATA_V2:
            if (!(h.seen & (1u << 8)))
                return ST_HEADER;
            st = data_page_v2(j, &h, t.p);
            break;
        case PAGE_DICTIONARY:
            st = ST_DICT;
            break;
        default: /* an index page, or a type newer than this reader */
            st = ST_PAGE_TYPE;
        }
        if (st != ST_OK)
            return st;
        p = t.p + h.csize;
    }
    return j->done == j->expected ? ST_OK : ST_COUNT;
}

/* ------------------------------------------------------------------------------------------------
 * Python */

/* an int argument as a 64-bit integer: TypeError if it is not an integer, ValueError if it is out
 * of range (never OverflowError: the caller's contract is TypeError / ValueError) */
static int arg_ll(PyObject *o, const char *name, long long lo, long long *out) {
    if (!PyIndex_Check(o) || PyBool_Check(o)) {
        PyErr_Format(PyExc_TypeError, "read_chunk: %s must be an int, not %.100s", name, Py_TYPE(o)->tp_name);
        return -1;
    }
    PyObject *i = PyNumber_Index(o);
    if (!i)
        return -1;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(i, &overflow);
    Py_DECREF(i);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow || v < lo) {
        PyErr_Format(PyExc_ValueError, "read_chunk: %s out of range (at least %lld, at most 2**63 - 1)", name, lo);
        return -1;
    }
    *out = v;
    return 0;
}

/* the element size the buffer's struct format names, or 0 if it names none this reader writes;
 * *is_float says float vs integer */
static int format_size(const char *f, Py_ssize_t itemsize, int *is_float) {
    if (!f)
        return 0;
    if (*f == '@' || *f == '=' || *f == '<')
        f++; /* native or little-endian (the only order this reader runs on) */
    if (!f[0] || f[1])
        return 0;
    int size = 0;
    *is_float = 0;
    switch (f[0]) {
    case 'b': size = 1; break;
    case 'h': size = 2; break;
    case 'i':
    case 'l': size = itemsize == 4 || itemsize == 8 ? (int)itemsize : 0; break; /* C int / long: by their size */
    case 'q': size = 8; break;
    case 'f': size = 4; *is_float = 1; break;
    case 'd': size = 8; *is_float = 1; break;
    default: return 0;
    }
    return size == itemsize ? size : 0;
}

static int little_endian(void) {
    const uint16_t one = 1;
    uint8_t b;
    memcpy(&b, &one, 1);
    return b == 1;
}

PyDoc_STRVAR(read_chunk_doc,
"read_chunk(fd, offset, size, codec, physical, max_rep, max_def, width, rows, out) -> int\n\n"
"Read the column chunk at bytes [offset, offset + size) of the open file descriptor fd and write\n"
"its rows * max(width, 1) values into out (a writable C-contiguous buffer of exactly that many\n"
"elements, format b/h/i/l/q/f/d). codec: Parquet CompressionCodec (0 or 6 = zstd); physical:\n"
"Parquet Type (1 INT32, 2 INT64, 4 FLOAT, 5 DOUBLE); max_rep, max_def, width: 0, 0, 0 for a\n"
"required scalar, 1, 2, k for a non-null fixed_size_list<T>[k]. Returns 0 when every value was\n"
"written, else a positive status (STATUS[status] says why): the chunk is not one this reader\n"
"understands, read it another way. Raises TypeError / ValueError for bad arguments.");

static PyObject *read_chunk(PyObject *self, PyObject *args) {
    (void)self;
    static const char *const names[9] = {"fd", "offset", "size", "codec", "physical", "max_rep", "max_def", "width", "rows"};
    static const long long lows[9] = {0, 0, 0, LLONG_MIN, LLONG_MIN, 0, 0, 0, 0};
    PyObject *o[9], *out;
    long long a[9];
    if (!PyArg_ParseTuple(args, "OOOOOOOOOO:read_chunk", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8], &out))
        return NULL;
    for (int i = 0; i < 9; i++)
        if (arg_ll(o[i], names[i], lows[i], &a[i]) < 0)
            return NULL;
    if (a[0] > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "read_chunk: fd out of range");
        return NULL;
    }
    if (a[1] > INT64_MAX - a[2]) {
        PyErr_SetString(PyExc_ValueError, "read_chunk: offset + size out of range");
        return NULL;
    }
    long long width = a[7], rows = a[8], per = width > 1 ? width : 1;
    if (rows && per > (long long)(PY_SSIZE_T_MAX / 8) / rows) {
        PyErr_SetString(PyExc_ValueError, "read_chunk: rows * width out of range");
        return NULL;
    }
    if (!PyObject_CheckBuffer(out)) {
        PyErr_Format(PyExc_TypeError, "read_chunk: out must support the buffer protocol, not %.100s", Py_TYPE(out)->tp_name);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(out, &view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "read_chunk: out must be a writable C-contiguous buffer");
        return NULL;
    }
    int is_float = 0;
    int osize = format_size(view.format, view.itemsize, &is_float);
    if (!osize) {
        PyErr_Format(PyExc_ValueError, "read_chunk: out's format %.20s (itemsize %zd) is none of int8 int16 int32 "
                     "int64 float32 float64 (b h i l q f d)", view.format ? view.format : "(none)", view.itemsize);
        PyBuffer_Release(&view);
        return NULL;
    }
    long long expected = rows * per;
    if (view.len != (Py_ssize_t)(expected * osize)) {
        PyErr_Format(PyExc_ValueError, "read_chunk: out holds %zd elements, rows * max(width, 1) is %lld",
                     view.len / osize, expected);
        PyBuffer_Release(&view);
        return NULL;
    }

    job_t j = {0};
    j.fd = (int)a[0];
    j.offset = a[1];
    j.size = a[2];
    j.codec = a[3] < INT_MIN || a[3] > INT_MAX ? -1 : (int)a[3];
    j.physical = a[4] < INT_MIN || a[4] > INT_MAX ? -1 : (int)a[4];
    j.width = width;
    j.rows = rows;
    j.out = view.buf;
    j.osize = osize;
    j.expected = expected;

    int st = ST_OK;
    switch (j.physical) {
    case PT_INT32: j.psize = 4; st = is_float || osize > 4 ? ST_TYPE : ST_OK; break;
    case PT_INT64: j.psize = 8; st = is_float || osize != 8 ? ST_TYPE : ST_OK; break;
    case PT_FLOAT: j.psize = 4; st = !is_float || osize != 4 ? ST_TYPE : ST_OK; break;
    case PT_DOUBLE: j.psize = 8; st = !is_float || osize != 8 ? ST_TYPE : ST_OK; break;
    default: st = ST_TYPE;
    }
    if (st == ST_OK && j.codec != CODEC_UNCOMPRESSED && j.codec != CODEC_ZSTD)
        st = ST_CODEC;
    if (st == ST_OK) {
        if (a[5] == 0 && a[6] == 0 && width == 0) {
            j.max_rep = j.max_def = 0;
        } else if (a[5] == 1 && a[6] == 2 && width >= 1) {
            j.max_rep = 1;
            j.max_def = 2;
        } else {
            st = ST_LAYOUT;
        }
    }
    if (st == ST_OK && !little_endian())
        st = ST_ENDIAN;
    if (st == ST_OK) {
        Py_BEGIN_ALLOW_THREADS
        if (j.codec == CODEC_ZSTD && !zstd_ready())
            st = ST_ZSTD_MISSING;
        else
            st = decode(&j);
        free(j.buf);
        free(j.scratch);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&view);
    return PyLong_FromLong(st);
}

PyDoc_STRVAR(zstd_version_doc, "zstd_version() -> str | None\n\n"
"The version of the libzstd loaded (\"1.5.4\"), or None when it could not be loaded.");

static PyObject *zstd_version(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = zstd_ready();
    Py_END_ALLOW_THREADS
    if (!ok)
        Py_RETURN_NONE;
    unsigned v = z_version();
    return PyUnicode_FromFormat("%u.%u.%u", v / 10000, v / 100 % 100, v % 100);
}

static PyMethodDef methods[] = {
    {"read_chunk", read_chunk, METH_VARARGS, read_chunk_doc},
    {"zstd_version", zstd_version, METH_NOARGS, zstd_version_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(module_doc, "A strict reader of Parquet column chunks (traces/_pq.c): read_chunk, STATUS, zstd_version.");

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "traces._pq", .m_doc = module_doc, .m_size = 0, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__pq(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    PyObject *status = PyTuple_New(N_STATUS);
    if (!status)
        goto fail;
    for (int i = 0; i < N_STATUS; i++) {
        PyObject *s = PyUnicode_FromString(STATUS_TEXT[i]);
        if (!s) {
            Py_DECREF(status);
            goto fail;
        }
        PyTuple_SET_ITEM(status, i, s);
    }
    if (PyModule_AddObject(m, "STATUS", status) < 0) {
        Py_DECREF(status);
        goto fail;
    }
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
