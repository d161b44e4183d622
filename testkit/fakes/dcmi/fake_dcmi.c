/*
 * fake_dcmi.c - a fake libdcmi.so for tests.
 *
 * Exports the subset of Huawei's DCMI C ABI the agent uses (dcmi_abi.h), so
 * the agent's real ctypes loader can dlopen it in place of the driver.  The
 * topology comes from FAKE_DCMI_* environment variables read by dcmi_init()
 * (CARDS, CHIPS_PER_CARD, PHY_IDS, CHIP_NAME; VDIE and PCIE for the chips'
 * identities; FAIL=function=rc,... for failures from the first call on);
 * faults, hangs and failures are injected at run time through a unix socket
 * (FAKE_DCMI_CONTROL) served by a detached thread, because the library lives
 * inside the process under test.  See build.py / control.py for the Python
 * side; g_commands below lists the control commands.
 */
#define _GNU_SOURCE
#include "dcmi_abi.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* The agent mirrors these layouts in ctypes; fail the build, not the test,
 * if they drift.  (Sizes are those of the LP64 targets we run on.) */
_Static_assert(sizeof(struct dcmi_chip_info) == 100, "dcmi_chip_info size");
_Static_assert(sizeof(struct dcmi_event_filter) == 48, "dcmi_event_filter size");
_Static_assert(sizeof(struct dcmi_dms_fault_event) == 352, "dcmi_dms_fault_event size");
_Static_assert(sizeof(struct dcmi_event) == 360, "dcmi_event size");
_Static_assert(sizeof(struct dcmi_die_id) == 20, "dcmi_die_id size");
_Static_assert(sizeof(struct dcmi_pcie_info_all) == 64, "dcmi_pcie_info_all size");
_Static_assert(offsetof(struct dcmi_pcie_info_all, domain) == 16, "dcmi_pcie_info_all domain");
_Static_assert(sizeof(enum dcmi_die_type) == 4, "enum size");

#define MAX_DEVICES 64
#define MAX_CODES 128
#define MAX_SUBSCRIPTIONS 8
#define MAX_HANG_SECONDS 1e6

enum { ASSERT_RECOVER = 0, ASSERT_OCCUR = 1, ASSERT_ONCE = 2 };

/* "clock <seconds>": a driver whose alarm clock is broken reports this fixed time (0: the real clock). */
static unsigned long long g_alarm_clock;

static unsigned long long alarm_now(void)
{
    return g_alarm_clock ? g_alarm_clock : (unsigned long long)time(NULL);
}

struct active_code {
    unsigned int code;
    unsigned char severity;
    unsigned long long raised_at; /* reported again by the recovery event */
};

struct pcie_address {
    int domain;
    unsigned int bus, device, function;
};

struct device {
    unsigned int health; /* stored value; see dcmi_get_device_health() */
    unsigned int vdie[DIE_ID_NUM];
    struct pcie_address pcie;
    int dropped;
    unsigned int ncodes;
    struct active_code codes[MAX_CODES]; /* insertion order, no duplicates */
};

struct subscription {
    int logic; /* -1: all devices */
    struct dcmi_event_filter filter;
    dcmi_fault_event_callback handler;
};

/* Per-function knobs for "hang", "fail" and "stats". */
enum fn_id {
    FN_INIT,
    FN_GET_CARD_LIST,
    FN_GET_DEVICE_NUM_IN_CARD,
    FN_GET_DEVICE_LOGIC_ID,
    FN_GET_PHYID_FROM_LOGICID,
    FN_GET_LOGICID_FROM_PHYID,
    FN_GET_CARD_ID_DEVICE_ID_FROM_LOGICID,
    FN_GET_DEVICE_CHIP_INFO,
    FN_GET_DEVICE_DIE_V2,
    FN_GET_DEVICE_PCIE_INFO_V2,
    FN_GET_DEVICE_HEALTH,
    FN_GET_DEVICE_ERRORCODE_V2,
#ifndef FAKE_DCMI_OMIT_SUBSCRIBE
    FN_SUBSCRIBE_FAULT_EVENT,
#endif
    FN_COUNT
};

struct fn_ctl {
    const char *name;
    unsigned long calls;
    long long hang_ns;          /* 0: calls do not hang */
    unsigned long release_gen;  /* bumped by "hang <fn> 0" to free waiters */
    int fail_rc;                /* 0: no injected failure */
};

static struct fn_ctl g_fns[FN_COUNT] = {
    [FN_INIT] = {"dcmi_init"},
    [FN_GET_CARD_LIST] = {"dcmi_get_card_list"},
    [FN_GET_DEVICE_NUM_IN_CARD] = {"dcmi_get_device_num_in_card"},
    [FN_GET_DEVICE_LOGIC_ID] = {"dcmi_get_device_logic_id"},
    [FN_GET_PHYID_FROM_LOGICID] = {"dcmi_get_device_phyid_from_logicid"},
    [FN_GET_LOGICID_FROM_PHYID] = {"dcmi_get_device_logicid_from_phyid"},
    [FN_GET_CARD_ID_DEVICE_ID_FROM_LOGICID] = {"dcmi_get_card_id_device_id_from_logicid"},
    [FN_GET_DEVICE_CHIP_INFO] = {"dcmi_get_device_chip_info"},
    [FN_GET_DEVICE_DIE_V2] = {"dcmi_get_device_die_v2"},
    [FN_GET_DEVICE_PCIE_INFO_V2] = {"dcmi_get_device_pcie_info_v2"},
    [FN_GET_DEVICE_HEALTH] = {"dcmi_get_device_health"},
    [FN_GET_DEVICE_ERRORCODE_V2] = {"dcmi_get_device_errorcode_v2"},
#ifndef FAKE_DCMI_OMIT_SUBSCRIBE
    [FN_SUBSCRIBE_FAULT_EVENT] = {"dcmi_subscribe_fault_event"},
#endif
};

/* g_lock guards everything below that changes after dcmi_init().  The
 * topology (g_cards .. g_trace_path) is written once, before the control
 * thread exists, and only read afterwards. */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_hang_cond; /* CLOCK_MONOTONIC, set up by the constructor */
static int g_initialized;
static int g_cards, g_chips, g_ndev;
static char g_chip_name[MAX_CHIP_NAME_LEN];
static unsigned int g_phy[MAX_DEVICES];
static char g_trace_path[PATH_MAX];
static struct device g_dev[MAX_DEVICES];
static struct subscription g_subs[MAX_SUBSCRIPTIONS];
static int g_nsubs;
static int g_event_serial;

static char g_sock_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
static pid_t g_sock_owner;

__attribute__((constructor)) static void fake_dcmi_load(void)
{
    /* Monotonic, so a wall-clock step cannot stretch or cut a "hang". */
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&g_hang_cond, &attr);
    pthread_condattr_destroy(&attr);
}

__attribute__((destructor)) static void fake_dcmi_unload(void)
{
    /* Only the binding process removes the socket: a forked child that
     * exits must not pull it out from under its parent. */
    if (g_sock_path[0] && getpid() == g_sock_owner)
        unlink(g_sock_path);
}

/* ------------------------------------------------------------------ */
/* Topology                                                            */
/* ------------------------------------------------------------------ */

static int env_count(const char *name, int def, int *out)
{
    const char *s = getenv(name);
    char *end;
    long v;

    if (!s || !*s) {
        *out = def;
        return 0;
    }
    errno = 0;
    v = strtol(s, &end, 10);
    if (errno || *end || v < 1 || v > MAX_DEVICES) {
        fprintf(stderr, "fake_dcmi: bad %s='%s' (1..%d)\n", name, s, MAX_DEVICES);
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* FAKE_DCMI_PHY_IDS: one physical id per logic id, all distinct so the
 * reverse lookup is well defined. */
static int parse_phy_ids(const char *s)
{
    const char *p = s;

    for (int i = 0; i < g_ndev; i++) {
        char *end;
        unsigned long v;

        if (!isdigit((unsigned char)*p))
            goto bad;
        errno = 0;
        v = strtoul(p, &end, 10);
        if (errno || v > UINT_MAX)
            goto bad;
        for (int j = 0; j < i; j++)
            if (g_phy[j] == v)
                goto bad;
        g_phy[i] = (unsigned int)v;
        if (*end != (i + 1 < g_ndev ? ',' : '\0'))
            goto bad;
        p = end + 1;
    }
    return 0;
bad:
    fprintf(stderr, "fake_dcmi: bad FAKE_DCMI_PHY_IDS='%s' (need %d distinct ids)\n",
            s, g_ndev);
    return -1;
}

/* "W-W-W-W-W": the five soc_die words in hex. */
static int parse_vdie(const char *s, unsigned int *out)
{
    unsigned int w[DIE_ID_NUM];
    int used = 0;

    if (sscanf(s, "%x-%x-%x-%x-%x%n", &w[0], &w[1], &w[2], &w[3], &w[4], &used) != DIE_ID_NUM || s[used])
        return -1;
    memcpy(out, w, sizeof w);
    return 0;
}

/* "DDDD:BB:DD.F" in hex, as lspci prints it. */
static int parse_pcie(const char *s, struct pcie_address *out)
{
    struct pcie_address a;
    int used = 0;

    if (sscanf(s, "%x:%x:%x.%x%n", (unsigned int *)&a.domain, &a.bus, &a.device, &a.function, &used) != 4 ||
        s[used])
        return -1;
    *out = a;
    return 0;
}

/* FAKE_DCMI_VDIE / FAKE_DCMI_PCIE: comma-separated values for logic ids 0, 1, ...; an empty item (or a
 * short list) keeps that chip's default. */
static int parse_per_chip(const char *var, int (*parse)(const char *, int))
{
    const char *s = getenv(var);
    char item[64];

    for (int logic = 0; s && *s && logic < g_ndev; logic++) {
        size_t n = strcspn(s, ",");

        if (n >= sizeof item)
            goto bad;
        memcpy(item, s, n);
        item[n] = 0;
        if (n && parse(item, logic))
            goto bad;
        s += n + (s[n] == ',');
    }
    return 0;
bad:
    fprintf(stderr, "fake_dcmi: bad %s item near '%s'\n", var, s);
    return -1;
}

static int set_vdie(const char *s, int logic) { return parse_vdie(s, g_dev[logic].vdie); }
static int set_pcie(const char *s, int logic) { return parse_pcie(s, &g_dev[logic].pcie); }

static struct fn_ctl *find_fn(const char *name);

/* FAKE_DCMI_FAIL="function=rc,...": failures from the start, for calls made before a test can
 * connect (the agent's inventory). */
static int parse_start_failures(void)
{
    const char *s = getenv("FAKE_DCMI_FAIL");
    char item[128];

    while (s && *s) {
        size_t n = strcspn(s, ",");
        char *eq, *end;
        struct fn_ctl *f;
        long rc;

        if (n >= sizeof item)
            goto bad;
        memcpy(item, s, n);
        item[n] = 0;
        eq = strchr(item, '=');
        if (!eq)
            goto bad;
        *eq = 0;
        f = find_fn(item);
        errno = 0;
        rc = strtol(eq + 1, &end, 10);
        if (!f || errno || *end || rc == 0 || rc < INT_MIN || rc > INT_MAX)
            goto bad;
        f->fail_rc = (int)rc;
        s += n + (s[n] == ',');
    }
    return 0;
bad:
    fprintf(stderr, "fake_dcmi: bad FAKE_DCMI_FAIL near '%s' (function=rc,...)\n", s);
    return -1;
}

static int setup_topology(void)
{
    const char *name = getenv("FAKE_DCMI_CHIP_NAME");
    const char *phy = getenv("FAKE_DCMI_PHY_IDS");
    const char *trace = getenv("FAKE_DCMI_TRACE");

    if (env_count("FAKE_DCMI_CARDS", 8, &g_cards) ||
        env_count("FAKE_DCMI_CHIPS_PER_CARD", 1, &g_chips))
        return -1;
    if (g_cards * g_chips > MAX_DEVICES) {
        fprintf(stderr, "fake_dcmi: at most %d devices in total\n", MAX_DEVICES);
        return -1;
    }
    g_ndev = g_cards * g_chips;

    if (phy && *phy) {
        if (parse_phy_ids(phy))
            return -1;
    } else {
        /* Deliberately not the identity, so the consumer's mapping is tested. */
        for (int i = 0; i < g_ndev; i++)
            g_phy[i] = (unsigned int)(g_ndev - 1 - i);
    }

    /* Default identities: distinct per chip, one word below 0x10000000 so the padding shows. */
    for (int i = 0; i < g_ndev; i++) {
        unsigned int v[DIE_ID_NUM] = {0x185011D4u, 0x21104518u, 0xA0C4ED94u + (unsigned int)i, 0x0000040Au,
                                      0x56102003u + g_phy[i]};

        memcpy(g_dev[i].vdie, v, sizeof v);
        g_dev[i].pcie = (struct pcie_address){0, (0x01u + 0x10u * (unsigned int)i) & 0xFFu, 0, 0};
    }
    if (parse_per_chip("FAKE_DCMI_VDIE", set_vdie) || parse_per_chip("FAKE_DCMI_PCIE", set_pcie) ||
        parse_start_failures())
        return -1;

    if (!name || !*name)
        name = "910B3";
    memset(g_chip_name, 0, sizeof g_chip_name);
    memcpy(g_chip_name, name, strnlen(name, sizeof g_chip_name - 1));

    /* Copied now: the control thread must not call getenv() while the host
     * process may be changing its environment. */
    if (trace && strlen(trace) >= sizeof g_trace_path) {
        fprintf(stderr, "fake_dcmi: FAKE_DCMI_TRACE path too long\n");
        return -1;
    }
    strcpy(g_trace_path, trace ? trace : "");
    return 0;
}

/* Lock held.  Returns the logic id, or -1 for an invalid pair. */
static int logic_of(int card_id, int device_id)
{
    if (card_id < 0 || card_id >= g_cards || device_id < 0 || device_id >= g_chips)
        return -1;
    return card_id * g_chips + device_id;
}

/* ------------------------------------------------------------------ */
/* Entry-point prologue: init check, call counting, hang, fail         */
/* ------------------------------------------------------------------ */

/* On DCMI_OK the caller holds g_lock and must return via api_leave(). */
static int api_enter(enum fn_id fn)
{
    struct fn_ctl *f = &g_fns[fn];

    pthread_mutex_lock(&g_lock);
    if (!g_initialized) {
        pthread_mutex_unlock(&g_lock);
        return FAKE_DCMI_ERR_NOT_INIT;
    }
    f->calls++;
    if (f->hang_ns > 0) {
        unsigned long gen = f->release_gen;
        struct timespec deadline;

        clock_gettime(CLOCK_MONOTONIC, &deadline);
        deadline.tv_sec += f->hang_ns / 1000000000LL;
        deadline.tv_nsec += f->hang_ns % 1000000000LL;
        if (deadline.tv_nsec >= 1000000000L) {
            deadline.tv_sec++;
            deadline.tv_nsec -= 1000000000L;
        }
        /* The wait drops g_lock, so the control thread (and the releasing
         * "hang <fn> 0") keeps working while calls are stuck here. */
        while (f->release_gen == gen &&
               pthread_cond_timedwait(&g_hang_cond, &g_lock, &deadline) != ETIMEDOUT)
            ;
    }
    if (f->fail_rc) {
        int rc = f->fail_rc;

        pthread_mutex_unlock(&g_lock);
        return rc;
    }
    return DCMI_OK;
}

static int api_leave(int rc)
{
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* ------------------------------------------------------------------ */
/* DCMI API                                                            */
/* ------------------------------------------------------------------ */

static void start_control(void);

int dcmi_init(void)
{
    int rc;

    pthread_mutex_lock(&g_lock);
    if (!g_initialized) {
        if (setup_topology()) {
            pthread_mutex_unlock(&g_lock);
            return DCMI_ERR_INVALID_PARAM;
        }
        g_initialized = 1;
        start_control();
    }
    pthread_mutex_unlock(&g_lock);

    /* Counted like every other call; hang/fail can only affect a repeated
     * dcmi_init, since the control socket starts with the first one. */
    rc = api_enter(FN_INIT);
    return rc ? rc : api_leave(DCMI_OK);
}

int dcmi_get_card_list(int *card_num, int *card_list, int list_len)
{
    int rc = api_enter(FN_GET_CARD_LIST);

    if (rc)
        return rc;
    if (!card_num || !card_list || list_len < g_cards)
        return api_leave(DCMI_ERR_INVALID_PARAM);
    for (int i = 0; i < g_cards; i++)
        card_list[i] = i;
    *card_num = g_cards;
    return api_leave(DCMI_OK);
}

int dcmi_get_device_num_in_card(int card_id, int *device_num)
{
    int rc = api_enter(FN_GET_DEVICE_NUM_IN_CARD);

    if (rc)
        return rc;
    if (!device_num || logic_of(card_id, 0) < 0)
        return api_leave(DCMI_ERR_INVALID_PARAM);
    *device_num = g_chips;
    return api_leave(DCMI_OK);
}

int dcmi_get_device_logic_id(int *device_logic_id, int card_id, int device_id)
{
    int rc = api_enter(FN_GET_DEVICE_LOGIC_ID);
    int logic;

    if (rc)
        return rc;
    logic = logic_of(card_id, device_id);
    if (!device_logic_id || logic < 0)
        return api_leave(DCMI_ERR_INVALID_PARAM);
    *device_logic_id = logic;
    return api_leave(DCMI_OK);
}

int dcmi_get_device_phyid_from_logicid(unsigned int logicid, unsigned int *phyid)
{
    int rc = api_enter(FN_GET_PHYID_FROM_LOGICID);

    if (rc)
        return rc;
    if (!phyid || logicid >= (unsigned int)g_ndev)
        return api_leave(DCMI_ERR_INVALID_PARAM);
    *phyid = g_phy[logicid];
    return api_leave(DCMI_OK);
}

int dcmi_get_device_logicid_from_phyid(unsigned int phyid, unsigned int *logicid)
{
    int rc = api_enter(FN_GET_LOGICID_FROM_PHYID);

    if (rc)
        return rc;
    if (logicid) {
        for (int i = 0; i < g_ndev; i++) {
            if (g_phy[i] == phyid) {
                *logicid = (unsigned int)i;
                return api_leave(DCMI_OK);
            }
        }
    }
    return api_leave(DCMI_ERR_INVALID_PARAM);
}

int dcmi_get_card_id_device_id_from_logicid(int *card_id, int *device_id,
                                            unsigned int device_logic_id)
{
    int rc = api_enter(FN_GET_CARD_ID_DEVICE_ID_FROM_LOGICID);

    if (rc)
        return rc;
    if (!card_id || !device_id || device_logic_id >= (unsigned int)g_ndev)
        return api_leave(DCMI_ERR_INVALID_PARAM);
    *card_id = (int)device_logic_id / g_chips;
    *device_id = (int)device_logic_id % g_chips;
    return api_leave(DCMI_OK);
}

int dcmi_get_device_chip_info(int card_id, int device_id, struct dcmi_chip_info *chip_info)
{
    int rc = api_enter(FN_GET_DEVICE_CHIP_INFO);

    if (rc)
        return rc;
    if (!chip_info || logic_of(card_id, device_id) < 0)
        return api_leave(DCMI_ERR_INVALID_PARAM);
    memset(chip_info, 0, sizeof *chip_info);
    memcpy(chip_info->chip_type, "Ascend", sizeof "Ascend");
    memcpy(chip_info->chip_name, g_chip_name, sizeof g_chip_name);
    memcpy(chip_info->chip_ver, "V1", sizeof "V1");
    chip_info->aicore_cnt = 24;
    return api_leave(DCMI_OK);
}

int dcmi_get_device_die_v2(int card_id, int device_id, enum dcmi_die_type input_type,
                           struct dcmi_die_id *die_id)
{
    int rc = api_enter(FN_GET_DEVICE_DIE_V2);
    int logic;

    if (rc)
        return rc;
    logic = logic_of(card_id, device_id);
    if (!die_id || logic < 0 || (input_type != NDIE && input_type != VDIE))
        return api_leave(DCMI_ERR_INVALID_PARAM);
    if (g_dev[logic].dropped)
        return api_leave(DCMI_ERR_NOT_READY);
    memcpy(die_id->soc_die, g_dev[logic].vdie, sizeof die_id->soc_die);
    if (input_type == NDIE)  /* not what the agent asks for: make a mix-up visible */
        die_id->soc_die[0] ^= 0xFFFFFFFFu;
    return api_leave(DCMI_OK);
}

int dcmi_get_device_pcie_info_v2(int card_id, int device_id, struct dcmi_pcie_info_all *pcie_info)
{
    int rc = api_enter(FN_GET_DEVICE_PCIE_INFO_V2);
    int logic;
    const struct pcie_address *a;

    if (rc)
        return rc;
    logic = logic_of(card_id, device_id);
    if (!pcie_info || logic < 0)
        return api_leave(DCMI_ERR_INVALID_PARAM);
    if (g_dev[logic].dropped)
        return api_leave(DCMI_ERR_NOT_READY);
    a = &g_dev[logic].pcie;
    memset(pcie_info, 0, sizeof *pcie_info);
    pcie_info->venderid = 0x19E5;  /* Huawei */
    pcie_info->deviceid = 0xD802;
    pcie_info->domain = a->domain;
    pcie_info->bdf_busid = a->bus;
    pcie_info->bdf_deviceid = a->device;
    pcie_info->bdf_funcid = a->function;
    return api_leave(DCMI_OK);
}

int dcmi_get_device_health(int card_id, int device_id, unsigned int *health)
{
    int rc = api_enter(FN_GET_DEVICE_HEALTH);
    int logic;
    struct device *d;

    if (rc)
        return rc;
    logic = logic_of(card_id, device_id);
    if (!health || logic < 0)
        return api_leave(DCMI_ERR_INVALID_PARAM);
    d = &g_dev[logic];
    if (d->dropped)
        return api_leave(DCMI_ERR_NOT_READY);
    /* The real driver reports a non-zero health while alarms are active. */
    *health = (d->health == 0 && d->ncodes > 0) ? 1 : d->health;
    return api_leave(DCMI_OK);
}

int dcmi_get_device_errorcode_v2(int card_id, int device_id, int *error_count,
                                 unsigned int *error_code_list, unsigned int list_len)
{
    int rc = api_enter(FN_GET_DEVICE_ERRORCODE_V2);
    int logic;
    unsigned int n;
    struct device *d;

    if (rc)
        return rc;
    logic = logic_of(card_id, device_id);
    if (!error_count || (!error_code_list && list_len) || logic < 0)
        return api_leave(DCMI_ERR_INVALID_PARAM);
    d = &g_dev[logic];
    if (d->dropped)
        return api_leave(DCMI_ERR_NOT_READY);
    n = d->ncodes < list_len ? d->ncodes : list_len;
    for (unsigned int i = 0; i < n; i++)
        error_code_list[i] = d->codes[i].code;
    *error_count = (int)n;
    return api_leave(DCMI_OK);
}

#ifndef FAKE_DCMI_OMIT_SUBSCRIBE
int dcmi_subscribe_fault_event(int card_id, int device_id, struct dcmi_event_filter filter,
                               dcmi_fault_event_callback handler)
{
    int rc = api_enter(FN_SUBSCRIBE_FAULT_EVENT);
    int all = card_id == -1 && device_id == -1;
    int logic;

    if (rc)
        return rc;
    logic = all ? -1 : logic_of(card_id, device_id);
    if (!handler || (!all && logic < 0) || g_nsubs == MAX_SUBSCRIPTIONS)
        return api_leave(DCMI_ERR_INVALID_PARAM);
    g_subs[g_nsubs++] = (struct subscription){logic, filter, handler};
    return api_leave(DCMI_OK);
}
#endif

/* ------------------------------------------------------------------ */
/* Layout report                                                       */
/* ------------------------------------------------------------------ */

static char g_layout[4096]; /* the JSON is ~1 KiB */
static size_t g_layout_len;
static pthread_once_t g_layout_once = PTHREAD_ONCE_INIT;

__attribute__((format(printf, 1, 2))) static void layout_add(const char *fmt, ...)
{
    va_list ap;
    int n;

    va_start(ap, fmt);
    n = vsnprintf(g_layout + g_layout_len, sizeof g_layout - g_layout_len, fmt, ap);
    va_end(ap);
    if (n > 0) /* on truncation vsnprintf reports the full length: clamp */
        g_layout_len = g_layout_len + (size_t)n < sizeof g_layout ? g_layout_len + (size_t)n
                                                                  : sizeof g_layout - 1;
}

#define L_STRUCT(T) \
    layout_add("%s\"" #T "\":{\"size\":%zu", g_layout_len > 1 ? "}," : "", sizeof(struct T))
#define L_FIELD(T, f) layout_add(",\"" #f "\":%zu", offsetof(struct T, f))

static void build_layout(void)
{
    layout_add("{");
    L_STRUCT(dcmi_chip_info);
    L_FIELD(dcmi_chip_info, chip_type);
    L_FIELD(dcmi_chip_info, chip_name);
    L_FIELD(dcmi_chip_info, chip_ver);
    L_FIELD(dcmi_chip_info, aicore_cnt);
    L_STRUCT(dcmi_die_id);
    L_FIELD(dcmi_die_id, soc_die);
    L_STRUCT(dcmi_pcie_info_all);
    L_FIELD(dcmi_pcie_info_all, venderid);
    L_FIELD(dcmi_pcie_info_all, subvenderid);
    L_FIELD(dcmi_pcie_info_all, deviceid);
    L_FIELD(dcmi_pcie_info_all, subdeviceid);
    L_FIELD(dcmi_pcie_info_all, domain);
    L_FIELD(dcmi_pcie_info_all, bdf_busid);
    L_FIELD(dcmi_pcie_info_all, bdf_deviceid);
    L_FIELD(dcmi_pcie_info_all, bdf_funcid);
    L_FIELD(dcmi_pcie_info_all, reserve);
    L_STRUCT(dcmi_event_filter);
    L_FIELD(dcmi_event_filter, filter_flag);
    L_FIELD(dcmi_event_filter, event_id);
    L_FIELD(dcmi_event_filter, severity);
    L_FIELD(dcmi_event_filter, node_type);
    L_FIELD(dcmi_event_filter, resv);
    L_STRUCT(dcmi_dms_fault_event);
    L_FIELD(dcmi_dms_fault_event, event_id);
    L_FIELD(dcmi_dms_fault_event, deviceid);
    L_FIELD(dcmi_dms_fault_event, node_type);
    L_FIELD(dcmi_dms_fault_event, node_id);
    L_FIELD(dcmi_dms_fault_event, sub_node_type);
    L_FIELD(dcmi_dms_fault_event, sub_node_id);
    L_FIELD(dcmi_dms_fault_event, severity);
    L_FIELD(dcmi_dms_fault_event, assertion);
    L_FIELD(dcmi_dms_fault_event, event_serial_num);
    L_FIELD(dcmi_dms_fault_event, notify_serial_num);
    L_FIELD(dcmi_dms_fault_event, alarm_raised_time);
    L_FIELD(dcmi_dms_fault_event, event_name);
    L_FIELD(dcmi_dms_fault_event, additional_info);
    L_FIELD(dcmi_dms_fault_event, os_id);
    L_FIELD(dcmi_dms_fault_event, resv_1);
    L_FIELD(dcmi_dms_fault_event, node_type_ex);
    L_FIELD(dcmi_dms_fault_event, sub_node_type_ex);
    L_FIELD(dcmi_dms_fault_event, resv_2);
    L_FIELD(dcmi_dms_fault_event, resv);
    L_STRUCT(dcmi_event);
    L_FIELD(dcmi_event, type);
    L_FIELD(dcmi_event, event_t);
    layout_add("}}");
}

const char *fake_dcmi_layout(void)
{
    pthread_once(&g_layout_once, build_layout);
    return g_layout;
}

/* ------------------------------------------------------------------ */
/* Event delivery                                                      */
/* ------------------------------------------------------------------ */

static void trace_event(int logic, unsigned int code, unsigned char assertion)
{
    struct timespec ts;
    FILE *fp;

    if (!g_trace_path[0])
        return;
    /* Opened per event so no FILE outlives a call: nothing to tear down at
     * exit while this thread may still be running. */
    fp = fopen(g_trace_path, "a");
    if (!fp) {
        fprintf(stderr, "fake_dcmi: cannot open trace %s: %s\n", g_trace_path, strerror(errno));
        return;
    }
    clock_gettime(CLOCK_REALTIME, &ts);
    fprintf(fp, "cb %lld %d %X %u\n", (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec,
            logic, code, assertion);
    fflush(fp);
    fclose(fp);
}

/* Runs on the control thread without g_lock, so callbacks may call back
 * into DCMI; returns after every callback has returned. */
static void deliver(int logic, unsigned int code, unsigned char assertion,
                    unsigned char severity, unsigned long long raised_at)
{
    dcmi_fault_event_callback targets[MAX_SUBSCRIPTIONS];
    struct dcmi_event ev;
    struct dcmi_dms_fault_event *f = &ev.event_t.dms_event;
    int n = 0;

    memset(&ev, 0, sizeof ev);
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < g_nsubs; i++) {
        const struct subscription *s = &g_subs[i];

        if (s->logic != -1 && s->logic != logic)
            continue;
        if ((s->filter.filter_flag & DCMI_EVENT_FILTER_FLAG_EVENT_ID) &&
            s->filter.event_id != code)
            continue;
        targets[n++] = s->handler;
    }
    f->event_serial_num = ++g_event_serial;
    pthread_mutex_unlock(&g_lock);

    ev.type = DCMI_DMS_FAULT_EVENT;
    f->event_id = code;
    f->deviceid = (unsigned short)logic;
    f->severity = severity;
    f->assertion = assertion;
    f->notify_serial_num = f->event_serial_num;
    f->alarm_raised_time = raised_at;
    snprintf(f->event_name, sizeof f->event_name, "fake dcmi event %X", code);

    if (n > 0)
        trace_event(logic, code, assertion);
    for (int i = 0; i < n; i++) {
        struct dcmi_event copy = ev; /* a callback scribbling on it can't affect the next */

        targets[i](&copy);
    }
}

/* ------------------------------------------------------------------ */
/* Control commands                                                    */
/* ------------------------------------------------------------------ */

/* Each command gets its arguments (without the name) and a buffer for the
 * reply text; it returns 0 for "ok[ <text>]" or -1 for "err <text>". */

__attribute__((format(printf, 3, 4))) static int fail(char *msg, size_t cap, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(msg, cap, fmt, ap);
    va_end(ap);
    return -1;
}

static int parse_int(const char *s, long long min, long long max, long long *out)
{
    char *end;
    long long v;

    errno = 0;
    v = strtoll(s, &end, 10);
    if (end == s || *end || errno || v < min || v > max)
        return -1;
    *out = v;
    return 0;
}

static int parse_byte(const char *what, const char *s, unsigned char *out, char *msg, size_t cap)
{
    long long v;

    if (parse_int(s, 0, 255, &v))
        return fail(msg, cap, "bad %s '%s' (0..255)", what, s);
    *out = (unsigned char)v;
    return 0;
}

/* "<logic> <hex>", the first two arguments of the event commands. */
static int parse_target(char **args, int *logic, unsigned int *code, char *msg, size_t cap)
{
    long long v;
    unsigned long long c;
    char *end;

    if (parse_int(args[0], 0, g_ndev - 1, &v))
        return fail(msg, cap, "bad logic id '%s' (0..%d)", args[0], g_ndev - 1);
    *logic = (int)v;
    /* strtoull alone would accept a sign or an empty string. */
    errno = 0;
    c = isxdigit((unsigned char)args[1][0]) ? strtoull(args[1], &end, 16) : ULLONG_MAX;
    if (c > UINT_MAX || errno || *end)
        return fail(msg, cap, "bad hex code '%s'", args[1]);
    *code = (unsigned int)c;
    return 0;
}

/* Optional "[severity] [event|silent]" tail, in either order; severity is
 * only allowed when the caller passes somewhere to put it. */
static int parse_tail(char **args, int nargs, unsigned char *severity, int *emit,
                      char *msg, size_t cap)
{
    int seen_severity = 0, seen_mode = 0;

    for (int i = 0; i < nargs; i++) {
        if (!strcmp(args[i], "event") || !strcmp(args[i], "silent")) {
            if (seen_mode++)
                return fail(msg, cap, "event|silent given twice");
            *emit = args[i][0] == 'e';
        } else if (severity && !seen_severity++) {
            if (parse_byte("severity", args[i], severity, msg, cap))
                return -1;
        } else {
            return fail(msg, cap, "unexpected argument '%s'", args[i]);
        }
    }
    return 0;
}

static int find_code(const struct device *d, unsigned int code)
{
    for (unsigned int i = 0; i < d->ncodes; i++)
        if (d->codes[i].code == code)
            return (int)i;
    return -1;
}

static struct fn_ctl *find_fn(const char *name)
{
    for (int i = 0; i < FN_COUNT; i++)
        if (!strcmp(g_fns[i].name, name))
            return &g_fns[i];
    return NULL;
}

static int cmd_occur(char **args, int nargs, char *msg, size_t cap)
{
    unsigned long long now = alarm_now();
    unsigned char severity = 2;
    unsigned int code;
    int logic, emit = 1;
    struct device *d;

    if (parse_target(args, &logic, &code, msg, cap) ||
        parse_tail(args + 2, nargs - 2, &severity, &emit, msg, cap))
        return -1;
    pthread_mutex_lock(&g_lock);
    d = &g_dev[logic];
    /* A repeated occur keeps the first entry (and its time) in the list. */
    if (find_code(d, code) < 0) {
        if (d->ncodes == MAX_CODES) {
            pthread_mutex_unlock(&g_lock);
            return fail(msg, cap, "device %d already has %d codes", logic, MAX_CODES);
        }
        d->codes[d->ncodes++] = (struct active_code){code, severity, now};
    }
    pthread_mutex_unlock(&g_lock);
    if (emit)
        deliver(logic, code, ASSERT_OCCUR, severity, now);
    return 0;
}

static int cmd_recover(char **args, int nargs, char *msg, size_t cap)
{
    unsigned long long raised_at = alarm_now();
    unsigned char severity = 2;
    unsigned int code;
    int logic, emit = 1, i;
    struct device *d;

    if (parse_target(args, &logic, &code, msg, cap) ||
        parse_tail(args + 2, nargs - 2, NULL, &emit, msg, cap))
        return -1;
    pthread_mutex_lock(&g_lock);
    d = &g_dev[logic];
    i = find_code(d, code);
    if (i >= 0) {
        /* The real driver's recovery event carries the alarm's own time
         * and severity. */
        raised_at = d->codes[i].raised_at;
        severity = d->codes[i].severity;
        memmove(&d->codes[i], &d->codes[i + 1], (d->ncodes - i - 1) * sizeof d->codes[0]);
        d->ncodes--;
    }
    pthread_mutex_unlock(&g_lock);
    if (emit)
        deliver(logic, code, ASSERT_RECOVER, severity, raised_at);
    return 0;
}

static int cmd_once(char **args, int nargs, char *msg, size_t cap)
{
    unsigned char severity = 1;
    unsigned int code;
    int logic;

    if (parse_target(args, &logic, &code, msg, cap) ||
        (nargs > 2 && parse_byte("severity", args[2], &severity, msg, cap)))
        return -1;
    deliver(logic, code, ASSERT_ONCE, severity, alarm_now());
    return 0;
}

static int cmd_event(char **args, int nargs, char *msg, size_t cap)
{
    unsigned char assertion = 0, severity = 0;
    unsigned int code;
    int logic;

    if (parse_target(args, &logic, &code, msg, cap) ||
        parse_byte("assertion", args[2], &assertion, msg, cap) ||
        parse_byte("severity", args[3], &severity, msg, cap))
        return -1;
    deliver(logic, code, assertion, severity, alarm_now());
    return 0;
}

static int set_dropped(const char *arg, int dropped, char *msg, size_t cap)
{
    long long logic;

    if (parse_int(arg, 0, g_ndev - 1, &logic))
        return fail(msg, cap, "bad logic id '%s' (0..%d)", arg, g_ndev - 1);
    pthread_mutex_lock(&g_lock);
    g_dev[logic].dropped = dropped;
    pthread_mutex_unlock(&g_lock);
    return 0;
}

static int cmd_drop(char **args, int nargs, char *msg, size_t cap)
{
    return set_dropped(args[0], 1, msg, cap);
}

static int cmd_restore(char **args, int nargs, char *msg, size_t cap)
{
    return set_dropped(args[0], 0, msg, cap);
}

static int cmd_hang(char **args, int nargs, char *msg, size_t cap)
{
    struct fn_ctl *f = find_fn(args[0]);
    char *end;
    double seconds;

    if (!f)
        return fail(msg, cap, "unknown function '%s'", args[0]);
    errno = 0;
    seconds = strtod(args[1], &end);
    if (end == args[1] || *end || errno || !(seconds >= 0 && seconds <= MAX_HANG_SECONDS))
        return fail(msg, cap, "bad seconds '%s' (0..%g)", args[1], MAX_HANG_SECONDS);
    pthread_mutex_lock(&g_lock);
    f->hang_ns = (long long)(seconds * 1e9 + 0.5);
    if (f->hang_ns == 0) {
        f->release_gen++;
        pthread_cond_broadcast(&g_hang_cond);
    }
    pthread_mutex_unlock(&g_lock);
    return 0;
}

static int cmd_fail(char **args, int nargs, char *msg, size_t cap)
{
    struct fn_ctl *f = find_fn(args[0]);
    long long rc;

    if (!f)
        return fail(msg, cap, "unknown function '%s'", args[0]);
    if (parse_int(args[1], INT_MIN, INT_MAX, &rc))
        return fail(msg, cap, "bad rc '%s'", args[1]);
    pthread_mutex_lock(&g_lock);
    f->fail_rc = (int)rc;
    pthread_mutex_unlock(&g_lock);
    return 0;
}

static int cmd_health(char **args, int nargs, char *msg, size_t cap)
{
    long long logic, value;

    if (parse_int(args[0], 0, g_ndev - 1, &logic))
        return fail(msg, cap, "bad logic id '%s' (0..%d)", args[0], g_ndev - 1);
    if (parse_int(args[1], 0, UINT_MAX, &value))
        return fail(msg, cap, "bad health value '%s'", args[1]);
    pthread_mutex_lock(&g_lock);
    g_dev[logic].health = (unsigned int)value;
    pthread_mutex_unlock(&g_lock);
    return 0;
}

/* "die"/"pcie": what later calls answer (the agent reads them at inventory; FAKE_DCMI_VDIE/PCIE set them
 * before it). */
static int cmd_identity(char **args, char *msg, size_t cap, int (*set)(const char *, int))
{
    long long logic;
    int bad;

    if (parse_int(args[0], 0, g_ndev - 1, &logic))
        return fail(msg, cap, "bad logic id '%s' (0..%d)", args[0], g_ndev - 1);
    pthread_mutex_lock(&g_lock);
    bad = set(args[1], (int)logic);
    pthread_mutex_unlock(&g_lock);
    return bad ? fail(msg, cap, "bad value '%s'", args[1]) : 0;
}

static int cmd_die(char **args, int nargs, char *msg, size_t cap) { return cmd_identity(args, msg, cap, set_vdie); }
static int cmd_pcie(char **args, int nargs, char *msg, size_t cap) { return cmd_identity(args, msg, cap, set_pcie); }

static int cmd_clock(char **args, int nargs, char *msg, size_t cap)
{
    long long seconds;

    if (parse_int(args[0], 0, LLONG_MAX, &seconds))
        return fail(msg, cap, "bad seconds '%s'", args[0]);
    pthread_mutex_lock(&g_lock);
    g_alarm_clock = (unsigned long long)seconds;
    pthread_mutex_unlock(&g_lock);
    return 0;
}

static int cmd_stats(char **args, int nargs, char *msg, size_t cap)
{
    size_t n;

    pthread_mutex_lock(&g_lock);
    n = (size_t)snprintf(msg, cap, "subscribers=%d calls=", g_nsubs);
    for (int i = 0; i < FN_COUNT && n < cap; i++)
        n += (size_t)snprintf(msg + n, cap - n, "%s%s:%lu", i ? "," : "", g_fns[i].name,
                              g_fns[i].calls);
    pthread_mutex_unlock(&g_lock);
    return 0;
}

static const struct command {
    const char *name;
    int min_args, max_args;
    const char *usage;
    int (*run)(char **args, int nargs, char *msg, size_t cap);
} g_commands[] = {
    {"occur", 2, 4, "occur <logic> <hex> [severity] [event|silent]", cmd_occur},
    {"recover", 2, 3, "recover <logic> <hex> [event|silent]", cmd_recover},
    {"once", 2, 3, "once <logic> <hex> [severity]", cmd_once},
    {"event", 4, 4, "event <logic> <hex> <assertion> <severity>", cmd_event},
    {"drop", 1, 1, "drop <logic>", cmd_drop},
    {"restore", 1, 1, "restore <logic>", cmd_restore},
    {"hang", 2, 2, "hang <function> <seconds>", cmd_hang},
    {"fail", 2, 2, "fail <function> <rc>", cmd_fail},
    {"health", 2, 2, "health <logic> <value>", cmd_health},
    {"die", 2, 2, "die <logic> <W-W-W-W-W hex>", cmd_die},
    {"pcie", 2, 2, "pcie <logic> <DDDD:BB:DD.F>", cmd_pcie},
    {"clock", 1, 1, "clock <unix-seconds, 0 = real>", cmd_clock},
    {"stats", 0, 0, "stats", cmd_stats},
};

#define MAX_ARGS 8

/* Runs one command line and formats the reply (without the newline). */
static void handle_line(char *line, char *reply, size_t cap)
{
    char *argv[MAX_ARGS + 1], *save = NULL, *tok;
    char msg[1024] = "";
    int argc = 0, rc = -1;

    for (tok = strtok_r(line, " \t\r", &save); tok; tok = strtok_r(NULL, " \t\r", &save)) {
        if (argc == MAX_ARGS + 1) {
            snprintf(reply, cap, "err too many arguments");
            return;
        }
        argv[argc++] = tok;
    }
    if (argc == 0) {
        snprintf(reply, cap, "err empty command");
        return;
    }
    for (size_t i = 0; i < sizeof g_commands / sizeof g_commands[0]; i++) {
        const struct command *c = &g_commands[i];

        if (strcmp(c->name, argv[0]))
            continue;
        if (argc - 1 < c->min_args || argc - 1 > c->max_args)
            rc = fail(msg, sizeof msg, "usage: %s", c->usage);
        else
            rc = c->run(argv + 1, argc - 1, msg, sizeof msg);
        snprintf(reply, cap, "%s%s%s", rc ? "err" : "ok", msg[0] ? " " : "", msg);
        return;
    }
    snprintf(reply, cap, "err unknown command '%.64s'", argv[0]);
}

static int send_all(int fd, const char *buf, size_t len)
{
    while (len > 0) {
        /* MSG_NOSIGNAL: a test that hangs up early must not SIGPIPE the agent. */
        ssize_t n = send(fd, buf, len, MSG_NOSIGNAL);

        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        buf += n;
        len -= (size_t)n;
    }
    return 0;
}

static void serve_connection(int fd)
{
    char buf[1024], reply[1100];
    size_t len = 0;

    for (;;) {
        ssize_t n = recv(fd, buf + len, sizeof buf - 1 - len, 0);
        char *start = buf, *nl;

        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return;
        len += (size_t)n;
        while ((nl = memchr(start, '\n', len - (size_t)(start - buf)))) {
            *nl = '\0';
            handle_line(start, reply, sizeof reply - 1);
            strcat(reply, "\n");
            if (send_all(fd, reply, strlen(reply)))
                return;
            start = nl + 1;
        }
        len -= (size_t)(start - buf);
        memmove(buf, start, len);
        if (len == sizeof buf - 1) {
            static const char too_long[] = "err command too long\n";

            send_all(fd, too_long, sizeof too_long - 1);
            return;
        }
    }
}

static void *control_main(void *arg)
{
    int lfd = (int)(intptr_t)arg;

    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);

        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            fprintf(stderr, "fake_dcmi: control accept: %s\n", strerror(errno));
            break;
        }
        serve_connection(fd);
        close(fd);
    }
    close(lfd);
    return NULL;
}

/* Called from dcmi_init with g_lock held.  The socket is bound before
 * dcmi_init returns, so a test can connect as soon as init is done.  Any
 * failure is logged and leaves the library working without control. */
static void start_control(void)
{
    const char *path = getenv("FAKE_DCMI_CONTROL");
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    pthread_attr_t attr;
    sigset_t all, old;
    pthread_t tid;
    int fd, err;

    if (!path || !*path)
        return;
    if (strlen(path) >= sizeof addr.sun_path) {
        fprintf(stderr, "fake_dcmi: FAKE_DCMI_CONTROL path longer than %zu bytes: %s\n",
                sizeof addr.sun_path - 1, path);
        return;
    }
    strcpy(addr.sun_path, path);
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        fprintf(stderr, "fake_dcmi: control socket: %s\n", strerror(errno));
        return;
    }
    unlink(path); /* a stale socket from an earlier run would fail bind() */
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) || listen(fd, 4)) {
        fprintf(stderr, "fake_dcmi: control bind %s: %s\n", path, strerror(errno));
        close(fd);
        return;
    }
    strcpy(g_sock_path, path);
    g_sock_owner = getpid();

    /* Block all signals in the new thread (it inherits the mask) so the
     * host process's signal handling stays on its own threads. */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    err = pthread_create(&tid, &attr, control_main, (void *)(intptr_t)fd);
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err) {
        fprintf(stderr, "fake_dcmi: control thread: %s\n", strerror(err));
        close(fd);
        unlink(g_sock_path);
        g_sock_path[0] = '\0';
    }
}
