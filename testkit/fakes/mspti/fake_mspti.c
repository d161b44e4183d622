/* Fake libmspti.so: the activity-buffer API that TaskD (and agent._native) use, with the real
 * exported symbols and struct layouts, plus a control API (fake_mspti_*) that tests call through
 * ctypes in the same process.
 *
 * Records are produced by fake_mspti_emit*() on the fake's own threads, written into buffers the
 * client hands out through its request callback and handed back through the complete callback,
 * like mspti's own activity threads do.  All buffer work happens under one mutex, which is also
 * held while the client's callbacks run (the client's callbacks must not call back into mspti
 * except msptiActivityGetNextRecord, which takes no lock).
 *
 * Failures: MSPTI allows one subscriber per process.  A "foreign subscriber" models another
 * profiler (e.g. MindStudio) already holding that slot: msptiSubscribe then returns
 * MSPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED.  It is on from the start when the environment
 * has FAKE_MSPTI_FOREIGN_SUBSCRIBER=1 at load, and switched with fake_mspti_set_foreign_subscriber().
 * fake_mspti_set_result() makes any one switch function fail with a given code. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "../../../native/mspti_abi.h" /* the agent's own ABI header: one copy of the layouts */

#define EXPORT __attribute__((visibility("default")))
#define MAX_RECORD 56
#define MAX_HELD 65536

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t idle_cv = PTHREAD_COND_INITIALIZER;

static msptiBuffersCallbackRequestFunc req_cb;
static msptiBuffersCallbackCompleteFunc comp_cb;
static uint32_t kinds_enabled;      /* bit per msptiActivityKind */
static int comm_enabled;            /* the "communication" marker domain; off until enabled */
static int subscribed;
static int subscriber_token;
static int foreign_subscriber;      /* another profiler holds the only subscriber slot */

/* Forced results (0: behave normally) of the switch functions, by name. */
enum { F_ENABLE, F_DISABLE, F_ENABLE_DOMAIN, F_DISABLE_DOMAIN, F_SUBSCRIBE, F_UNSUBSCRIBE, F_COUNT };
static const char *const forced_names[F_COUNT] = {
    "msptiActivityEnable", "msptiActivityDisable", "msptiActivityEnableMarkerDomain",
    "msptiActivityDisableMarkerDomain", "msptiSubscribe", "msptiUnsubscribe"};
static int forced[F_COUNT];

__attribute__((constructor)) static void read_environment(void) {
    const char *v = getenv("FAKE_MSPTI_FOREIGN_SUBSCRIBER");
    foreign_subscriber = v != NULL && strcmp(v, "1") == 0;
}

static uint8_t *cur_buf;
static size_t cur_size, cur_used, cur_max, cur_count;

static int hold;                    /* keep full buffers instead of completing them */
static struct { uint8_t *buf; size_t size, used; } held[MAX_HELD];
static size_t n_held;

static uint64_t next_id = 1;
static uint64_t n_emitted, n_dropped, n_filtered, n_requests, n_declined, n_completed;
static int active_emitters;
static int obj_override;
static uint32_t obj_a, obj_b;

/* ------------------------------------------------------------------ mspti API */

EXPORT msptiResult msptiActivityRegisterCallbacks(msptiBuffersCallbackRequestFunc request,
                                                  msptiBuffersCallbackCompleteFunc complete) {
    if (request == NULL || complete == NULL) return MSPTI_ERROR_INVALID_PARAMETER;
    pthread_mutex_lock(&mu);
    req_cb = request;
    comp_cb = complete;
    pthread_mutex_unlock(&mu);
    return MSPTI_SUCCESS;
}

/* mu held: the forced result of a function, or 0. */
static int forced_locked(int fn) { return forced[fn]; }

#define RETURN_IF_FORCED(fn)                 \
    do {                                     \
        int forced_rc = forced_locked(fn);   \
        if (forced_rc != 0) {                \
            pthread_mutex_unlock(&mu);       \
            return (msptiResult)forced_rc;   \
        }                                    \
    } while (0)

EXPORT msptiResult msptiActivityEnable(msptiActivityKind kind) {
    if ((int)kind <= 0 || (int)kind > 31) return MSPTI_ERROR_INVALID_PARAMETER;
    pthread_mutex_lock(&mu);
    RETURN_IF_FORCED(F_ENABLE);
    kinds_enabled |= 1u << kind;
    pthread_mutex_unlock(&mu);
    return MSPTI_SUCCESS;
}

EXPORT msptiResult msptiActivityDisable(msptiActivityKind kind) {
    if ((int)kind <= 0 || (int)kind > 31) return MSPTI_ERROR_INVALID_PARAMETER;
    pthread_mutex_lock(&mu);
    RETURN_IF_FORCED(F_DISABLE);
    kinds_enabled &= ~(1u << kind);
    pthread_mutex_unlock(&mu);
    return MSPTI_SUCCESS;
}

EXPORT msptiResult msptiActivityEnableMarkerDomain(const char *name) {
    if (name == NULL) return MSPTI_ERROR_INVALID_PARAMETER;
    pthread_mutex_lock(&mu);
    RETURN_IF_FORCED(F_ENABLE_DOMAIN);
    if (strcmp(name, "communication") == 0) comm_enabled = 1;
    pthread_mutex_unlock(&mu);
    return MSPTI_SUCCESS;
}

EXPORT msptiResult msptiActivityDisableMarkerDomain(const char *name) {
    if (name == NULL) return MSPTI_ERROR_INVALID_PARAMETER;
    pthread_mutex_lock(&mu);
    RETURN_IF_FORCED(F_DISABLE_DOMAIN);
    if (strcmp(name, "communication") == 0) comm_enabled = 0;
    pthread_mutex_unlock(&mu);
    return MSPTI_SUCCESS;
}

static size_t record_size(int32_t kind) {
    return kind == MSPTI_ACTIVITY_KIND_API ? sizeof(msptiActivityApi) : MAX_RECORD;
}

EXPORT msptiResult msptiActivityGetNextRecord(uint8_t *buffer, size_t validBufferSizeBytes,
                                              msptiActivity **record) {
    if (buffer == NULL || record == NULL) return MSPTI_ERROR_INVALID_PARAMETER;
    size_t off = 0;
    if (*record != NULL) {
        uint8_t *p = (uint8_t *)*record;
        if (p < buffer || p >= buffer + validBufferSizeBytes) return MSPTI_ERROR_INVALID_PARAMETER;
        int32_t kind;
        memcpy(&kind, p, sizeof kind);
        off = (size_t)(p - buffer) + record_size(kind);
    }
    if (off + sizeof(int32_t) > validBufferSizeBytes) {
        *record = NULL;
        return MSPTI_ERROR_MAX_LIMIT_REACHED;
    }
    *record = (msptiActivity *)(buffer + off);
    return MSPTI_SUCCESS;
}

/* mu held */
static void complete_locked(uint8_t *buf, size_t size, size_t used) {
    n_completed++;
    comp_cb(buf, size, used);
}

/* mu held: hand the current buffer back (or park it while holding). */
static void retire_current_locked(void) {
    if (cur_buf == NULL) return;
    if (hold && n_held < MAX_HELD) {
        held[n_held].buf = cur_buf;
        held[n_held].size = cur_size;
        held[n_held].used = cur_used;
        n_held++;
    } else {
        complete_locked(cur_buf, cur_size, cur_used);
    }
    cur_buf = NULL;
}

static void release_held_locked(void) {
    for (size_t i = 0; i < n_held; i++) complete_locked(held[i].buf, held[i].size, held[i].used);
    n_held = 0;
}

EXPORT msptiResult msptiActivityFlushAll(uint32_t flag) {
    (void)flag;
    pthread_mutex_lock(&mu);
    release_held_locked();
    if (cur_buf != NULL) complete_locked(cur_buf, cur_size, cur_used);
    cur_buf = NULL;
    pthread_mutex_unlock(&mu);
    return MSPTI_SUCCESS;
}

EXPORT msptiResult msptiActivityFlushPeriod(uint32_t time) {
    (void)time;
    return MSPTI_SUCCESS;
}

EXPORT msptiResult msptiSubscribe(msptiSubscriberHandle *subscriber, msptiCallbackFunc callback,
                                  void *userdata) {
    (void)callback;
    (void)userdata;
    if (subscriber == NULL) return MSPTI_ERROR_INVALID_PARAMETER;
    pthread_mutex_lock(&mu);
    RETURN_IF_FORCED(F_SUBSCRIBE);
    if (subscribed || foreign_subscriber) {
        pthread_mutex_unlock(&mu);
        return MSPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED;
    }
    subscribed = 1;
    *subscriber = (msptiSubscriberHandle)&subscriber_token;
    pthread_mutex_unlock(&mu);
    return MSPTI_SUCCESS;
}

EXPORT msptiResult msptiUnsubscribe(msptiSubscriberHandle subscriber) {
    pthread_mutex_lock(&mu);
    RETURN_IF_FORCED(F_UNSUBSCRIBE);
    if (!subscribed || subscriber != (msptiSubscriberHandle)&subscriber_token) {
        pthread_mutex_unlock(&mu);
        return MSPTI_ERROR_INVALID_PARAMETER;
    }
    subscribed = 0;
    pthread_mutex_unlock(&mu);
    return MSPTI_SUCCESS;
}

/* ------------------------------------------------------------------ emitter */

struct job {
    int kind;
    uint64_t count;
    char *name;   /* leaked on purpose: records in client buffers point at them */
    char *domain; /* for KERNEL records: the type */
    int flag;
    int source_kind;
};

static char *dup_or_null(const char *s) { return s ? strdup(s) : NULL; }

/* mu held; returns 0 when the record was written. */
static int emit_one_locked(const struct job *j, uint32_t tid) {
    if (!(kinds_enabled & (1u << j->kind))) {
        n_filtered++;
        return -1;
    }
    if (j->kind == MSPTI_ACTIVITY_KIND_MARKER && j->domain && strcmp(j->domain, "communication") == 0 &&
        !comm_enabled) {
        n_filtered++;
        return -1;
    }
    if (req_cb == NULL) {
        n_dropped++;
        return -1;
    }
    size_t need = record_size(j->kind);
    if (cur_buf == NULL) {
        uint8_t *buf = NULL;
        size_t size = 0, max = 0;
        n_requests++;
        req_cb(&buf, &size, &max);
        if (buf == NULL) {
            n_declined++;
            n_dropped++;
            return -1;
        }
        if (size < need) { /* unusable: give it straight back */
            complete_locked(buf, size, 0);
            n_dropped++;
            return -1;
        }
        cur_buf = buf;
        cur_size = size;
        cur_max = max;
        cur_used = 0;
        cur_count = 0;
    }
    uint64_t id = next_id++;
    uint64_t ts = 1755771234000000000ull + id * 1000u;
    uint32_t a = obj_override ? obj_a : (uint32_t)getpid();
    uint32_t b = obj_override ? obj_b : tid;
    uint8_t *p = cur_buf + cur_used;
    memset(p, 0, need);
    if (j->kind == MSPTI_ACTIVITY_KIND_MARKER) {
        msptiActivityMarker m;
        memset(&m, 0, sizeof m);
        m.kind = MSPTI_ACTIVITY_KIND_MARKER;
        m.flag = j->flag;
        m.sourceKind = j->source_kind;
        m.timestamp = ts;
        m.id = id;
        m.objectId.pt.processId = a;
        m.objectId.pt.threadId = b;
        m.name = j->name;
        m.domain = j->domain;
        memcpy(p, &m, sizeof m);
    } else if (j->kind == MSPTI_ACTIVITY_KIND_API) {
        msptiActivityApi r;
        memset(&r, 0, sizeof r);
        r.kind = MSPTI_ACTIVITY_KIND_API;
        r.start = ts;
        r.end = ts + 500;
        r.pt.processId = a;
        r.pt.threadId = b;
        r.correlationId = id;
        r.name = j->name;
        memcpy(p, &r, sizeof r);
    } else if (j->kind == MSPTI_ACTIVITY_KIND_KERNEL) {
        msptiActivityKernel r;
        memset(&r, 0, sizeof r);
        r.kind = MSPTI_ACTIVITY_KIND_KERNEL;
        r.start = ts;
        r.end = ts + 500;
        r.ds.deviceId = a;
        r.ds.streamId = b;
        r.correlationId = id;
        r.type = j->domain;
        r.name = j->name;
        memcpy(p, &r, sizeof r);
    } else {
        int32_t k = j->kind;
        memcpy(p, &k, sizeof k);
    }
    cur_used += need;
    cur_count++;
    n_emitted++;
    if (cur_size - cur_used < MAX_RECORD || (cur_max != 0 && cur_count >= cur_max)) retire_current_locked();
    return 0;
}

static void *emitter(void *arg) {
    struct job *j = arg;
    uint32_t tid = (uint32_t)syscall(SYS_gettid);
    for (uint64_t i = 0; i < j->count; i++) {
        pthread_mutex_lock(&mu);
        emit_one_locked(j, tid);
        pthread_mutex_unlock(&mu);
    }
    pthread_mutex_lock(&mu);
    active_emitters--;
    pthread_cond_broadcast(&idle_cv);
    pthread_mutex_unlock(&mu);
    free(j);
    return NULL;
}

/* Emit `count` records of `kind` from a new thread of the fake.  For KERNEL records `domain` is
 * the kernel type.  Returns 0, or -1 when the thread could not be started. */
EXPORT int fake_mspti_emit_kind(int kind, uint64_t count, const char *name, const char *domain, int flag,
                                int source_kind) {
    struct job *j = calloc(1, sizeof *j);
    if (j == NULL) return -1;
    j->kind = kind;
    j->count = count;
    j->name = dup_or_null(name);
    j->domain = dup_or_null(domain);
    j->flag = flag;
    j->source_kind = source_kind;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_mutex_lock(&mu);
    active_emitters++;
    pthread_mutex_unlock(&mu);
    pthread_t t;
    int rc = pthread_create(&t, &attr, emitter, j);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        pthread_mutex_lock(&mu);
        active_emitters--;
        pthread_mutex_unlock(&mu);
        free(j);
        return -1;
    }
    return 0;
}

EXPORT int fake_mspti_emit(uint64_t count, const char *name, const char *domain, int flag, int source_kind) {
    return fake_mspti_emit_kind(MSPTI_ACTIVITY_KIND_MARKER, count, name, domain, flag, source_kind);
}

/* Block until every emitter thread has finished. */
EXPORT void fake_mspti_wait_idle(void) {
    pthread_mutex_lock(&mu);
    while (active_emitters > 0) pthread_cond_wait(&idle_cv, &mu);
    pthread_mutex_unlock(&mu);
}

/* While on, full buffers are parked instead of completed (like a slow mspti completion thread);
 * turning it off completes the parked ones from the calling thread.  FlushAll completes them too. */
EXPORT void fake_mspti_hold_completions(int on) {
    pthread_mutex_lock(&mu);
    hold = on;
    if (!on) release_held_locked();
    pthread_mutex_unlock(&mu);
}

/* Use fixed numbers for the object id union instead of pid/tid (for byte-exact tests). */
EXPORT void fake_mspti_set_object_id(int on, uint32_t a, uint32_t b) {
    pthread_mutex_lock(&mu);
    obj_override = on;
    obj_a = a;
    obj_b = b;
    pthread_mutex_unlock(&mu);
}

#define COUNTER(fn, var)                 \
    EXPORT uint64_t fn(void) {           \
        pthread_mutex_lock(&mu);         \
        uint64_t v = var;                \
        pthread_mutex_unlock(&mu);       \
        return v;                        \
    }
COUNTER(fake_mspti_emitted, n_emitted)
COUNTER(fake_mspti_dropped, n_dropped)
COUNTER(fake_mspti_filtered, n_filtered)
COUNTER(fake_mspti_requests, n_requests)
COUNTER(fake_mspti_declined, n_declined)
COUNTER(fake_mspti_completed, n_completed)
COUNTER(fake_mspti_next_id, next_id)
COUNTER(fake_mspti_held, n_held)

/* Another profiler holds (1) or releases (0) MSPTI's only subscriber slot: while it holds it,
 * msptiSubscribe fails with MSPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED. */
EXPORT void fake_mspti_set_foreign_subscriber(int on) {
    pthread_mutex_lock(&mu);
    foreign_subscriber = on != 0;
    pthread_mutex_unlock(&mu);
}

/* Make the switch function `name` (msptiActivityEnable/Disable, msptiActivityEnable/DisableMarkerDomain,
 * msptiSubscribe/Unsubscribe) return `result` without doing anything; 0 restores it.  Returns 0,
 * or -1 for an unknown name. */
EXPORT int fake_mspti_set_result(const char *name, int result) {
    if (name == NULL) return -1;
    for (int i = 0; i < F_COUNT; i++) {
        if (strcmp(name, forced_names[i]) == 0) {
            pthread_mutex_lock(&mu);
            forced[i] = result;
            pthread_mutex_unlock(&mu);
            return 0;
        }
    }
    return -1;
}

/* Bit 0..31: enabled kinds; bit 32: communication domain; bit 33: subscribed (the client);
 * bit 34: a foreign subscriber holds the slot. */
EXPORT uint64_t fake_mspti_state(void) {
    pthread_mutex_lock(&mu);
    uint64_t v = kinds_enabled | ((uint64_t)comm_enabled << 32) | ((uint64_t)subscribed << 33) |
                 ((uint64_t)foreign_subscriber << 34);
    pthread_mutex_unlock(&mu);
    return v;
}

/* Between tests: wait for emitters, hand back every buffer, reset counters, the switch state and
 * the failures (no foreign subscriber, no forced results; the registered callbacks stay: a client
 * cannot unregister them). */
EXPORT void fake_mspti_reset(void) {
    pthread_mutex_lock(&mu);
    while (active_emitters > 0) pthread_cond_wait(&idle_cv, &mu);
    hold = 0;
    release_held_locked();
    if (cur_buf != NULL) complete_locked(cur_buf, cur_size, cur_used);
    cur_buf = NULL;
    n_emitted = n_dropped = n_filtered = n_requests = n_declined = n_completed = 0;
    obj_override = 0;
    kinds_enabled = 0;
    comm_enabled = subscribed = 0;
    foreign_subscriber = 0;
    memset(forced, 0, sizeof forced);
    pthread_mutex_unlock(&mu);
}
