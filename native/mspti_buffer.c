/* agent._native: MSPTI activity-buffer collector.
 *
 * The request/complete callbacks run on MSPTI's threads without the GIL:
 *  - request hands out a buffer from a preallocated pool (a tiny mutex, never waits for a buffer;
 *    an empty pool declines the request with *buffer = NULL and counts it);
 *  - complete walks the records with msptiActivityGetNextRecord and serialises each one straight
 *    into the free space of a byte ring as one JSON line in TaskD's on-disk format (Go encoding/json
 *    output, byte for byte), then gives the buffer back to the pool.  A line that does not fit in
 *    the free space is dropped and counted.  Nothing is allocated and no lock but the producers'
 *    own is taken per record; the time spent in each call is counted.
 * The ring is single-consumer: `head` (bytes and lines ever committed, whole lines only) and `tail`
 * (bytes and lines ever consumed) are atomics, so producers and the consumer never wait for each
 * other, and the consumer knows how many lines it takes without counting them.  Python
 * drains whole lines into bytes (drain) or writes them from the ring to a file descriptor without
 * the GIL (drain_to).
 *
 * All state the callbacks touch is process-global (MSPTI has one set of callbacks per process), so
 * callbacks that arrive after close(), or after the Python object is gone at interpreter exit, find
 * a "closed" flag and return without touching freed memory.  Buffers still held by MSPTI at close
 * are never freed (the pool is leaked instead), so MSPTI cannot write into freed memory either.
 *
 * A forked child inherits all of it, but the records in it are the parent's to write: in the
 * child (pthread_atfork) the callbacks do nothing, and a Collector opened by another process is
 * inert -- nothing pending, nothing drained, written, flushed or closed, no lock taken (the
 * parent's threads may have held one at the fork).  The child may open a Collector of its own. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "mspti_abi.h"

#define LIKELY(x) __builtin_expect(!!(x), 1)

typedef msptiResult (*fn_enable_t)(msptiActivityKind);
typedef msptiResult (*fn_get_next_t)(uint8_t *, size_t, msptiActivity **);
typedef msptiResult (*fn_register_t)(msptiBuffersCallbackRequestFunc, msptiBuffersCallbackCompleteFunc);
typedef msptiResult (*fn_flush_t)(uint32_t);
typedef msptiResult (*fn_domain_t)(const char *);
typedef msptiResult (*fn_subscribe_t)(msptiSubscriberHandle *, msptiCallbackFunc, void *);
typedef msptiResult (*fn_unsubscribe_t)(msptiSubscriberHandle);

typedef struct {
    fn_enable_t enable;
    fn_enable_t disable;
    fn_get_next_t get_next;
    fn_register_t register_callbacks;
    fn_flush_t flush_all;
    fn_domain_t enable_domain;
    fn_domain_t disable_domain;
    fn_subscribe_t subscribe;
    fn_unsubscribe_t unsubscribe;
} mspti_api;

enum {
    C_RECORDS,
    C_BYTES,
    C_BUFFERS_REQUESTED,
    C_BUFFERS_DECLINED,
    C_BUFFERS_COMPLETED,
    C_RECORDS_DROPPED,
    C_RECORDS_SKIPPED,
    C_COMPLETE_NS,     /* time spent in the completion callback, summed over completed buffers */
    C_COMPLETE_MAX_NS, /* the longest single completion callback */
    C_COUNT
};
static const char *const counter_names[C_COUNT] = {
    "records", "bytes", "buffers_requested", "buffers_declined", "buffers_completed",
    "records_dropped", "records_skipped", "complete_ns", "complete_max_ns",
};

/* ------------------------------------------------------------------ global collector state */

static struct {
    atomic_int closed; /* 1 whenever no Collector is open: callbacks do nothing */
    atomic_int inflight;
    int open;
    mspti_api api;

    uint8_t *slab;
    size_t nbuf, buf_bytes;
    pthread_mutex_t pool_mu;
    uint32_t *free_stack;
    size_t nfree;

    uint8_t *ring;
    size_t cap;
    pthread_mutex_t prod_mu; /* producers (completion callbacks) one at a time */
    size_t head_pos;         /* head bytes % cap; producers only */
    size_t tail_pos;         /* tail bytes % cap; the consumer only */
    _Atomic uint64_t head;   /* bytes and lines ever committed (packed: see mark()); whole lines only */
    _Atomic uint64_t tail;   /* bytes and lines ever consumed */

    _Atomic uint64_t counters[C_COUNT];
    uint64_t *owner_final; /* the open Collector's final_counters: filled in a forked child */
} G = {
    .closed = 1,
    .pool_mu = PTHREAD_MUTEX_INITIALIZER,
    .prod_mu = PTHREAD_MUTEX_INITIALIZER,
};

/* head and tail each pack a byte count (low 40 bits) and a line count (high 24 bits), both modulo
 * their width: one atomic word, so the consumer always sees the bytes and the lines of the same
 * lines.  The differences are exact while the ring holds less than 2^40 bytes and 2^24 lines:
 * ring_bytes is at most 1 GiB and a line is longer than 64 bytes. */
#define MARK_BYTES_BITS 40
#define MARK_BYTES_MASK ((UINT64_C(1) << MARK_BYTES_BITS) - 1)
#define MARK_LINES_MASK ((UINT64_C(1) << (64 - MARK_BYTES_BITS)) - 1)
#define MAX_RING_BYTES ((Py_ssize_t)1 << 30)

static inline uint64_t mark(uint64_t bytes, uint64_t lines) {
    return lines << MARK_BYTES_BITS | (bytes & MARK_BYTES_MASK);
}
static inline uint64_t mark_bytes(uint64_t m) { return m & MARK_BYTES_MASK; }
static inline uint64_t mark_lines(uint64_t m) { return m >> MARK_BYTES_BITS; }

static inline void count(int which, uint64_t n) {
    if (n != 0) atomic_fetch_add_explicit(&G.counters[which], n, memory_order_relaxed);
}

static void count_max(int which, uint64_t v) {
    uint64_t cur = atomic_load_explicit(&G.counters[which], memory_order_relaxed);
    while (v > cur && !atomic_compare_exchange_weak_explicit(&G.counters[which], &cur, v, memory_order_relaxed,
                                                             memory_order_relaxed)) {
    }
}

/* ------------------------------------------------------------------ the line writer */

/* Writes one line into the ring's free space, which starts at the head and may continue at the
 * ring's start.  When the line outgrows the free space, `full` is set and the rest is ignored: the
 * head is not moved, so nothing of it is ever seen. */
typedef struct {
    uint8_t *p, *end; /* where the next byte goes; the end of the free space there */
    uint8_t *base;    /* where the current stretch of free space starts */
    uint8_t *wrap;    /* the ring's start when the free space continues there, else NULL */
    size_t wrap_room; /* free bytes at the ring's start */
    size_t before;    /* bytes written before the wrap */
    int full;
} writer;

static void put_wrap(writer *w, const void *src, size_t n) {
    size_t room = (size_t)(w->end - w->p);
    if (w->full || w->wrap == NULL || n - room > w->wrap_room) {
        w->full = 1;
        w->p = w->end;
        return;
    }
    memcpy(w->p, src, room);
    w->before = (size_t)(w->end - w->base);
    w->base = w->wrap;
    w->p = w->wrap + (n - room);
    w->end = w->wrap + w->wrap_room;
    w->wrap = NULL;
    memcpy(w->base, (const uint8_t *)src + room, n - room);
}

static inline void put(writer *w, const void *src, size_t n) {
    if (LIKELY((size_t)(w->end - w->p) >= n)) {
        memcpy(w->p, src, n);
        w->p += n;
    } else {
        put_wrap(w, src, n);
    }
}

#define PUT_LIT(w, s) put((w), (s), sizeof(s) - 1)

/* n <= slot bytes from a buffer of `slot` bytes: with room for the whole slot, a fixed-size copy
 * (a few vector moves) is faster than an exact one; the bytes past n are overwritten later or
 * lie beyond the line. */
static inline void put_slot(writer *w, const void *src, size_t n, const size_t slot) {
    if (LIKELY((size_t)(w->end - w->p) >= slot)) {
        memcpy(w->p, src, slot);
        w->p += n;
    } else {
        put(w, src, n);
    }
}

static const char DIGIT_PAIRS[] = "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
                                  "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
                                  "8081828384858687888990919293949596979899";

static inline void put_pair(uint8_t *p, uint32_t v) { memcpy(p, DIGIT_PAIRS + 2 * v, 2); }

/* Exactly 8 digits of v < 10^8 (two independent halves: the divisions overlap). */
static inline uint8_t *fmt_8(uint8_t *p, uint32_t v) {
    uint32_t hi = v / 10000, lo = v % 10000;
    put_pair(p, hi / 100);
    put_pair(p + 2, hi % 100);
    put_pair(p + 4, lo / 100);
    put_pair(p + 6, lo % 100);
    return p + 8;
}

/* The digits of v < 10^8, no leading zeros. */
static inline uint8_t *fmt_small(uint8_t *p, uint32_t v) {
    size_t n = v < 10 ? 1 : v < 100 ? 2 : v < 1000 ? 3 : v < 10000 ? 4 : v < 100000 ? 5 : v < 1000000 ? 6
             : v < 10000000 ? 7 : 8;
    uint8_t *end = p + n, *q = end;
    while (v >= 100) {
        q -= 2;
        put_pair(q, v % 100);
        v /= 100;
    }
    if (v >= 10)
        put_pair(q - 2, v);
    else
        q[-1] = (uint8_t)('0' + v);
    return end;
}

/* Decimal digits of v at p (at most 20); returns the end.  In 8-digit chunks: timestamps have 19. */
static inline uint8_t *fmt_u64(uint8_t *p, uint64_t v) {
    if (v < 100000000u) return fmt_small(p, (uint32_t)v);
    uint64_t hi = v / 100000000u;
    uint32_t lo = (uint32_t)(v % 100000000u);
    if (hi < 100000000u) {
        p = fmt_small(p, (uint32_t)hi);
    } else {
        p = fmt_small(p, (uint32_t)(hi / 100000000u));
        p = fmt_8(p, (uint32_t)(hi % 100000000u));
    }
    return fmt_8(p, lo);
}

static inline void put_u64(writer *w, uint64_t v) {
    if (LIKELY(w->end - w->p >= 20)) {
        w->p = fmt_u64(w->p, v);
    } else {
        uint8_t buf[20];
        put(w, buf, (size_t)(fmt_u64(buf, v) - buf));
    }
}

static inline void put_i32(writer *w, int32_t v) {
    if (v < 0) PUT_LIT(w, "-");
    put_u64(w, v < 0 ? (uint64_t)(-(int64_t)v) : (uint64_t)v);
}

/* ------------------------------------------------------------------ strings (Go encoding/json) */

/* 0: a byte Go's encoder copies as it is; 1: an ASCII byte it rewrites (controls, '"', '\\', and
 * the HTML characters '<' '>' '&'); 2: a byte >= 0x80, to check as UTF-8. */
static const uint8_t BYTE_CLASS[256] = {
    [0x00 ... 0x1f] = 1, ['"'] = 1, ['\\'] = 1, ['<'] = 1, ['>'] = 1, ['&'] = 1, [0x80 ... 0xff] = 2,
};

/* Length of the valid UTF-8 sequence at s (2..4), or 0 if invalid: the rules of Go's utf8.DecodeRune
 * (no overlongs, no surrogates, nothing above U+10FFFF).  Never reads past a NUL. */
static size_t utf8_seq(const uint8_t *s) {
    uint8_t c = s[0];
    if (c >= 0xC2 && c <= 0xDF) return (s[1] & 0xC0) == 0x80 ? 2 : 0;
    if (c >= 0xE0 && c <= 0xEF) {
        uint8_t lo = 0x80, hi = 0xBF;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
        if (s[1] < lo || s[1] > hi) return 0;
        return (s[2] & 0xC0) == 0x80 ? 3 : 0;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        uint8_t lo = 0x80, hi = 0xBF;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
        if (s[1] < lo || s[1] > hi) return 0;
        if ((s[2] & 0xC0) != 0x80) return 0;
        return (s[3] & 0xC0) == 0x80 ? 4 : 0;
    }
    return 0;
}

/* U+2028 / U+2029, which Go escapes although they are valid. */
static inline int is_line_separator(const uint8_t *s) {
    return s[0] == 0xE2 && s[1] == 0x80 && (s[2] == 0xA8 || s[2] == 0xA9);
}

/* Go's encoding of an ASCII character of class 1. */
static void put_ascii_escape(writer *w, uint8_t c) {
    static const char hex[] = "0123456789abcdef";
    switch (c) {
    case '"': PUT_LIT(w, "\\\""); break;
    case '\\': PUT_LIT(w, "\\\\"); break;
    case '\n': PUT_LIT(w, "\\n"); break;
    case '\r': PUT_LIT(w, "\\r"); break;
    case '\t': PUT_LIT(w, "\\t"); break;
    case '\b': PUT_LIT(w, "\\b"); break;
    case '\f': PUT_LIT(w, "\\f"); break;
    default: {
        uint8_t esc[6] = {'\\', 'u', '0', '0', (uint8_t)hex[c >> 4], (uint8_t)hex[c & 0xF]};
        put(w, esc, sizeof esc);
    }
    }
}

/* Go's encoding of one decoded character (never a surrogate). */
static void put_rune(writer *w, uint32_t r) {
    uint8_t b[4];
    if (r < 0x80) {
        b[0] = (uint8_t)r;
        if (BYTE_CLASS[r])
            put_ascii_escape(w, b[0]);
        else
            put(w, b, 1);
    } else if (r == 0x2028) {
        PUT_LIT(w, "\\u2028");
    } else if (r == 0x2029) {
        PUT_LIT(w, "\\u2029");
    } else if (r < 0x800) {
        b[0] = (uint8_t)(0xC0 | (r >> 6));
        b[1] = (uint8_t)(0x80 | (r & 0x3F));
        put(w, b, 2);
    } else if (r < 0x10000) {
        b[0] = (uint8_t)(0xE0 | (r >> 12));
        b[1] = (uint8_t)(0x80 | ((r >> 6) & 0x3F));
        b[2] = (uint8_t)(0x80 | (r & 0x3F));
        put(w, b, 3);
    } else {
        b[0] = (uint8_t)(0xF0 | (r >> 18));
        b[1] = (uint8_t)(0x80 | ((r >> 12) & 0x3F));
        b[2] = (uint8_t)(0x80 | ((r >> 6) & 0x3F));
        b[3] = (uint8_t)(0x80 | (r & 0x3F));
        put(w, b, 4);
    }
}

static int hex_digit(uint8_t c) {
    if (c >= '0' && c <= '9') return c - '0';
    c |= 0x20;
    return c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* The code unit of "\uXXXX" at s, or -1 (stops at a NUL). */
static int32_t hex4(const uint8_t *s) {
    if (s[0] != '\\' || s[1] != 'u') return -1;
    int32_t v = 0;
    for (int i = 2; i < 6; i++) {
        int d = hex_digit(s[i]);
        if (d < 0) return -1;
        v = v << 4 | d;
    }
    return v;
}

/* Whether the rest of a C string, from a backslash on, can close a valid JSON string literal
 * (RFC 8259): only the escapes \" \\ \/ \b \f \n \r \t \uXXXX, no control character, no bare
 * quote, valid UTF-8. */
static int literal_rest_valid(const uint8_t *s) {
    for (;;) {
        uint8_t c = *s;
        if (c == 0) return 1;
        if (c < 0x20 || c == '"') return 0;
        if (c == '\\') {
            if (s[1] != 0 && strchr("\"\\/bfnrt", s[1]) != NULL) {
                s += 2;
            } else if (hex4(s) >= 0) {
                s += 6;
            } else {
                return 0;
            }
        } else if (c >= 0x80) {
            size_t n = utf8_seq(s);
            if (n == 0) return 0;
            s += n;
        } else {
            s++;
        }
    }
}

/* Decodes the escape at s as Go's json.Unmarshal does and writes the character as Go's encoder
 * does; returns what follows.  A \uXXXX surrogate pair is one character; a lone surrogate is
 * U+FFFD (and a following \uXXXX that does not complete it stands on its own). */
static const uint8_t *put_unescaped(writer *w, const uint8_t *s) {
    if (s[1] == '/') {
        PUT_LIT(w, "/");
        return s + 2;
    }
    if (s[1] != 'u') { /* \" \\ \b \f \n \r \t: Go writes the decoded character back the same way */
        put(w, s, 2);
        return s + 2;
    }
    uint32_t r = (uint32_t)hex4(s);
    s += 6;
    if (r >= 0xD800 && r < 0xE000) {
        int32_t low = r < 0xDC00 ? hex4(s) : -1;
        if (low >= 0xDC00 && low < 0xE000) {
            r = 0x10000 + ((r - 0xD800) << 10) + ((uint32_t)low - 0xDC00);
            s += 6;
        } else {
            r = 0xFFFD;
        }
    }
    put_rune(w, r);
    return s;
}

enum { MAYBE_LITERAL, DECODE, RAW };

/* The character at s that Go's encoder rewrites (class 1, invalid UTF-8, U+2028/9) -- or, once the
 * string is known to be a JSON literal, the escape at s, decoded; returns what follows. */
static const uint8_t *put_special(writer *w, const uint8_t *s, int *mode) {
    uint8_t c = *s;
    if (c == '\\' && *mode != RAW) {
        if (*mode == MAYBE_LITERAL) *mode = literal_rest_valid(s) ? DECODE : RAW;
        if (*mode == DECODE) return put_unescaped(w, s);
    }
    if (c >= 0x80) {
        if (utf8_seq(s) == 0) {
            *mode = RAW;
            PUT_LIT(w, "\\ufffd");
            return s + 1;
        }
        put_rune(w, s[2] == 0xA8 ? 0x2028 : 0x2029);
        return s + 3;
    }
    if (c < 0x20 || c == '"') *mode = RAW;
    put_ascii_escape(w, c);
    return s + 1;
}

/* A C string as a JSON string, the way TaskD's round trip writes it (NULL prints as "NULL").
 *
 * TaskD snprintf()s the raw bytes between quotes, json.Unmarshal()s the line and json.Marshal()s
 * it again.  So when `"` + raw + `"` is a valid JSON string literal, the name on disk is its
 * *decoded* text, encoded by Go: torch_npu's HCCL names arrive with their quotes pre-escaped
 * ({\"opName\":...}) and come out as {"opName":...}.  Any other string (TaskD would drop the
 * record) is escaped byte for byte as Go encodes a string of those bytes.  Both read the same for
 * a string without a backslash, so those take the plain loop; the check only runs from the first
 * backslash, everything before it having been checked on the way. */
static void put_str(writer *w, const char *str) {
    const uint8_t *s = (const uint8_t *)(str != NULL ? str : "NULL");
    int mode = MAYBE_LITERAL;
    PUT_LIT(w, "\"");
    for (;;) {
        uint8_t *p = w->p, *end = w->end; /* bytes Go copies as they are, copied while scanning */
        while (p < end && BYTE_CLASS[*s] == 0) *p++ = *s++;
        w->p = p;
        uint8_t c = *s;
        size_t n = 1;
        if (BYTE_CLASS[c] == 0 || (c >= 0x80 && (n = utf8_seq(s)) != 0 && !(n == 3 && is_line_separator(s)))) {
            put(w, s, n); /* at the end of the free stretch (put wraps or gives up), or valid UTF-8 */
            s += n;
        } else if (c == 0) {
            break;
        } else {
            s = put_special(w, s, &mode);
        }
    }
    PUT_LIT(w, "\"");
}

/* ------------------------------------------------------------------ records (Go json.Marshal) */

/* A line is a list of fields: the literal text before a value, the value's type and its offset in
 * the activity record (the structs are packed: values are read with memcpy). */
enum { V_END, V_I32, V_ID, V_U64, V_STR }; /* V_ID: a uint32 id of a pair (at off, off + 4) */
#define LIT_MAX 40
typedef struct {
    char lit[LIT_MAX];
    uint8_t len, type, off;
} field;
#define F(lit, type, off) {lit, sizeof(lit) - 1, type, off}
#define PT_A offsetof(msptiActivityMarker, objectId)
#define PT_B (offsetof(msptiActivityMarker, objectId) + 4)

/* MsptiActivityMark: the 8-byte object-id union is printed twice, as Pt and as Ds. */
static const field MARKER_LINE[] = {
    F("{\"Kind\":", V_I32, 0),
    F(",\"Flag\":", V_I32, offsetof(msptiActivityMarker, flag)),
    F(",\"SourceKind\":", V_I32, offsetof(msptiActivityMarker, sourceKind)),
    F(",\"Timestamp\":", V_U64, offsetof(msptiActivityMarker, timestamp)),
    F(",\"Id\":", V_U64, offsetof(msptiActivityMarker, id)),
    F(",\"MsptiObjectId\":{\"Pt\":{\"ProcessId\":", V_ID, PT_A),
    F(",\"ThreadId\":", V_ID, PT_B),
    F("},\"Ds\":{\"DeviceId\":", V_ID, PT_A),
    F(",\"StreamId\":", V_ID, PT_B),
    F("}},\"Name\":", V_STR, offsetof(msptiActivityMarker, name)),
    F(",\"Domain\":", V_STR, offsetof(msptiActivityMarker, domain)),
    F("}\n", V_END, 0),
};
static const field API_LINE[] = {
    F("{\"Kind\":", V_I32, 0),
    F(",\"Start\":", V_U64, offsetof(msptiActivityApi, start)),
    F(",\"End\":", V_U64, offsetof(msptiActivityApi, end)),
    F(",\"Pt\":{\"ProcessId\":", V_ID, offsetof(msptiActivityApi, pt)),
    F(",\"ThreadId\":", V_ID, offsetof(msptiActivityApi, pt) + 4),
    F("},\"CorrelationId\":", V_U64, offsetof(msptiActivityApi, correlationId)),
    F(",\"Name\":", V_STR, offsetof(msptiActivityApi, name)),
    F("}\n", V_END, 0),
};
static const field KERNEL_LINE[] = {
    F("{\"Kind\":", V_I32, 0),
    F(",\"Start\":", V_U64, offsetof(msptiActivityKernel, start)),
    F(",\"End\":", V_U64, offsetof(msptiActivityKernel, end)),
    F(",\"Ds\":{\"DeviceId\":", V_ID, offsetof(msptiActivityKernel, ds)),
    F(",\"StreamId\":", V_ID, offsetof(msptiActivityKernel, ds) + 4),
    F("},\"CorrelationId\":", V_U64, offsetof(msptiActivityKernel, correlationId)),
    F(",\"Type\":", V_STR, offsetof(msptiActivityKernel, type)),
    F(",\"Name\":", V_STR, offsetof(msptiActivityKernel, name)),
    F("}\n", V_END, 0),
};

/* The text of the last process/thread (or device/stream) id printed: Pt and Ds print the same
 * union, and consecutive records mostly come from one thread. */
typedef struct {
    uint32_t value;
    uint8_t len; /* 0: empty */
    uint8_t text[16];
} id_text;

static void put_id(writer *w, id_text *memo, uint32_t v) {
    if (memo->value != v || memo->len == 0) {
        memo->value = v;
        memo->len = (uint8_t)(fmt_u64(memo->text, v) - memo->text);
    }
    put_slot(w, memo->text, memo->len, sizeof memo->text);
}

/* ids: the memo of each id of a pair, indexed by its offset / 4 % 2 (the two never share one) */
static void put_line(writer *w, const uint8_t *rec, const field *f, id_text ids[2]) {
    for (;; f++) {
        put_slot(w, f->lit, f->len, LIT_MAX);
        int32_t i32;
        uint32_t u32;
        uint64_t u64;
        const char *str;
        switch (f->type) {
        case V_END: return;
        case V_I32:
            memcpy(&i32, rec + f->off, sizeof i32);
            put_i32(w, i32);
            break;
        case V_ID:
            memcpy(&u32, rec + f->off, sizeof u32);
            put_id(w, &ids[(f->off >> 2) & 1], u32);
            break;
        case V_U64:
            memcpy(&u64, rec + f->off, sizeof u64);
            put_u64(w, u64);
            break;
        default:
            memcpy(&str, rec + f->off, sizeof str);
            put_str(w, str);
        }
    }
}

enum { WRITTEN, DROPPED, SKIPPED };

/* One record -> one line at the ring's head.  prod_mu held. */
static int emit_record(const uint8_t *rec, uint64_t *bytes, id_text ids[2]) {
    int32_t kind;
    memcpy(&kind, rec, sizeof kind);
    const field *line = kind == MSPTI_ACTIVITY_KIND_MARKER ? MARKER_LINE
                        : kind == MSPTI_ACTIVITY_KIND_API  ? API_LINE
                        : kind == MSPTI_ACTIVITY_KIND_KERNEL ? KERNEL_LINE
                                                             : NULL;
    if (line == NULL) return SKIPPED;
    uint64_t head = atomic_load_explicit(&G.head, memory_order_relaxed);
    uint64_t used = (mark_bytes(head) - mark_bytes(atomic_load_explicit(&G.tail, memory_order_acquire))) &
                    MARK_BYTES_MASK;
    size_t room = G.cap - (size_t)used;
    size_t pos = G.head_pos, first = G.cap - pos < room ? G.cap - pos : room;
    writer w = {.p = G.ring + pos, .end = G.ring + pos + first, .base = G.ring + pos};
    if (room > first) {
        w.wrap = G.ring;
        w.wrap_room = room - first;
    }
    put_line(&w, rec, line, ids);
    if (w.full) return DROPPED;
    size_t len = w.before + (size_t)(w.p - w.base);
    pos += len;
    G.head_pos = pos >= G.cap ? pos - G.cap : pos;
    atomic_store_explicit(&G.head, mark(mark_bytes(head) + len, mark_lines(head) + 1), memory_order_release);
    *bytes += len;
    return WRITTEN;
}

/* ------------------------------------------------------------------ MSPTI callbacks (no GIL) */

static inline int enter(void) {
    atomic_fetch_add(&G.inflight, 1);
    if (atomic_load(&G.closed)) {
        atomic_fetch_sub(&G.inflight, 1);
        return 0;
    }
    return 1;
}

static inline void leave(void) { atomic_fetch_sub(&G.inflight, 1); }

static void on_request(uint8_t **buffer, size_t *size, size_t *maxNumRecords) {
    if (buffer == NULL) return;
    *buffer = NULL;
    if (size != NULL) *size = 0;
    if (maxNumRecords != NULL) *maxNumRecords = 0;
    if (!enter()) return;
    count(C_BUFFERS_REQUESTED, 1);
    uint8_t *out = NULL;
    pthread_mutex_lock(&G.pool_mu);
    if (G.nfree > 0) out = G.slab + (size_t)G.free_stack[--G.nfree] * G.buf_bytes;
    pthread_mutex_unlock(&G.pool_mu);
    if (out == NULL) {
        count(C_BUFFERS_DECLINED, 1);
    } else {
        *buffer = out;
        if (size != NULL) *size = G.buf_bytes;
    }
    leave();
}

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void on_complete(uint8_t *buffer, size_t size, size_t validSize) {
    uint64_t start = now_ns();
    (void)size;
    if (buffer == NULL || !enter()) return;
    uintptr_t base = (uintptr_t)G.slab, p = (uintptr_t)buffer;
    if (p < base || p >= base + G.nbuf * G.buf_bytes || (p - base) % G.buf_bytes != 0) {
        leave(); /* not one of ours (e.g. a buffer from a previous, closed collector) */
        return;
    }
    if (validSize > G.buf_bytes) validSize = G.buf_bytes;
    uint64_t n[3] = {0}, bytes = 0;
    id_text ids[2] = {{0}, {0}};
    msptiActivity *rec = NULL;
    pthread_mutex_lock(&G.prod_mu);
    while (G.api.get_next(buffer, validSize, &rec) == MSPTI_SUCCESS && rec != NULL)
        n[emit_record((const uint8_t *)rec, &bytes, ids)]++;
    pthread_mutex_unlock(&G.prod_mu);
    count(C_RECORDS, n[WRITTEN]);
    count(C_RECORDS_DROPPED, n[DROPPED]);
    count(C_RECORDS_SKIPPED, n[SKIPPED]);
    count(C_BYTES, bytes);
    pthread_mutex_lock(&G.pool_mu);
    G.free_stack[G.nfree++] = (uint32_t)((p - base) / G.buf_bytes);
    pthread_mutex_unlock(&G.pool_mu);
    count(C_BUFFERS_COMPLETED, 1);
    uint64_t spent = now_ns() - start;
    count(C_COMPLETE_NS, spent);
    count_max(C_COMPLETE_MAX_NS, spent);
    leave();
}

/* ------------------------------------------------------------------ Python type */

typedef struct {
    PyObject_HEAD
    int owner; /* this object opened the global state and has not closed it */
    int subscribed;
    int closing;              /* close has begun: set_switch refuses from now on (switch_mu held) */
    msptiSubscriberHandle handle;
    pthread_mutex_t switch_mu; /* serialises the switch sequences (set_switch, and close's switch-off) */
    pthread_mutex_t mu;       /* the consumer side: the ring's tail while owner, else the leftover */
    PyObject *leftover;       /* ring contents at close (bytes), handed out by the next drains */
    Py_ssize_t leftover_off;  /* how much of it is consumed */
    uint64_t final_counters[C_COUNT];
    pid_t pid;                /* the process that opened it; inert in any other (a forked child) */
} Collector;

/* Opened by another process: this is a fork of it, and the state is that process's. */
static inline int foreign(const Collector *self) { return self->pid != 0 && self->pid != getpid(); }

static PyObject *foreign_error(const Collector *self) {
    return PyErr_Format(PyExc_ValueError, "Collector belongs to process %ld, not to this fork of it", (long)self->pid);
}

/* pthread_atfork, in the child: only the forking thread is left, so the MSPTI threads and the
 * worker's writer are gone, and any lock they held stays held.  The inherited state is the
 * parent's: callbacks are turned away, the Collector that had it opened keeps its counters and
 * goes inert (foreign()), and the state may be opened afresh. */
static void after_fork_in_child(void) {
    atomic_store(&G.closed, 1);
    atomic_store(&G.inflight, 0);
    if (G.owner_final != NULL)
        for (int i = 0; i < C_COUNT; i++) G.owner_final[i] = atomic_load(&G.counters[i]);
    G.owner_final = NULL;
    G.open = 0;
    pthread_mutex_init(&G.pool_mu, NULL);
    pthread_mutex_init(&G.prod_mu, NULL);
}

/* The complete lines waiting: a, then b (the part after the ring's wrap), `lines` of them.
 * self->mu held. */
typedef struct {
    const uint8_t *a, *b;
    size_t na, nb, lines;
} waiting_lines;

static size_t count_lines(const uint8_t *p, size_t n) {
    size_t lines = 0;
    const uint8_t *end = p + n;
    while (p < end && (p = memchr(p, '\n', (size_t)(end - p))) != NULL) {
        lines++;
        p++;
    }
    return lines;
}

static waiting_lines waiting(Collector *self) {
    waiting_lines v = {NULL, NULL, 0, 0, 0};
    if (self->owner) {
        uint64_t head = atomic_load_explicit(&G.head, memory_order_acquire);
        uint64_t tail = atomic_load_explicit(&G.tail, memory_order_relaxed);
        size_t n = (size_t)((mark_bytes(head) - mark_bytes(tail)) & MARK_BYTES_MASK);
        size_t first = G.cap - G.tail_pos;
        v.a = G.ring + G.tail_pos;
        v.na = n <= first ? n : first;
        v.b = G.ring;
        v.nb = n - v.na;
        v.lines = (size_t)((mark_lines(head) - mark_lines(tail)) & MARK_LINES_MASK);
    } else if (self->leftover != NULL) {
        v.a = (const uint8_t *)PyBytes_AS_STRING(self->leftover) + self->leftover_off;
        v.na = (size_t)(PyBytes_GET_SIZE(self->leftover) - self->leftover_off);
        v.lines = count_lines(v.a, v.na); /* once, at the end */
    }
    return v;
}

/* Producers only write past the head, so what waiting() saw stays put until consume(). */
static void consume(Collector *self, size_t n, size_t lines) {
    if (self->owner) {
        size_t pos = G.tail_pos + n;
        G.tail_pos = pos >= G.cap ? pos - G.cap : pos;
        uint64_t tail = atomic_load_explicit(&G.tail, memory_order_relaxed);
        atomic_store_explicit(&G.tail, mark(mark_bytes(tail) + n, mark_lines(tail) + lines), memory_order_release);
    } else {
        self->leftover_off += (Py_ssize_t)n;
    }
}

/* Bytes of the whole lines at the front of v that fit in max_bytes (all of them when negative). */
static size_t whole_lines(waiting_lines v, Py_ssize_t max_bytes) {
    size_t n = v.na + v.nb;
    if (max_bytes < 0 || (size_t)max_bytes >= n) return n;
    size_t m = (size_t)max_bytes;
    if (m > v.na) {
        const uint8_t *nl = memrchr(v.b, '\n', m - v.na);
        if (nl != NULL) return v.na + (size_t)(nl - v.b) + 1;
        m = v.na;
    }
    const uint8_t *nl = memrchr(v.a, '\n', m);
    return nl != NULL ? (size_t)(nl - v.a) + 1 : 0;
}

static size_t first_part(waiting_lines v, size_t n) { return n < v.na ? n : v.na; }

/* The lines in the first n bytes of v (whole lines). */
static size_t lines_in(waiting_lines v, size_t n) {
    if (n == v.na + v.nb) return v.lines;
    size_t na = first_part(v, n);
    return count_lines(v.a, na) + count_lines(v.b, n - na);
}

/* write(2)s the first n bytes of v, through partial writes and EINTR; 0 or an errno. */
static int write_lines(int fd, waiting_lines v, size_t n, size_t *written) {
    size_t na = first_part(v, n);
    const uint8_t *part[2] = {v.a, v.b};
    size_t left[2] = {na, n - na};
    *written = 0;
    for (int i = 0; i < 2; i++) {
        const uint8_t *p = part[i];
        while (left[i] > 0) {
            ssize_t k = write(fd, p, left[i] < ((size_t)1 << 30) ? left[i] : ((size_t)1 << 30));
            if (k < 0) {
                if (errno == EINTR) continue;
                return errno;
            }
            if (k == 0) return EIO;
            p += k;
            left[i] -= (size_t)k;
            *written += (size_t)k;
        }
    }
    return 0;
}

/* Takes self->mu without holding the GIL while it waits (the lock order is mu, then the GIL). */
static void lock_consumer(Collector *self) {
    if (pthread_mutex_trylock(&self->mu) != 0) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&self->mu);
        Py_END_ALLOW_THREADS
    }
}

/* All waiting lines as bytes, consumed.  self->mu and the GIL held. */
static PyObject *take_all(Collector *self) {
    if (!self->owner && self->leftover != NULL && self->leftover_off == 0) {
        PyObject *out = self->leftover;
        self->leftover = NULL;
        return out;
    }
    waiting_lines v = waiting(self);
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(v.na + v.nb));
    if (out == NULL) return NULL;
    if (v.na) memcpy(PyBytes_AS_STRING(out), v.a, v.na);
    if (v.nb) memcpy(PyBytes_AS_STRING(out) + v.na, v.b, v.nb);
    consume(self, v.na + v.nb, v.lines);
    return out;
}

/* TaskD's per-domain switch results, as its STATUS reply reports them. */
enum { SWITCH_OFF = 0, SWITCH_ON = 1, SWITCH_EXCEPTION = 2 };

/* TaskD's switch sequence.  Returns the two results through `out` (default domain, then the
 * communication domain): on or off as asked, or an exception when an MSPTI call for that domain
 * did not return MSPTI_SUCCESS (the subscribe when it is needed and the MARKER enable when
 * switching on; the three disables and the unsubscribe when switching off; the marker-domain call
 * for communication).  The calls made do not depend on the results. */
static void switch_calls(Collector *self, int default_on, int comm_on, int out[2]) {
    mspti_api *api = &G.api;
    int default_ok = 1;
    if (default_on) {
        if (!self->subscribed) {
            msptiSubscriberHandle h = NULL;
            if (api->subscribe(&h, NULL, NULL) == MSPTI_SUCCESS) {
                self->subscribed = 1;
                self->handle = h;
            } else {
                default_ok = 0; /* e.g. another profiler holds MSPTI's only subscriber slot */
            }
        }
        if (api->enable(MSPTI_ACTIVITY_KIND_MARKER) != MSPTI_SUCCESS) default_ok = 0;
    } else {
        if (api->disable(MSPTI_ACTIVITY_KIND_MARKER) != MSPTI_SUCCESS) default_ok = 0;
        if (api->disable(MSPTI_ACTIVITY_KIND_KERNEL) != MSPTI_SUCCESS) default_ok = 0;
        if (api->disable(MSPTI_ACTIVITY_KIND_API) != MSPTI_SUCCESS) default_ok = 0;
        if (self->subscribed) {
            if (api->unsubscribe(self->handle) != MSPTI_SUCCESS) default_ok = 0;
            self->subscribed = 0;
            self->handle = NULL;
        }
    }
    msptiResult comm_rc = comm_on ? api->enable_domain("communication") : api->disable_domain("communication");
    out[0] = default_ok ? (default_on ? SWITCH_ON : SWITCH_OFF) : SWITCH_EXCEPTION;
    out[1] = comm_rc == MSPTI_SUCCESS ? (comm_on ? SWITCH_ON : SWITCH_OFF) : SWITCH_EXCEPTION;
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Switch off, flush, wait for in-flight callbacks, free.  With `release_gil` the MSPTI calls run
 * without the GIL (they may call our callbacks synchronously, which never need it); without it
 * (dealloc) no other thread can hold self->mu. */
static int do_close(Collector *self, int release_gil) {
    if (!self->owner || foreign(self)) return 0;
    PyThreadState *ts = release_gil ? PyEval_SaveThread() : NULL;
    pthread_mutex_lock(&self->switch_mu);
    if (self->closing) { /* another thread is closing it */
        pthread_mutex_unlock(&self->switch_mu);
        if (ts != NULL) PyEval_RestoreThread(ts);
        return 0;
    }
    self->closing = 1;
    int ignored[2];
    switch_calls(self, 0, 0, ignored);
    pthread_mutex_unlock(&self->switch_mu);
    G.api.flush_all(1);
    atomic_store(&G.closed, 1);
    int waited = 0;
    while (atomic_load(&G.inflight) != 0 && waited < 5000) {
        sleep_ms(1);
        waited++;
    }
    int quiet = atomic_load(&G.inflight) == 0;
    pthread_mutex_lock(&self->mu);
    if (ts != NULL) PyEval_RestoreThread(ts);

    for (int i = 0; i < C_COUNT; i++) self->final_counters[i] = atomic_load(&G.counters[i]);
    if (quiet) {
        PyObject *rest = take_all(self);
        if (rest == NULL) {
            PyErr_Clear();
        } else {
            Py_XSETREF(self->leftover, rest);
            self->leftover_off = 0;
        }
        free(G.ring);
        G.ring = NULL;
        G.cap = 1;
        G.head_pos = G.tail_pos = 0;
        atomic_store(&G.head, 0);
        atomic_store(&G.tail, 0);
        if (G.nfree == G.nbuf) { /* MSPTI holds none of our buffers: safe to free them */
            free(G.slab);
            free(G.free_stack);
        }
        G.slab = NULL;
        G.free_stack = NULL;
        G.nbuf = G.nfree = 0;
        G.buf_bytes = 1;
    } /* else: a callback is stuck somewhere; leak everything (pointers stay valid) rather than risk a
       * use after free */
    G.open = 0;
    G.owner_final = NULL;
    self->owner = 0;
    pthread_mutex_unlock(&self->mu);
    return 0;
}

static int collector_open(Collector *self, const char *lib_path, Py_ssize_t buffers, Py_ssize_t buffer_bytes,
                          Py_ssize_t ring_bytes);

static PyObject *Collector_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    (void)args;
    (void)kwds;
    Collector *self = (Collector *)type->tp_alloc(type, 0);
    if (self != NULL) {
        pthread_mutex_init(&self->mu, NULL);
        pthread_mutex_init(&self->switch_mu, NULL);
    }
    return (PyObject *)self;
}

static int Collector_init(Collector *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"lib_path", "buffers", "buffer_bytes", "ring_bytes", NULL};
    PyObject *path_obj = NULL; /* str or os.PathLike, encoded with the filesystem encoding */
    Py_ssize_t buffers = 32, buffer_bytes = 1 << 20, ring_bytes = (Py_ssize_t)64 << 20;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&|$nnn:Collector", kwlist, PyUnicode_FSConverter, &path_obj,
                                     &buffers, &buffer_bytes, &ring_bytes))
        return -1;
    int rc = collector_open(self, PyBytes_AS_STRING(path_obj), buffers, buffer_bytes, ring_bytes);
    Py_DECREF(path_obj);
    return rc;
}

static int collector_open(Collector *self, const char *lib_path, Py_ssize_t buffers, Py_ssize_t buffer_bytes,
                          Py_ssize_t ring_bytes) {
    if (self->owner) {
        PyErr_SetString(PyExc_RuntimeError, "Collector already initialised");
        return -1;
    }
    if (buffers < 1 || buffers > 1000000) {
        PyErr_SetString(PyExc_ValueError, "buffers must be between 1 and 1000000");
        return -1;
    }
    if (buffer_bytes < 64 || (size_t)buffer_bytes > SIZE_MAX / (size_t)buffers) {
        PyErr_SetString(PyExc_ValueError, "buffer_bytes must be at least 64");
        return -1;
    }
    if (ring_bytes < 256 || ring_bytes > MAX_RING_BYTES) {
        PyErr_SetString(PyExc_ValueError, "ring_bytes must be between 256 and 1 GiB");
        return -1;
    }
    if (G.open) {
        PyErr_SetString(PyExc_RuntimeError, "another agent._native.Collector is open in this process; close it first");
        return -1;
    }

    void *h = dlopen(lib_path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        const char *err = dlerror();
        PyErr_Format(PyExc_OSError, "cannot load %s: %s", lib_path, err ? err : "unknown error");
        return -1;
    }
    mspti_api api;
    struct {
        const char *name;
        void **slot;
    } syms[] = {
        {"msptiActivityEnable", (void **)&api.enable},
        {"msptiActivityDisable", (void **)&api.disable},
        {"msptiActivityGetNextRecord", (void **)&api.get_next},
        {"msptiActivityRegisterCallbacks", (void **)&api.register_callbacks},
        {"msptiActivityFlushAll", (void **)&api.flush_all},
        {"msptiActivityEnableMarkerDomain", (void **)&api.enable_domain},
        {"msptiActivityDisableMarkerDomain", (void **)&api.disable_domain},
        {"msptiSubscribe", (void **)&api.subscribe},
        {"msptiUnsubscribe", (void **)&api.unsubscribe},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        dlerror();
        void *p = dlsym(h, syms[i].name);
        if (p == NULL) {
            const char *err = dlerror();
            PyErr_Format(PyExc_OSError, "%s: missing symbol %s%s%s", lib_path, syms[i].name, err ? ": " : "",
                         err ? err : "");
            dlclose(h);
            return -1;
        }
        *syms[i].slot = p;
    }
    /* The library handle is never closed: MSPTI threads may outlive this object. */

    uint8_t *slab = NULL;
    if (posix_memalign((void **)&slab, 64, (size_t)buffers * (size_t)buffer_bytes) != 0) slab = NULL;
    uint32_t *stack = malloc(sizeof(uint32_t) * (size_t)buffers);
    uint8_t *ring = malloc((size_t)ring_bytes);
    if (slab == NULL || stack == NULL || ring == NULL) {
        free(slab);
        free(stack);
        free(ring);
        PyErr_NoMemory();
        return -1;
    }
    G.api = api;
    G.slab = slab;
    G.nbuf = (size_t)buffers;
    G.buf_bytes = (size_t)buffer_bytes;
    G.free_stack = stack;
    for (size_t i = 0; i < G.nbuf; i++) stack[i] = (uint32_t)(G.nbuf - 1 - i);
    G.nfree = G.nbuf;
    G.ring = ring;
    G.cap = (size_t)ring_bytes;
    G.head_pos = G.tail_pos = 0;
    atomic_store(&G.head, 0);
    atomic_store(&G.tail, 0);
    for (int i = 0; i < C_COUNT; i++) atomic_store(&G.counters[i], 0);
    G.open = 1;
    G.owner_final = self->final_counters;
    self->owner = 1;
    self->pid = getpid();
    self->subscribed = 0;
    self->closing = 0;
    self->handle = NULL;
    Py_CLEAR(self->leftover);
    self->leftover_off = 0;
    atomic_store(&G.closed, 0);

    msptiResult rc = api.register_callbacks(on_request, on_complete);
    if (rc != MSPTI_SUCCESS) {
        do_close(self, 0);
        PyErr_Format(PyExc_OSError, "%s: msptiActivityRegisterCallbacks failed with %d", lib_path, (int)rc);
        return -1;
    }
    return 0;
}

static PyObject *Collector_set_switch(Collector *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"default_on", "comm_on", NULL};
    int default_on, comm_on;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "pp:set_switch", kwlist, &default_on, &comm_on)) return NULL;
    if (foreign(self)) return foreign_error(self);
    if (!self->owner) {
        PyErr_SetString(PyExc_ValueError, "Collector is closed");
        return NULL;
    }
    int results[2], closed;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->switch_mu);
    closed = self->closing;
    if (!closed) switch_calls(self, default_on, comm_on, results);
    pthread_mutex_unlock(&self->switch_mu);
    Py_END_ALLOW_THREADS
    if (closed) {
        PyErr_SetString(PyExc_ValueError, "Collector is closed");
        return NULL;
    }
    return Py_BuildValue("(ii)", results[0], results[1]);
}

static PyObject *Collector_drain(Collector *self, PyObject *Py_UNUSED(ignored)) {
    if (foreign(self)) return PyBytes_FromStringAndSize(NULL, 0);
    lock_consumer(self);
    PyObject *out = take_all(self);
    pthread_mutex_unlock(&self->mu);
    return out;
}

static int parse_max_bytes(PyObject *args, PyObject *kwds, const char *format, Py_ssize_t *max_bytes) {
    static char *kwlist[] = {"max_bytes", NULL};
    *max_bytes = -1;
    return PyArg_ParseTupleAndKeywords(args, kwds, format, kwlist, max_bytes);
}

static PyObject *Collector_pending(Collector *self, PyObject *args, PyObject *kwds) {
    Py_ssize_t max_bytes;
    if (!parse_max_bytes(args, kwds, "|n:pending", &max_bytes)) return NULL;
    if (foreign(self)) return PyLong_FromLong(0);
    lock_consumer(self);
    size_t n = whole_lines(waiting(self), max_bytes);
    pthread_mutex_unlock(&self->mu);
    return PyLong_FromSize_t(n);
}

static PyObject *Collector_discard(Collector *self, PyObject *args, PyObject *kwds) {
    Py_ssize_t max_bytes;
    if (!parse_max_bytes(args, kwds, "|n:discard", &max_bytes)) return NULL;
    if (foreign(self)) return Py_BuildValue("(nn)", (Py_ssize_t)0, (Py_ssize_t)0);
    lock_consumer(self);
    waiting_lines v = waiting(self);
    size_t n = whole_lines(v, max_bytes), lines = lines_in(v, n);
    consume(self, n, lines);
    pthread_mutex_unlock(&self->mu);
    return Py_BuildValue("(nn)", (Py_ssize_t)n, (Py_ssize_t)lines);
}

/* Just past the newline that ends the line holding byte `from` of v (whose first n bytes are whole lines). */
static size_t line_end(waiting_lines v, size_t from, size_t n) {
    if (from < v.na) {
        const uint8_t *nl = memchr(v.a + from, '\n', v.na - from);
        if (nl != NULL) return (size_t)(nl - v.a) + 1;
        from = v.na;
    }
    const uint8_t *nl = memchr(v.b + (from - v.na), '\n', n - from);
    return nl != NULL ? v.na + (size_t)(nl - v.b) + 1 : n;
}

/* Bytes [from, to) of v to dst. */
static void copy_range(waiting_lines v, size_t from, size_t to, uint8_t *dst) {
    if (from < v.na) {
        size_t k = (to < v.na ? to : v.na) - from;
        memcpy(dst, v.a + from, k);
        dst += k;
        from += k;
    }
    if (to > from) memcpy(dst, v.b + (from - v.na), to - from);
}

/* What a failed drain_to took: all of it is gone from the collector. */
typedef struct {
    size_t written;     /* bytes that reached the file before the error */
    size_t size, lines; /* the batch */
    size_t whole, whole_lines; /* its complete lines within `written` */
    uint8_t *rest;      /* malloc'd: the bytes that complete the line cut at `written` (NULL: none) */
    size_t rest_len;
} drain_failure;

/* OSError(errno) carrying a drain_failure as the attributes written, size, lines, whole,
 * whole_lines and rest (bytes; empty when the write stopped at a line's end). */
static PyObject *drain_error(int err, const drain_failure *f) {
    PyObject *exc = PyObject_CallFunction(PyExc_OSError, "is", err, strerror(err));
    if (exc == NULL) return NULL;
    const char *names[] = {"written", "size", "lines", "whole", "whole_lines", "rest"};
    size_t values[] = {f->written, f->size, f->lines, f->whole, f->whole_lines};
    for (int i = 0; i < 6; i++) {
        PyObject *v = i < 5 ? PyLong_FromSize_t(values[i])
                            : PyBytes_FromStringAndSize((const char *)f->rest, f->rest != NULL ? (Py_ssize_t)f->rest_len : 0);
        if (v == NULL || PyObject_SetAttrString(exc, names[i], v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(exc);
            return NULL;
        }
        Py_DECREF(v);
    }
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
    return NULL;
}

static PyObject *Collector_drain_to(Collector *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"fd", "max_bytes", NULL};
    PyObject *file;
    Py_ssize_t max_bytes = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|n:drain_to", kwlist, &file, &max_bytes)) return NULL;
    int fd = PyObject_AsFileDescriptor(file);
    if (fd < 0) return NULL;
    if (foreign(self)) return Py_BuildValue("(nn)", (Py_ssize_t)0, (Py_ssize_t)0);
    size_t n, lines;
    drain_failure f = {0};
    int err;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    waiting_lines v = waiting(self);
    n = whole_lines(v, max_bytes);
    lines = lines_in(v, n);
    err = write_lines(fd, v, n, &f.written);
    if (err != 0) {
        /* cut short: the caller keeps the whole lines and truncates the cut one away, or completes
         * it with `rest` -- copied now, as the ring reuses the space once it is consumed */
        f.size = n;
        f.lines = lines;
        f.whole = whole_lines(v, (Py_ssize_t)f.written);
        f.whole_lines = lines_in(v, f.whole);
        if (f.written > f.whole) {
            f.rest_len = line_end(v, f.written, n) - f.written;
            f.rest = malloc(f.rest_len);
            if (f.rest != NULL) copy_range(v, f.written, f.written + f.rest_len, f.rest);
        }
    }
    consume(self, n, lines);
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    if (err != 0) {
        PyObject *r = drain_error(err, &f);
        free(f.rest);
        return r;
    }
    return Py_BuildValue("(nn)", (Py_ssize_t)n, (Py_ssize_t)lines);
}

static PyObject *Collector_flush(Collector *self, PyObject *Py_UNUSED(ignored)) {
    if (self->owner && !foreign(self)) {
        Py_BEGIN_ALLOW_THREADS
        G.api.flush_all(1);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyObject *Collector_close(Collector *self, PyObject *Py_UNUSED(ignored)) {
    do_close(self, 1);
    Py_RETURN_NONE;
}

static PyObject *Collector_counters(Collector *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    for (int i = 0; i < C_COUNT; i++) {
        uint64_t v = self->owner && !foreign(self) ? atomic_load(&G.counters[i]) : self->final_counters[i];
        PyObject *n = PyLong_FromUnsignedLongLong(v);
        if (n == NULL || PyDict_SetItemString(d, counter_names[i], n) < 0) {
            Py_XDECREF(n);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(n);
    }
    return d;
}

static PyObject *Collector_enter(Collector *self, PyObject *Py_UNUSED(ignored)) {
    Py_INCREF(self);
    return (PyObject *)self;
}

static PyObject *Collector_exit(Collector *self, PyObject *Py_UNUSED(args)) {
    do_close(self, 1);
    Py_RETURN_FALSE;
}

static void Collector_dealloc(Collector *self) {
    /* May run at interpreter exit while MSPTI threads are still delivering buffers. */
    int inherited = foreign(self); /* in a fork: its locks may be held for good, so left alone */
    do_close(self, 0);
    Py_CLEAR(self->leftover);
    if (!inherited) {
        pthread_mutex_destroy(&self->mu);
        pthread_mutex_destroy(&self->switch_mu);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Collector_methods[] = {
    {"set_switch", (PyCFunction)(void (*)(void))Collector_set_switch, METH_VARARGS | METH_KEYWORDS,
     "set_switch(default_on, comm_on) -> (default_result, comm_result): TaskD's switch: MARKER kind on/off, then "
     "the communication domain; each result is 0 off, 1 on, 2 exception (an MSPTI call of that domain failed)."},
    {"drain", (PyCFunction)Collector_drain, METH_NOARGS, "drain() -> bytes: all complete lines since the last drain."},
    {"drain_to", (PyCFunction)(void (*)(void))Collector_drain_to, METH_VARARGS | METH_KEYWORDS,
     "drain_to(fd, max_bytes=-1) -> (bytes, lines): write(2) the complete lines waiting (as many whole\n"
     "lines as fit in max_bytes; all when negative) straight from the collector to fd, without the GIL.\n"
     "The lines taken are consumed either way: on an error OSError(errno) is raised with `written`\n"
     "(bytes that reached fd), `size` and `lines` (what was taken), `whole` and `whole_lines` (the\n"
     "complete lines within `written`) and `rest` (bytes completing the line cut at `written`, or b'')."},
    {"pending", (PyCFunction)(void (*)(void))Collector_pending, METH_VARARGS | METH_KEYWORDS,
     "pending(max_bytes=-1) -> int: bytes of the complete lines waiting (of those that fit in max_bytes)."},
    {"discard", (PyCFunction)(void (*)(void))Collector_discard, METH_VARARGS | METH_KEYWORDS,
     "discard(max_bytes=-1) -> (bytes, lines): drop the complete lines that drain_to would write."},
    {"flush", (PyCFunction)Collector_flush, METH_NOARGS, "flush(): msptiActivityFlushAll(1) without the GIL."},
    {"close", (PyCFunction)Collector_close, METH_NOARGS, "close(): switch off, flush, wait for callbacks, free."},
    {"counters", (PyCFunction)Collector_counters, METH_NOARGS, "counters() -> dict of collector counters."},
    {"__enter__", (PyCFunction)Collector_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Collector_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CollectorType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agent._native.Collector",
    .tp_doc = PyDoc_STR("Collector(lib_path, *, buffers=32, buffer_bytes=1<<20, ring_bytes=64<<20)\n\n"
                        "MSPTI activity buffers -> TaskD JSON lines, serialised in MSPTI's threads."),
    .tp_basicsize = sizeof(Collector),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Collector_new,
    .tp_init = (initproc)Collector_init,
    .tp_dealloc = (destructor)Collector_dealloc,
    .tp_methods = Collector_methods,
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "agent._native",
    .m_doc = "Native MSPTI activity-buffer collector (TaskD-compatible JSON lines).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__native(void) {
    static int atfork_registered;
    if (!atfork_registered) {
        if (pthread_atfork(NULL, NULL, after_fork_in_child) != 0) return PyErr_NoMemory();
        atfork_registered = 1;
    }
    if (PyType_Ready(&CollectorType) < 0) return NULL;
    PyObject *m = PyModule_Create(&native_module);
    if (m == NULL) return NULL;
    Py_INCREF(&CollectorType);
    if (PyModule_AddObject(m, "Collector", (PyObject *)&CollectorType) < 0) {
        Py_DECREF(&CollectorType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
