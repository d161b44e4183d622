/* The parts of the MSPTI ABI (mspti_activity.h / mspti_callback.h / mspti_result.h) that the
 * agent uses, with the layouts measured from the real header (the fake libmspti.so in testkit/ uses
 * this header too):
 * the activity structs are packed and 8-byte aligned, so the uint64 fields sit at unaligned offsets. */
#ifndef AGENT_NATIVE_MSPTI_ABI_H
#define AGENT_NATIVE_MSPTI_ABI_H

#include <stddef.h>
#include <stdint.h>

#define MSPTI_PACKED_ALIGNMENT __attribute__((__packed__)) __attribute__((aligned(8)))

typedef enum {
    MSPTI_SUCCESS = 0,
    MSPTI_ERROR_INVALID_PARAMETER = 1,
    MSPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED = 2,
    MSPTI_ERROR_MAX_LIMIT_REACHED = 3,
    MSPTI_ERROR_DEVICE_OFFLINE = 4,
    MSPTI_ERROR_INNER = 999,
} msptiResult;

typedef enum {
    MSPTI_ACTIVITY_KIND_INVALID = 0,
    MSPTI_ACTIVITY_KIND_MARKER = 1,
    MSPTI_ACTIVITY_KIND_KERNEL = 2,
    MSPTI_ACTIVITY_KIND_API = 3,
    MSPTI_ACTIVITY_KIND_HCCL = 4,
    MSPTI_ACTIVITY_KIND_MEMORY = 5,
    MSPTI_ACTIVITY_KIND_MEMSET = 6,
    MSPTI_ACTIVITY_KIND_MEMCPY = 7,
    MSPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION = 8,
} msptiActivityKind;

typedef struct MSPTI_PACKED_ALIGNMENT {
    msptiActivityKind kind;
} msptiActivity;

typedef union __attribute__((__packed__)) {
    struct __attribute__((__packed__)) {
        uint32_t processId;
        uint32_t threadId;
    } pt;
    struct __attribute__((__packed__)) {
        uint32_t deviceId;
        uint32_t streamId;
    } ds;
} msptiObjectId;

typedef struct MSPTI_PACKED_ALIGNMENT {
    msptiActivityKind kind;
    int32_t flag;       /* msptiActivityFlag */
    int32_t sourceKind; /* msptiActivitySourceKind */
    uint64_t timestamp;
    uint64_t id;
    msptiObjectId objectId;
    const char *name;
    const char *domain;
} msptiActivityMarker;

typedef struct MSPTI_PACKED_ALIGNMENT {
    msptiActivityKind kind;
    uint64_t start;
    uint64_t end;
    struct __attribute__((__packed__)) {
        uint32_t processId;
        uint32_t threadId;
    } pt;
    uint64_t correlationId;
    const char *name;
} msptiActivityApi;

typedef struct MSPTI_PACKED_ALIGNMENT {
    msptiActivityKind kind;
    uint64_t start;
    uint64_t end;
    struct __attribute__((__packed__)) {
        uint32_t deviceId;
        uint32_t streamId;
    } ds;
    uint64_t correlationId;
    const char *type;
    const char *name;
} msptiActivityKernel;

_Static_assert(sizeof(msptiActivityMarker) == 56, "msptiActivityMarker size");
_Static_assert(offsetof(msptiActivityMarker, flag) == 4, "marker.flag");
_Static_assert(offsetof(msptiActivityMarker, sourceKind) == 8, "marker.sourceKind");
_Static_assert(offsetof(msptiActivityMarker, timestamp) == 12, "marker.timestamp");
_Static_assert(offsetof(msptiActivityMarker, id) == 20, "marker.id");
_Static_assert(offsetof(msptiActivityMarker, objectId) == 28, "marker.objectId");
_Static_assert(offsetof(msptiActivityMarker, name) == 36, "marker.name");
_Static_assert(offsetof(msptiActivityMarker, domain) == 44, "marker.domain");
_Static_assert(sizeof(msptiActivityApi) == 48, "msptiActivityApi size");
_Static_assert(offsetof(msptiActivityApi, start) == 4, "api.start");
_Static_assert(offsetof(msptiActivityApi, end) == 12, "api.end");
_Static_assert(offsetof(msptiActivityApi, pt) == 20, "api.pt");
_Static_assert(offsetof(msptiActivityApi, correlationId) == 28, "api.correlationId");
_Static_assert(offsetof(msptiActivityApi, name) == 36, "api.name");
_Static_assert(sizeof(msptiActivityKernel) == 56, "msptiActivityKernel size");
_Static_assert(offsetof(msptiActivityKernel, start) == 4, "kernel.start");
_Static_assert(offsetof(msptiActivityKernel, end) == 12, "kernel.end");
_Static_assert(offsetof(msptiActivityKernel, ds) == 20, "kernel.ds");
_Static_assert(offsetof(msptiActivityKernel, correlationId) == 28, "kernel.correlationId");
_Static_assert(offsetof(msptiActivityKernel, type) == 36, "kernel.type");
_Static_assert(offsetof(msptiActivityKernel, name) == 44, "kernel.name");

typedef void (*msptiBuffersCallbackRequestFunc)(uint8_t **buffer, size_t *size, size_t *maxNumRecords);
typedef void (*msptiBuffersCallbackCompleteFunc)(uint8_t *buffer, size_t size, size_t validSize);

typedef struct msptiSubscriber_st *msptiSubscriberHandle;
typedef void (*msptiCallbackFunc)(void *userdata, int domain, uint32_t cbid, const void *cbdata);

#endif
