/* agent._native: MSPTI activity-buffer collector.
 *
 * The request/complete callbacks run on MSPTI's threads without the GIL:
 *  - request hands out a buffer from a preallocated pool (a tiny mutex, never waits for a buffer;
 *    an empty pool declines the request with *buffer = NULL and counts it);
 *  - complete walks the records with msptiActivityGetNextRecord and serialises each one straight
 *    into a byte ring as one JSON line in TaskD's on-disk format (Go encoding/json output, byte for
 *    byte), then gives the buffer back to the pool.  A line that does not fit is dropped and counted.
 * Python drains whole lines from the ring.
 *
 * All state the callbacks touch is process-global (MSPTI has one set of callbacks per process), so
 * callbacks that arrive after close(), or after the Python object is gone at interpreter exit, find
 * a "closed" flag and return without touching freed memory.  Buffers still held by MSPTI at close
 * are never freed (the pool is leaked instead), so MSPTI cannot write into freed memory either. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mspti_abi.h"

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
    C_COUNT
};
static const char *const counter_names[C_COUNT] = {
    "records", "bytes", "buffers_requested", "buffers_declined",
    "buffers_completed", "records_dropped", "records_skipped",
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

    pthread_mutex_t ring_mu;
    uint8_t *ring;
    size_t cap, tail, used;

    _Atomic uint64_t counters[C_COUNT];
} G = {
    .closed = 1,
    .pool_mu = PTHREAD_MUTEX_INITIALIZER,
    .ring_mu = PTHREAD_MUTEX_INITIALIZER,
};

static inline void count(int which, uint64_t n) {
    atomic_fetch_add_explicit(&G.counters[which], n, memory_order_relaxed);
}

/* ------------------------------------------------------------------ serialisation (Go json.Marshal) */

/* Writes into the ring at pos (wrapping), or only measures when ring == NULL. */
typedef struct {
    uint8_t *ring;
    size_t cap, pos, len;
} writer;

static inline void put(writer *w, const void *src, size_t n) {
    if (w->ring != NULL) {
        size_t first = w->cap - w->pos;
        if (n <= first) {
            memcpy(w->ring + w->pos, src, n);
            w->pos += n;
            if (w->pos == w->cap) w->pos = 0;
        } else {
            memcpy(w->ring + w->pos, src, first);
            memcpy(w->ring, (const uint8_t *)src + first, n - first);
            w->pos = n - first;
        }
    }
    w->len += n;
}

#define PUT_LIT(w, s) put((w), (s), sizeof(s) - 1)

static void put_u64(writer *w, uint64_t v) {
    char buf[24];
    char *p = buf + sizeof buf;
    do {
        *--p = (char)('0' + v % 10);
        v /= 10;
    } while (v != 0);
    put(w, p, (size_t)(buf + sizeof buf - p));
}

static void put_i32(writer *w, int32_t v) {
    if (v < 0) {
        PUT_LIT(w, "-");
        put_u64(w, (uint64_t)(-(int64_t)v));
    } else {
        put_u64(w, (uint64_t)v);
    }
}

/* Length of the valid UTF-8 sequence at s (2..4), or 0 if invalid: the rules of Go's utf8.DecodeRune
 * (no overlongs, no surrogates, nothing above U+10FFFF). */
static size_t utf8_seq(const unsigned char *s) {
    unsigned char c = s[0];
    if (c >= 0xC2 && c <= 0xDF) return (s[1] & 0xC0) == 0x80 ? 2 : 0;
    if (c >= 0xE0 && c <= 0xEF) {
        unsigned char lo = 0x80, hi = 0xBF;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
        if (s[1] < lo || s[1] > hi) return 0;
        return (s[2] & 0xC0) == 0x80 ? 3 : 0;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        unsigned char lo = 0x80, hi = 0xBF;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
        if (s[1] < lo || s[1] > hi) return 0;
        if ((s[2] & 0xC0) != 0x80) return 0;
        return (s[3] & 0xC0) == 0x80 ? 4 : 0;
    }
    return 0;
}

/* A JSON string as Go's encoding/json writes it with HTML escaping; NULL prints as "NULL". */
static void put_str(writer *w, const char *str) {
    static const char hex[] = "0123456789abcdef";
    if (str == NULL) str = "NULL";
    const unsigned char *s = (const unsigned char *)str;
    PUT_LIT(w, "\"");
    const unsigned char *run = s; /* start of bytes copied as they are */
    while (*s != 0) {
        unsigned char c = *s;
        if (c < 0x80) {
            if (c >= 0x20 && c != '"' && c != '\\' && c != '<' && c != '>' && c != '&') {
                s++;
                continue;
            }
            put(w, run, (size_t)(s - run));
            switch (c) {
            case '"': PUT_LIT(w, "\\\""); break;
            case '\\': PUT_LIT(w, "\\\\"); break;
            case '\n': PUT_LIT(w, "\\n"); break;
            case '\r': PUT_LIT(w, "\\r"); break;
            case '\t': PUT_LIT(w, "\\t"); break;
            case '\b': PUT_LIT(w, "\\b"); break;
            case '\f': PUT_LIT(w, "\\f"); break;
            default: {
                char esc[6] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 0xF]};
                put(w, esc, sizeof esc);
            }
            }
            s++;
            run = s;
            continue;
        }
        size_t n = utf8_seq(s);
        if (n == 0) {
            put(w, run, (size_t)(s - run));
            PUT_LIT(w, "\\ufffd");
            s++;
            run = s;
            continue;
        }
        if (n == 3 && c == 0xE2 && s[1] == 0x80 && (s[2] == 0xA8 || s[2] == 0xA9)) {
            put(w, run, (size_t)(s - run));
            if (s[2] == 0xA8)
                PUT_LIT(w, "\\u2028");
            else
                PUT_LIT(w, "\\u2029");
            s += 3;
            run = s;
            continue;
        }
        s += n;
    }
    put(w, run, (size_t)(s - run));
    PUT_LIT(w, "\"");
}

static void ser_marker(writer *w, const msptiActivityMarker *m) {
    PUT_LIT(w, "{\"Kind\":");
    put_i32(w, (int32_t)m->kind);
    PUT_LIT(w, ",\"Flag\":");
    put_i32(w, m->flag);
    PUT_LIT(w, ",\"SourceKind\":");
    put_i32(w, m->sourceKind);
    PUT_LIT(w, ",\"Timestamp\":");
    put_u64(w, m->timestamp);
    PUT_LIT(w, ",\"Id\":");
    put_u64(w, m->id);
    uint32_t a = m->objectId.pt.processId, b = m->objectId.pt.threadId;
    PUT_LIT(w, ",\"MsptiObjectId\":{\"Pt\":{\"ProcessId\":");
    put_u64(w, a);
    PUT_LIT(w, ",\"ThreadId\":");
    put_u64(w, b);
    PUT_LIT(w, "},\"Ds\":{\"DeviceId\":");
    put_u64(w, a);
    PUT_LIT(w, ",\"StreamId\":");
    put_u64(w, b);
    PUT_LIT(w, "}},\"Name\":");
    put_str(w, m->name);
    PUT_LIT(w, ",\"Domain\":");
    put_str(w, m->domain);
    PUT_LIT(w, "}\n");
}

static void ser_api(writer *w, const msptiActivityApi *r) {
    PUT_LIT(w, "{\"Kind\":");
    put_i32(w, (int32_t)r->kind);
    PUT_LIT(w, ",\"Start\":");
    put_u64(w, r->start);
    PUT_LIT(w, ",\"End\":");
    put_u64(w, r->end);
    PUT_LIT(w, ",\"Pt\":{\"ProcessId\":");
    put_u64(w, r->pt.processId);
    PUT_LIT(w, ",\"ThreadId\":");
    put_u64(w, r->pt.threadId);
    PUT_LIT(w, "},\"CorrelationId\":");
    put_u64(w, r->correlationId);
    PUT_LIT(w, ",\"Name\":");
    put_str(w, r->name);
    PUT_LIT(w, "}\n");
}

static void ser_kernel(writer *w, const msptiActivityKernel *r) {
    PUT_LIT(w, "{\"Kind\":");
    put_i32(w, (int32_t)r->kind);
    PUT_LIT(w, ",\"Start\":");
    put_u64(w, r->start);
    PUT_LIT(w, ",\"End\":");
    put_u64(w, r->end);
    PUT_LIT(w, ",\"Ds\":{\"DeviceId\":");
    put_u64(w, r->ds.deviceId);
    PUT_LIT(w, ",\"StreamId\":");
    put_u64(w, r->ds.streamId);
    PUT_LIT(w, "},\"CorrelationId\":");
    put_u64(w, r->correlationId);
    PUT_LIT(w, ",\"Type\":");
    put_str(w, r->type);
    PUT_LIT(w, ",\"Name\":");
    put_str(w, r->name);
    PUT_LIT(w, "}\n");
}

/* One record -> one line in the ring (or dropped when the ring lacks room). */
static void emit_record(const uint8_t *rec) {
    int32_t kind;
    memcpy(&kind, rec, sizeof kind);
    union {
        msptiActivityMarker marker;
        msptiActivityApi api;
        msptiActivityKernel kernel;
    } r;
    writer measure = {0};
    switch (kind) {
    case MSPTI_ACTIVITY_KIND_MARKER:
        memcpy(&r.marker, rec, sizeof r.marker);
        ser_marker(&measure, &r.marker);
        break;
    case MSPTI_ACTIVITY_KIND_API:
        memcpy(&r.api, rec, sizeof r.api);
        ser_api(&measure, &r.api);
        break;
    case MSPTI_ACTIVITY_KIND_KERNEL:
        memcpy(&r.kernel, rec, sizeof r.kernel);
        ser_kernel(&measure, &r.kernel);
        break;
    default:
        count(C_RECORDS_SKIPPED, 1);
        return;
    }
    size_t len = measure.len;
    pthread_mutex_lock(&G.ring_mu);
    if (G.cap - G.used < len) {
        pthread_mutex_unlock(&G.ring_mu);
        count(C_RECORDS_DROPPED, 1);
        return;
    }
    size_t head = G.tail + G.used;
    if (head >= G.cap) head -= G.cap;
    writer w = {.ring = G.ring, .cap = G.cap, .pos = head, .len = 0};
    if (kind == MSPTI_ACTIVITY_KIND_MARKER)
        ser_marker(&w, &r.marker);
    else if (kind == MSPTI_ACTIVITY_KIND_API)
        ser_api(&w, &r.api);
    else
        ser_kernel(&w, &r.kernel);
    G.used += w.len;
    pthread_mutex_unlock(&G.ring_mu);
    count(C_RECORDS, 1);
    count(C_BYTES, w.len);
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

static void on_complete(uint8_t *buffer, size_t size, size_t validSize) {
    (void)size;
    if (buffer == NULL || !enter()) return;
    uintptr_t base = (uintptr_t)G.slab, p = (uintptr_t)buffer;
    if (p < base || p >= base + G.nbuf * G.buf_bytes || (p - base) % G.buf_bytes != 0) {
        leave(); /* not one of ours (e.g. a buffer from a previous, closed collector) */
        return;
    }
    if (validSize > G.buf_bytes) validSize = G.buf_bytes;
    msptiActivity *rec = NULL;
    while (G.api.get_next(buffer, validSize, &rec) == MSPTI_SUCCESS && rec != NULL) emit_record((const uint8_t *)rec);
    pthread_mutex_lock(&G.pool_mu);
    G.free_stack[G.nfree++] = (uint32_t)((p - base) / G.buf_bytes);
    pthread_mutex_unlock(&G.pool_mu);
    count(C_BUFFERS_COMPLETED, 1);
    leave();
}

/* ------------------------------------------------------------------ Python type */

typedef struct {
    PyObject_HEAD
    int owner;      /* this object opened the global state and has not closed it */
    int subscribed;
    msptiSubscriberHandle handle;
    PyObject *leftover; /* ring contents at close, returned by the next drain() */
    uint64_t final_counters[C_COUNT];
} Collector;

static void switch_calls(Collector *self, int default_on, int comm_on) {
    mspti_api *api = &G.api;
    if (default_on) {
        if (!self->subscribed) {
            msptiSubscriberHandle h = NULL;
            if (api->subscribe(&h, NULL, NULL) == MSPTI_SUCCESS) {
                self->subscribed = 1;
                self->handle = h;
            }
        }
        api->enable(MSPTI_ACTIVITY_KIND_MARKER);
    } else {
        api->disable(MSPTI_ACTIVITY_KIND_MARKER);
        api->disable(MSPTI_ACTIVITY_KIND_KERNEL);
        api->disable(MSPTI_ACTIVITY_KIND_API);
        if (self->subscribed) {
            api->unsubscribe(self->handle);
            self->subscribed = 0;
            self->handle = NULL;
        }
    }
    if (comm_on)
        api->enable_domain("communication");
    else
        api->disable_domain("communication");
}

static PyObject *take_ring(void) {
    pthread_mutex_lock(&G.ring_mu);
    size_t tail = G.tail, n = G.used;
    pthread_mutex_unlock(&G.ring_mu);
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n);
    if (out == NULL) return NULL;
    /* Producers only write past tail+used, so [tail, tail+n) is stable without the lock. */
    char *dst = PyBytes_AS_STRING(out);
    size_t first = G.cap - tail;
    if (n <= first) {
        memcpy(dst, G.ring + tail, n);
    } else {
        memcpy(dst, G.ring + tail, first);
        memcpy(dst + first, G.ring, n - first);
    }
    pthread_mutex_lock(&G.ring_mu);
    G.tail = tail + n;
    if (G.tail >= G.cap) G.tail -= G.cap;
    G.used -= n;
    pthread_mutex_unlock(&G.ring_mu);
    return out;
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Switch off, flush, wait for in-flight callbacks, free.  With `release_gil` the MSPTI calls run
 * without the GIL (they may call our callbacks synchronously, which never need it). */
static int do_close(Collector *self, int release_gil) {
    if (!self->owner) return 0;
    PyThreadState *ts = release_gil ? PyEval_SaveThread() : NULL;
    switch_calls(self, 0, 0);
    G.api.flush_all(1);
    atomic_store(&G.closed, 1);
    int waited = 0;
    while (atomic_load(&G.inflight) != 0 && waited < 5000) {
        sleep_ms(1);
        waited++;
    }
    int quiet = atomic_load(&G.inflight) == 0;
    if (ts != NULL) PyEval_RestoreThread(ts);

    for (int i = 0; i < C_COUNT; i++) self->final_counters[i] = atomic_load(&G.counters[i]);
    if (quiet) {
        PyObject *rest = take_ring();
        if (rest == NULL) {
            PyErr_Clear();
        } else {
            Py_XSETREF(self->leftover, rest);
        }
        free(G.ring);
        G.ring = NULL;
        G.cap = G.tail = G.used = 0;
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
    self->owner = 0;
    return 0;
}

static int collector_open(Collector *self, const char *lib_path, Py_ssize_t buffers, Py_ssize_t buffer_bytes,
                          Py_ssize_t ring_bytes);

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
    if (ring_bytes < 256) {
        PyErr_SetString(PyExc_ValueError, "ring_bytes must be at least 256");
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
    G.tail = G.used = 0;
    for (int i = 0; i < C_COUNT; i++) atomic_store(&G.counters[i], 0);
    G.open = 1;
    self->owner = 1;
    self->subscribed = 0;
    self->handle = NULL;
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
    if (!self->owner) {
        PyErr_SetString(PyExc_ValueError, "Collector is closed");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    switch_calls(self, default_on, comm_on);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Collector_drain(Collector *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->owner) {
        if (self->leftover != NULL) {
            PyObject *out = self->leftover;
            self->leftover = NULL;
            return out;
        }
        return PyBytes_FromStringAndSize("", 0);
    }
    return take_ring();
}

static PyObject *Collector_flush(Collector *self, PyObject *Py_UNUSED(ignored)) {
    if (self->owner) {
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
        uint64_t v = self->owner ? atomic_load(&G.counters[i]) : self->final_counters[i];
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
    do_close(self, 0);
    Py_CLEAR(self->leftover);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Collector_methods[] = {
    {"set_switch", (PyCFunction)(void (*)(void))Collector_set_switch, METH_VARARGS | METH_KEYWORDS,
     "set_switch(default_on, comm_on): TaskD's switch: MARKER kind on/off, then the communication domain."},
    {"drain", (PyCFunction)Collector_drain, METH_NOARGS, "drain() -> bytes: all complete lines since the last drain."},
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
    .tp_new = PyType_GenericNew,
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
