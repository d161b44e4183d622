/*
 * fake_dcmi.c - a fake libdcmi.so for tests.
 *
 * Exports the subset of Huawei's DCMI C ABI the agent uses (dcmi_abi.h), so
 * the agent's real ctypes loader can dlopen it in place of the driver.  The
 * topology comes from FAKE_DCMI_* environment variables read by dcmi_init()
 * (CARDS, CHIPS_PER_CARD, PHY_IDS, CHIP_NAME; VDIE and PCIE for the chips'
 * identities; BOARD_ID and MAINBOARD_ID for the board; FAIL=function=rc,...
 * for failures from the first call on);
 * faults, hangs and failures are injected at run time through a unix socket
 * (FAKE_DCMI_CONTROL) served by a detached thread, because the library lives
 * inside the process under test.  See build.py / control.py for the Python
 * side; g_commands below lists the control commands.  Telemetry readings are
 * per chip ("tele", "procs"; defaults in default_tele()); "hang", "fail" and
 * "tele <logic> unsupported" can target one chip.  Calls that name a card
 * only (dcmi_get_card_elabel_v2) use the knobs of the card's first chip;
 * calls that name no chip (dcmi_get_dcmi_version, the topology calls) only
 * those set without a logic id.
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
_Static_assert(sizeof(enum dcmi_freq_type) == 4 && sizeof(enum dcmi_device_type) == 4 &&
               sizeof(enum dcmi_rdfx_detect_result) == 4 && sizeof(enum dcmi_main_cmd) == 4, "enum sizes");
_Static_assert(sizeof(struct dcmi_hbm_info) == 32, "dcmi_hbm_info size");
_Static_assert(offsetof(struct dcmi_hbm_info, freq) == 8 && offsetof(struct dcmi_hbm_info, memory_usage) == 16 &&
               offsetof(struct dcmi_hbm_info, temp) == 24 &&
               offsetof(struct dcmi_hbm_info, bandwith_util_rate) == 28, "dcmi_hbm_info offsets");
_Static_assert(sizeof(struct dcmi_ecc_info) == 36, "dcmi_ecc_info size");
_Static_assert(offsetof(struct dcmi_ecc_info, single_bit_next_isolated_pages_cnt) == 28 &&
               offsetof(struct dcmi_ecc_info, double_bit_next_isolated_pages_cnt) == 32, "dcmi_ecc_info offsets");
_Static_assert(sizeof(struct dcmi_multi_utilization_info) == 48, "dcmi_multi_utilization_info size");
_Static_assert(offsetof(struct dcmi_multi_utilization_info, npu_util) == 12 &&
               offsetof(struct dcmi_multi_utilization_info, reserved) == 16, "multi_utilization offsets");
_Static_assert(sizeof(struct dcmi_pcie_link_bandwidth_info) == 88, "dcmi_pcie_link_bandwidth_info size");
_Static_assert(offsetof(struct dcmi_pcie_link_bandwidth_info, tx_p_bw) == 4 &&
               offsetof(struct dcmi_pcie_link_bandwidth_info, tx_np_lantency) == 40 &&
               offsetof(struct dcmi_pcie_link_bandwidth_info, rx_cpl_bw) == 76, "pcie_link_bandwidth offsets");
_Static_assert(sizeof(struct dcmi_hccs_statistic_info) == 512, "dcmi_hccs_statistic_info size");
_Static_assert(offsetof(struct dcmi_hccs_statistic_info, rx_cnt) == 64 &&
               offsetof(struct dcmi_hccs_statistic_info, retry_cnt) == 192 &&
               offsetof(struct dcmi_hccs_statistic_info, reserved_field_cnt) == 256, "dcmi_hccs_statistic_info offsets");
_Static_assert(sizeof(struct dcmi_hccs_statistic_info_u64) == 1024, "dcmi_hccs_statistic_info_u64 size");
_Static_assert(offsetof(struct dcmi_hccs_statistic_info_u64, rx_cnt) == 128 &&
               offsetof(struct dcmi_hccs_statistic_info_u64, retry_cnt) == 384 &&
               offsetof(struct dcmi_hccs_statistic_info_u64, reserved) == 512, "dcmi_hccs_statistic_info_u64 offsets");
_Static_assert(sizeof(struct dcmi_hccs_bandwidth_info) == 280, "dcmi_hccs_bandwidth_info size");
_Static_assert(offsetof(struct dcmi_hccs_bandwidth_info, total_txbw) == 8 &&
               offsetof(struct dcmi_hccs_bandwidth_info, tx_bandwidth) == 24 &&
               offsetof(struct dcmi_hccs_bandwidth_info, rx_bandwidth) == 152, "dcmi_hccs_bandwidth_info offsets");
_Static_assert(sizeof(struct dcmi_sio_crc_err_statistic_info) == 12 &&
               offsetof(struct dcmi_sio_crc_err_statistic_info, reserved) == 4, "dcmi_sio_crc_err_statistic_info");
_Static_assert(sizeof(struct dcmi_proc_mem_info) == 16 && offsetof(struct dcmi_proc_mem_info, proc_mem_usage) == 8,
               "dcmi_proc_mem_info");
_Static_assert(sizeof(struct dcmi_elabel_info) == 1280 && offsetof(struct dcmi_elabel_info, serial_number) == 1024,
               "dcmi_elabel_info");

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

/* Per-chip telemetry, settable with "tele" (see g_tele_fields). */
#define TYPE_SLOTS 16 /* frequency / utilization types */
#define PCIE_BW_ARRAYS 7
struct tele {
    int temperature, power;
    unsigned int voltage;
    int network_health;
    unsigned int freq[TYPE_SLOTS], util[TYPE_SLOTS]; /* by type; a type is supported if its bit is set */
    unsigned long long hbm_total, hbm_used;
    unsigned int hbm_freq;
    int hbm_temp;
    unsigned int hbm_bw;
    unsigned int ecc[9];
    unsigned long long hccs_tx[HCCS_PORT_NUM], hccs_rx[HCCS_PORT_NUM], hccs_crc[HCCS_PORT_NUM],
        hccs_retry[HCCS_PORT_NUM];
    double hccs_bw_tx[HCCS_PORT_NUM], hccs_bw_rx[HCCS_PORT_NUM];
    unsigned int pcie[PCIE_BW_ARRAYS][PCIE_BW_VALUES]; /* in the struct's member order */
    unsigned short sio_tx, sio_rx;
    unsigned int mainboard_id;
    unsigned int board_id;
    int nprocs;
    struct dcmi_proc_mem_info procs[DCMI_MAX_PROC_NUM];
};

#define FREQ_TYPES ((1u << 2) | (1u << 6) | (1u << 7) | (1u << 9))                  /* 910B */
#define UTIL_TYPES ((1u << 2) | (1u << 6) | (1u << 12) | (1u << 13) | (1u << 14))

struct device {
    struct tele tele;
    char serial[DCMI_ELABEL_LEN]; /* used for the card's first chip only: the elabel is card-level */
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
    FN_TEMPERATURE,
    FN_POWER,
    FN_VOLTAGE,
    FN_FREQUENCY,
    FN_NETWORK_HEALTH,
    FN_UTILIZATION,
    FN_MULTI_UTILIZATION,
#ifndef FAKE_DCMI_OMIT_PERIOD
    FN_MULTI_UTILIZATION_PERIOD,
#endif
    FN_HBM_INFO,
    FN_ECC_INFO,
    FN_DEVICE_INFO,
    FN_HCCS_BANDWIDTH,
    FN_PCIE_BANDWIDTH,
    FN_RESOURCE_INFO,
    FN_ELABEL,
    FN_MAINBOARD_ID,
    FN_BOARD_INFO,
    FN_VERSION,
    FN_COUNT
};

/* Knobs are per chip (index = logic id); index NO_CHIP serves calls that name no valid chip. */
#define NO_CHIP MAX_DEVICES
struct fn_ctl {
    const char *name;
    unsigned long calls;
    long long hang_ns[MAX_DEVICES + 1];          /* 0: calls do not hang */
    unsigned long release_gen[MAX_DEVICES + 1];  /* bumped by "hang <fn> 0" to free waiters */
    int fail_rc[MAX_DEVICES + 1];                /* 0: no injected failure */
    unsigned char unsupported[MAX_DEVICES];      /* answer DCMI_ERR_NOT_SUPPORTED */
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
    [FN_TEMPERATURE] = {"dcmi_get_device_temperature"},
    [FN_POWER] = {"dcmi_get_device_power_info"},
    [FN_VOLTAGE] = {"dcmi_get_device_voltage"},
    [FN_FREQUENCY] = {"dcmi_get_device_frequency"},
    [FN_NETWORK_HEALTH] = {"dcmi_get_device_network_health"},
    [FN_UTILIZATION] = {"dcmi_get_device_utilization_rate"},
    [FN_MULTI_UTILIZATION] = {"dcmi_get_device_multi_utilization_rate"},
#ifndef FAKE_DCMI_OMIT_PERIOD
    [FN_MULTI_UTILIZATION_PERIOD] = {"dcmi_get_device_multi_utilization_rate_period"},
#endif
    [FN_HBM_INFO] = {"dcmi_get_device_hbm_info"},
    [FN_ECC_INFO] = {"dcmi_get_device_ecc_info"},
    [FN_DEVICE_INFO] = {"dcmi_get_device_info"},
    [FN_HCCS_BANDWIDTH] = {"dcmi_get_hccs_link_bandwidth_info"},
    [FN_PCIE_BANDWIDTH] = {"dcmi_get_pcie_link_bandwidth_info"},
    [FN_RESOURCE_INFO] = {"dcmi_get_device_resource_info"},
    [FN_ELABEL] = {"dcmi_get_card_elabel_v2"},
    [FN_MAINBOARD_ID] = {"dcmi_get_mainboard_id"},
    [FN_BOARD_INFO] = {"dcmi_get_device_board_info"},
    [FN_VERSION] = {"dcmi_get_dcmi_version"},
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
static char g_version[64] = "24.1.rc3"; /* "version <text>" */

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

/* An unsigned 32-bit knob (decimal or 0x hex) that applies to every chip; 0 with *set = 0 when unset. */
static int env_u32(const char *name, unsigned int *out, int *set)
{
    const char *s = getenv(name);
    char *end;
    unsigned long v;

    *set = 0;
    if (!s || !*s)
        return 0;
    errno = 0;
    v = strtoul(s, &end, 0);
    if (errno || *end || v > 0xFFFFFFFFul) {
        fprintf(stderr, "fake_dcmi: bad %s='%s' (a 32-bit number)\n", name, s);
        return -1;
    }
    *out = (unsigned int)v;
    *set = 1;
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
        for (int i = 0; i <= NO_CHIP; i++)
            f->fail_rc[i] = (int)rc;
        s += n + (s[n] == ',');
    }
    return 0;
bad:
    fprintf(stderr, "fake_dcmi: bad FAKE_DCMI_FAIL near '%s' (function=rc,...)\n", s);
    return -1;
}

/* 910B3-like readings; see the "tele" grammar in control.py for the names. */
static void default_tele(struct tele *t, int logic, int a3)
{
    memset(t, 0, sizeof *t);
    t->temperature = 45;
    t->power = 1853;   /* 0.1 W */
    t->voltage = 88;   /* 0.01 V */
    t->network_health = DCMI_RDFX_DETECT_OK;
    t->freq[DCMI_FREQ_CTRLCPU] = 1900;
    t->freq[DCMI_FREQ_HBM] = 1600;
    t->freq[DCMI_FREQ_AICORE_CURRENT_] = 1800;
    t->freq[DCMI_FREQ_AICORE_MAX] = 1800;
    t->util[2] = 35;   /* aicore */
    t->util[6] = 20;   /* hbm */
    t->util[12] = 30;  /* vector */
    t->util[13] = 40;  /* overall */
    t->util[14] = 50;  /* cube */
    t->hbm_total = 65536;
    t->hbm_used = 3200;
    t->hbm_freq = 1600;
    t->hbm_temp = 40;
    t->hbm_bw = 10;
    t->ecc[0] = 1;     /* enable_flag */
    for (int p = 0; p < HCCS_PORT_NUM; p++) {
        t->hccs_tx[p] = 1000 + (unsigned long long)p;
        t->hccs_rx[p] = 2000 + (unsigned long long)p;
        t->hccs_bw_tx[p] = 1.25;
        t->hccs_bw_rx[p] = 2.5;
    }
    for (int a = 0; a < PCIE_BW_ARRAYS; a++) {
        t->pcie[a][0] = 10;
        t->pcie[a][1] = 30;
        t->pcie[a][2] = 20;
    }
    /* Board and main board by chip name: an A3 (910_93) chip on an Atlas 900 A3 SuperPoD (board 0xb0,
     * main board 0x18); anything else an A2 board (0x21; its main board is not looked at). */
    t->board_id = a3 ? 0xb0 : 0x21;
    t->mainboard_id = a3 ? 0x18 : 0x64;
    t->nprocs = 2;
    t->procs[0] = (struct dcmi_proc_mem_info){1000 + 10 * logic, 1UL << 30};
    t->procs[1] = (struct dcmi_proc_mem_info){1001 + 10 * logic, 2UL << 30};
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
        default_tele(&g_dev[i].tele, i, name && strstr(name, "910_93") != NULL);
        snprintf(g_dev[i].serial, sizeof g_dev[i].serial, "FAKESN%04d", i / g_chips);
    }
    if (parse_per_chip("FAKE_DCMI_VDIE", set_vdie) || parse_per_chip("FAKE_DCMI_PCIE", set_pcie) ||
        parse_start_failures())
        return -1;
    /* The board, read once at start by npu-exporter (and the agent): set before the first call. */
    {
        unsigned int board, mainboard;
        int board_set, mainboard_set;

        if (env_u32("FAKE_DCMI_BOARD_ID", &board, &board_set) ||
            env_u32("FAKE_DCMI_MAINBOARD_ID", &mainboard, &mainboard_set))
            return -1;
        for (int i = 0; i < g_ndev; i++) {
            if (board_set)
                g_dev[i].tele.board_id = board;
            if (mainboard_set)
                g_dev[i].tele.mainboard_id = mainboard;
        }
    }

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

/* On DCMI_OK the caller holds g_lock and must return via api_leave().  card_id/device_id choose the
 * chip whose hang/fail/unsupported knobs apply (-1, -1: none); *logic gets its id or -1. */
static int api_enter_chip(enum fn_id fn, int card_id, int device_id, int *logic)
{
    struct fn_ctl *f = &g_fns[fn];
    int chip, l;

    pthread_mutex_lock(&g_lock);
    if (!g_initialized) {
        pthread_mutex_unlock(&g_lock);
        return FAKE_DCMI_ERR_NOT_INIT;
    }
    l = logic_of(card_id, device_id);
    if (logic)
        *logic = l;
    chip = l < 0 ? NO_CHIP : l;
    f->calls++;
    if (f->hang_ns[chip] > 0) {
        unsigned long gen = f->release_gen[chip];
        struct timespec deadline;

        clock_gettime(CLOCK_MONOTONIC, &deadline);
        deadline.tv_sec += f->hang_ns[chip] / 1000000000LL;
        deadline.tv_nsec += f->hang_ns[chip] % 1000000000LL;
        if (deadline.tv_nsec >= 1000000000L) {
            deadline.tv_sec++;
            deadline.tv_nsec -= 1000000000L;
        }
        /* The wait drops g_lock, so the control thread (and the releasing
         * "hang <fn> 0") keeps working while calls are stuck here. */
        while (f->release_gen[chip] == gen &&
               pthread_cond_timedwait(&g_hang_cond, &g_lock, &deadline) != ETIMEDOUT)
            ;
    }
    if (f->fail_rc[chip]) {
        int rc = f->fail_rc[chip];

        pthread_mutex_unlock(&g_lock);
        return rc;
    }
    if (chip != NO_CHIP && f->unsupported[chip]) {
        pthread_mutex_unlock(&g_lock);
        return DCMI_ERR_NOT_SUPPORTED;
    }
    return DCMI_OK;
}

static int api_enter(enum fn_id fn)
{
    return api_enter_chip(fn, -1, -1, NULL);
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
    int rc = api_enter_chip(FN_GET_DEVICE_CHIP_INFO, card_id, device_id, NULL);

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
    int rc = api_enter_chip(FN_GET_DEVICE_DIE_V2, card_id, device_id, NULL);
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
    int rc = api_enter_chip(FN_GET_DEVICE_PCIE_INFO_V2, card_id, device_id, NULL);
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
    int rc = api_enter_chip(FN_GET_DEVICE_HEALTH, card_id, device_id, NULL);
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
    int rc = api_enter_chip(FN_GET_DEVICE_ERRORCODE_V2, card_id, device_id, NULL);
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

/* ---- telemetry ---------------------------------------------------- */

/* Prologue of a per-chip telemetry call: the knobs, then the argument checks every call shares. */
static int tele_enter(enum fn_id fn, int card_id, int device_id, const void *out, struct tele **t)
{
    int logic, rc = api_enter_chip(fn, card_id, device_id, &logic);

    if (rc)
        return rc;
    if (!out || logic < 0)
        return api_leave(DCMI_ERR_INVALID_PARAM);
    if (g_dev[logic].dropped)
        return api_leave(DCMI_ERR_NOT_READY);
    *t = &g_dev[logic].tele;
    return DCMI_OK;
}

#define TELE_ENTER(fn, out)                                             \
    struct tele *t;                                                     \
    int rc = tele_enter(fn, card_id, device_id, out, &t);               \
    if (rc)                                                             \
        return rc

int dcmi_get_device_temperature(int card_id, int device_id, int *temperature)
{
    TELE_ENTER(FN_TEMPERATURE, temperature);
    *temperature = t->temperature;
    return api_leave(DCMI_OK);
}

int dcmi_get_device_power_info(int card_id, int device_id, int *power)
{
    TELE_ENTER(FN_POWER, power);
    *power = t->power;
    return api_leave(DCMI_OK);
}

int dcmi_get_device_voltage(int card_id, int device_id, unsigned int *voltage)
{
    TELE_ENTER(FN_VOLTAGE, voltage);
    *voltage = t->voltage;
    return api_leave(DCMI_OK);
}

int dcmi_get_device_frequency(int card_id, int device_id, enum dcmi_freq_type input_type,
                              unsigned int *frequency)
{
    TELE_ENTER(FN_FREQUENCY, frequency);
    if ((unsigned int)input_type >= TYPE_SLOTS || !(FREQ_TYPES & (1u << input_type)))
        return api_leave(DCMI_ERR_NOT_SUPPORTED);
    *frequency = t->freq[input_type];
    return api_leave(DCMI_OK);
}

int dcmi_get_device_network_health(int card_id, int device_id, enum dcmi_rdfx_detect_result *result)
{
    TELE_ENTER(FN_NETWORK_HEALTH, result);
    *result = (enum dcmi_rdfx_detect_result)t->network_health;
    return api_leave(DCMI_OK);
}

int dcmi_get_device_utilization_rate(int card_id, int device_id, int input_type, unsigned int *utilization_rate)
{
    TELE_ENTER(FN_UTILIZATION, utilization_rate);
    if (input_type < 0 || input_type >= TYPE_SLOTS || !(UTIL_TYPES & (1u << input_type)))
        return api_leave(DCMI_ERR_NOT_SUPPORTED);
    *utilization_rate = t->util[input_type];
    return api_leave(DCMI_OK);
}

static void fill_multi_util(const struct tele *t, struct dcmi_multi_utilization_info *u)
{
    memset(u, 0, sizeof *u);
    u->aic_util = t->util[14];
    u->aiv_util = t->util[12];
    u->aicore_util = t->util[2];
    u->npu_util = t->util[13];
}

int dcmi_get_device_multi_utilization_rate(int card_id, int device_id, struct dcmi_multi_utilization_info *util_info)
{
    TELE_ENTER(FN_MULTI_UTILIZATION, util_info);
    fill_multi_util(t, util_info);
    return api_leave(DCMI_OK);
}

#ifndef FAKE_DCMI_OMIT_PERIOD
int dcmi_get_device_multi_utilization_rate_period(int card_id, int device_id,
                                                  struct dcmi_multi_utilization_info *util_info, int period)
{
    TELE_ENTER(FN_MULTI_UTILIZATION_PERIOD, util_info);
    if (period < 1)
        return api_leave(DCMI_ERR_INVALID_PARAM);
    fill_multi_util(t, util_info);
    return api_leave(DCMI_OK);
}
#endif

int dcmi_get_device_hbm_info(int card_id, int device_id, struct dcmi_hbm_info *hbm_info)
{
    TELE_ENTER(FN_HBM_INFO, hbm_info);
    memset(hbm_info, 0, sizeof *hbm_info);
    hbm_info->memory_size = t->hbm_total;
    hbm_info->freq = t->hbm_freq;
    hbm_info->memory_usage = t->hbm_used;
    hbm_info->temp = t->hbm_temp;
    hbm_info->bandwith_util_rate = t->hbm_bw;
    return api_leave(DCMI_OK);
}

int dcmi_get_device_ecc_info(int card_id, int device_id, enum dcmi_device_type input_type,
                             struct dcmi_ecc_info *device_ecc_info)
{
    unsigned int *out = (unsigned int *)device_ecc_info;

    TELE_ENTER(FN_ECC_INFO, device_ecc_info);
    if (input_type != DCMI_DEVICE_TYPE_HBM)
        return api_leave(DCMI_ERR_NOT_SUPPORTED);
    /* Like the driver: the last two members of the 9-member header are left as the caller had them. */
    memcpy(out, t->ecc, DCMI_ECC_WRITTEN_MEMBERS * sizeof t->ecc[0]);
    return api_leave(DCMI_OK);
}

int dcmi_get_device_info(int card_id, int device_id, enum dcmi_main_cmd main_cmd, unsigned int sub_cmd,
                         void *buf, unsigned int *size)
{
    size_t need;

    TELE_ENTER(FN_DEVICE_INFO, buf);
    if (main_cmd == DCMI_MAIN_CMD_HCCS && sub_cmd == DCMI_HCCS_CMD_GET_STATISTIC_INFO)
        need = sizeof(struct dcmi_hccs_statistic_info);
    else if (main_cmd == DCMI_MAIN_CMD_HCCS && sub_cmd == DCMI_HCCS_CMD_GET_STATISTIC_INFO_U64)
        need = sizeof(struct dcmi_hccs_statistic_info_u64);
    else if (main_cmd == DCMI_MAIN_CMD_SIO && sub_cmd == DCMI_SIO_CMD_GET_CRC_ERR_STATISTIC)
        need = sizeof(struct dcmi_sio_crc_err_statistic_info);
    else
        return api_leave(DCMI_ERR_NOT_SUPPORTED);
    if (!size || *size < need)
        return api_leave(DCMI_ERR_INVALID_PARAM);
    memset(buf, 0, need);
    if (need == sizeof(struct dcmi_hccs_statistic_info)) {
        struct dcmi_hccs_statistic_info *h = buf;

        for (int p = 0; p < HCCS_PORT_NUM; p++) { /* the u32 view wraps, as a 32-bit counter does */
            h->tx_cnt[p] = (unsigned int)t->hccs_tx[p];
            h->rx_cnt[p] = (unsigned int)t->hccs_rx[p];
            h->crc_err_cnt[p] = (unsigned int)t->hccs_crc[p];
            h->retry_cnt[p] = (unsigned int)t->hccs_retry[p];
        }
    } else if (need == sizeof(struct dcmi_hccs_statistic_info_u64)) {
        struct dcmi_hccs_statistic_info_u64 *h = buf;

        memcpy(h->tx_cnt, t->hccs_tx, sizeof h->tx_cnt);
        memcpy(h->rx_cnt, t->hccs_rx, sizeof h->rx_cnt);
        memcpy(h->crc_err_cnt, t->hccs_crc, sizeof h->crc_err_cnt);
        memcpy(h->retry_cnt, t->hccs_retry, sizeof h->retry_cnt);
    } else {
        struct dcmi_sio_crc_err_statistic_info *sio = buf;

        sio->tx_error_count = t->sio_tx;
        sio->rx_error_count = t->sio_rx;
    }
    return api_leave(DCMI_OK);
}

/* The bandwidth calls sample for profiling_time ms, as the driver does; g_lock is not held meanwhile. */
static void sample_for(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};

    while (nanosleep(&ts, &ts) && errno == EINTR)
        ;
}

int dcmi_get_hccs_link_bandwidth_info(int card_id, int device_id, struct dcmi_hccs_bandwidth_info *hccs_bandwidth_info)
{
    double tx[HCCS_PORT_NUM], rx[HCCS_PORT_NUM];
    int ms;

    TELE_ENTER(FN_HCCS_BANDWIDTH, hccs_bandwidth_info);
    ms = hccs_bandwidth_info->profiling_time;
    if (ms < 1 || ms > 1000)
        return api_leave(DCMI_ERR_INVALID_PARAM);
    memcpy(tx, t->hccs_bw_tx, sizeof tx);
    memcpy(rx, t->hccs_bw_rx, sizeof rx);
    api_leave(DCMI_OK);
    sample_for(ms);
    for (int p = 0; p < HCCS_PORT_NUM; p++) {
        /* The driver adds into the totals without clearing them first. */
        hccs_bandwidth_info->tx_bandwidth[p] = tx[p];
        hccs_bandwidth_info->rx_bandwidth[p] = rx[p];
        hccs_bandwidth_info->total_txbw += tx[p];
        hccs_bandwidth_info->total_rxbw += rx[p];
    }
    return DCMI_OK;
}

int dcmi_get_pcie_link_bandwidth_info(int card_id, int device_id,
                                      struct dcmi_pcie_link_bandwidth_info *pcie_link_bandwidth_info)
{
    struct dcmi_pcie_link_bandwidth_info *out = pcie_link_bandwidth_info;
    unsigned int v[PCIE_BW_ARRAYS][PCIE_BW_VALUES];
    int ms;

    TELE_ENTER(FN_PCIE_BANDWIDTH, out);
    ms = out->profiling_time;
    if (ms < 0 || ms > 2000)
        return api_leave(DCMI_ERR_INVALID_PARAM);
    memcpy(v, t->pcie, sizeof v);
    api_leave(DCMI_OK);
    sample_for(ms);
    memcpy(out->tx_p_bw, v, sizeof v); /* the seven arrays follow profiling_time contiguously */
    return DCMI_OK;
}

int dcmi_get_device_resource_info(int card_id, int device_id, struct dcmi_proc_mem_info *proc_info, int *proc_num)
{
    TELE_ENTER(FN_RESOURCE_INFO, proc_info);
    if (!proc_num)
        return api_leave(DCMI_ERR_INVALID_PARAM);
    memcpy(proc_info, t->procs, (size_t)t->nprocs * sizeof t->procs[0]);
    *proc_num = t->nprocs;
    return api_leave(DCMI_OK);
}

int dcmi_get_mainboard_id(int card_id, int device_id, unsigned int *mainboard_id)
{
    TELE_ENTER(FN_MAINBOARD_ID, mainboard_id);
    *mainboard_id = t->mainboard_id;
    return api_leave(DCMI_OK);
}

int dcmi_get_device_board_info(int card_id, int device_id, struct dcmi_board_info *board_info)
{
    TELE_ENTER(FN_BOARD_INFO, board_info);
    memset(board_info, 0, sizeof *board_info);
    board_info->board_id = t->board_id;
    board_info->pcb_id = 1;
    board_info->bom_id = 1;
    board_info->slot_id = (unsigned int)logic_of(card_id, device_id);
    return api_leave(DCMI_OK);
}

int dcmi_get_card_elabel_v2(int card_id, struct dcmi_elabel_info *elabel_info)
{
    int logic, rc = api_enter_chip(FN_ELABEL, card_id, 0, &logic);

    if (rc)
        return rc;
    if (!elabel_info || logic < 0)
        return api_leave(DCMI_ERR_INVALID_PARAM);
    memset(elabel_info, 0, sizeof *elabel_info);
    strcpy(elabel_info->product_name, "Atlas 800T A2");
    strcpy(elabel_info->model, "IT21PDDA01");
    strcpy(elabel_info->manufacturer, "Huawei");
    strcpy(elabel_info->manufacturer_date, "2024/03/01");
    memcpy(elabel_info->serial_number, g_dev[logic].serial, sizeof elabel_info->serial_number);
    return api_leave(DCMI_OK);
}

int dcmi_get_dcmi_version(char *dcmi_ver, int buf_size)
{
    int rc = api_enter(FN_VERSION);

    if (rc)
        return rc;
    if (!dcmi_ver || buf_size < 0 || strlen(g_version) >= (size_t)buf_size)
        return api_leave(DCMI_ERR_INVALID_PARAM);
    strcpy(dcmi_ver, g_version);
    return api_leave(DCMI_OK);
}

/* ------------------------------------------------------------------ */
/* Layout report                                                       */
/* ------------------------------------------------------------------ */

static char g_layout[8192]; /* the JSON is ~3 KiB */
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
    L_STRUCT(dcmi_hbm_info);
    L_FIELD(dcmi_hbm_info, memory_size);
    L_FIELD(dcmi_hbm_info, freq);
    L_FIELD(dcmi_hbm_info, memory_usage);
    L_FIELD(dcmi_hbm_info, temp);
    L_FIELD(dcmi_hbm_info, bandwith_util_rate);
    L_STRUCT(dcmi_ecc_info);
    L_FIELD(dcmi_ecc_info, enable_flag);
    L_FIELD(dcmi_ecc_info, single_bit_error_cnt);
    L_FIELD(dcmi_ecc_info, double_bit_error_cnt);
    L_FIELD(dcmi_ecc_info, total_single_bit_error_cnt);
    L_FIELD(dcmi_ecc_info, total_double_bit_error_cnt);
    L_FIELD(dcmi_ecc_info, single_bit_isolated_pages_cnt);
    L_FIELD(dcmi_ecc_info, double_bit_isolated_pages_cnt);
    L_FIELD(dcmi_ecc_info, single_bit_next_isolated_pages_cnt);
    L_FIELD(dcmi_ecc_info, double_bit_next_isolated_pages_cnt);
    L_STRUCT(dcmi_multi_utilization_info);
    L_FIELD(dcmi_multi_utilization_info, aic_util);
    L_FIELD(dcmi_multi_utilization_info, aiv_util);
    L_FIELD(dcmi_multi_utilization_info, aicore_util);
    L_FIELD(dcmi_multi_utilization_info, npu_util);
    L_FIELD(dcmi_multi_utilization_info, reserved);
    L_STRUCT(dcmi_pcie_link_bandwidth_info);
    L_FIELD(dcmi_pcie_link_bandwidth_info, profiling_time);
    L_FIELD(dcmi_pcie_link_bandwidth_info, tx_p_bw);
    L_FIELD(dcmi_pcie_link_bandwidth_info, tx_np_bw);
    L_FIELD(dcmi_pcie_link_bandwidth_info, tx_cpl_bw);
    L_FIELD(dcmi_pcie_link_bandwidth_info, tx_np_lantency);
    L_FIELD(dcmi_pcie_link_bandwidth_info, rx_p_bw);
    L_FIELD(dcmi_pcie_link_bandwidth_info, rx_np_bw);
    L_FIELD(dcmi_pcie_link_bandwidth_info, rx_cpl_bw);
    L_STRUCT(dcmi_hccs_statistic_info);
    L_FIELD(dcmi_hccs_statistic_info, tx_cnt);
    L_FIELD(dcmi_hccs_statistic_info, rx_cnt);
    L_FIELD(dcmi_hccs_statistic_info, crc_err_cnt);
    L_FIELD(dcmi_hccs_statistic_info, retry_cnt);
    L_FIELD(dcmi_hccs_statistic_info, reserved_field_cnt);
    L_STRUCT(dcmi_hccs_statistic_info_u64);
    L_FIELD(dcmi_hccs_statistic_info_u64, tx_cnt);
    L_FIELD(dcmi_hccs_statistic_info_u64, rx_cnt);
    L_FIELD(dcmi_hccs_statistic_info_u64, crc_err_cnt);
    L_FIELD(dcmi_hccs_statistic_info_u64, retry_cnt);
    L_FIELD(dcmi_hccs_statistic_info_u64, reserved);
    L_STRUCT(dcmi_hccs_bandwidth_info);
    L_FIELD(dcmi_hccs_bandwidth_info, profiling_time);
    L_FIELD(dcmi_hccs_bandwidth_info, total_txbw);
    L_FIELD(dcmi_hccs_bandwidth_info, total_rxbw);
    L_FIELD(dcmi_hccs_bandwidth_info, tx_bandwidth);
    L_FIELD(dcmi_hccs_bandwidth_info, rx_bandwidth);
    L_STRUCT(dcmi_sio_crc_err_statistic_info);
    L_FIELD(dcmi_sio_crc_err_statistic_info, tx_error_count);
    L_FIELD(dcmi_sio_crc_err_statistic_info, rx_error_count);
    L_FIELD(dcmi_sio_crc_err_statistic_info, reserved);
    L_STRUCT(dcmi_proc_mem_info);
    L_FIELD(dcmi_proc_mem_info, proc_id);
    L_FIELD(dcmi_proc_mem_info, proc_mem_usage);
    L_STRUCT(dcmi_elabel_info);
    L_FIELD(dcmi_elabel_info, product_name);
    L_FIELD(dcmi_elabel_info, model);
    L_FIELD(dcmi_elabel_info, manufacturer);
    L_FIELD(dcmi_elabel_info, manufacturer_date);
    L_FIELD(dcmi_elabel_info, serial_number);
    L_STRUCT(dcmi_board_info);
    L_FIELD(dcmi_board_info, board_id);
    L_FIELD(dcmi_board_info, pcb_id);
    L_FIELD(dcmi_board_info, bom_id);
    L_FIELD(dcmi_board_info, slot_id);
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

/* The optional trailing logic id of "hang"/"fail": the chips [*first, *last] the knob applies to
 * (without it every chip, and calls that name no chip). */
static int parse_chips(char **args, int nargs, int at, int *first, int *last, char *msg, size_t cap)
{
    long long logic;

    if (nargs <= at) {
        *first = 0;
        *last = NO_CHIP;
        return 0;
    }
    if (parse_int(args[at], 0, g_ndev - 1, &logic))
        return fail(msg, cap, "bad logic id '%s' (0..%d)", args[at], g_ndev - 1);
    *first = *last = (int)logic;
    return 0;
}

static int cmd_hang(char **args, int nargs, char *msg, size_t cap)
{
    struct fn_ctl *f = find_fn(args[0]);
    char *end;
    double seconds;
    long long ns;
    int first, last;

    if (!f)
        return fail(msg, cap, "unknown function '%s'", args[0]);
    errno = 0;
    seconds = strtod(args[1], &end);
    if (end == args[1] || *end || errno || !(seconds >= 0 && seconds <= MAX_HANG_SECONDS))
        return fail(msg, cap, "bad seconds '%s' (0..%g)", args[1], MAX_HANG_SECONDS);
    if (parse_chips(args, nargs, 2, &first, &last, msg, cap))
        return -1;
    ns = (long long)(seconds * 1e9 + 0.5);
    pthread_mutex_lock(&g_lock);
    for (int i = first; i <= last; i++) {
        f->hang_ns[i] = ns;
        if (ns == 0)
            f->release_gen[i]++;
    }
    if (ns == 0)
        pthread_cond_broadcast(&g_hang_cond);
    pthread_mutex_unlock(&g_lock);
    return 0;
}

static int cmd_fail(char **args, int nargs, char *msg, size_t cap)
{
    struct fn_ctl *f = find_fn(args[0]);
    long long rc;
    int first, last;

    if (!f)
        return fail(msg, cap, "unknown function '%s'", args[0]);
    if (parse_int(args[1], INT_MIN, INT_MAX, &rc))
        return fail(msg, cap, "bad rc '%s'", args[1]);
    if (parse_chips(args, nargs, 2, &first, &last, msg, cap))
        return -1;
    pthread_mutex_lock(&g_lock);
    for (int i = first; i <= last; i++)
        f->fail_rc[i] = (int)rc;
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

/* "tele <logic> <field> <value>": one telemetry reading of one chip.  A field is a scalar name or
 * "<array>.<index>"; 32-bit fields take any value from INT_MIN to UINT_MAX (stored as its low 32 bits),
 * so out-of-range readings can be injected. */
enum tele_kind { K_I32, K_U32, K_U16, K_U64, K_DBL };

#define TF(name, member, kind, count) {name, offsetof(struct tele, member), kind, count}
static const struct tele_field {
    const char *name;
    size_t offset;
    enum tele_kind kind;
    int count; /* 0: scalar, else array length ("name.<index>") */
} g_tele_fields[] = {
    TF("temperature", temperature, K_I32, 0),
    TF("power", power, K_I32, 0),
    TF("voltage", voltage, K_U32, 0),
    TF("network_health", network_health, K_I32, 0),
    TF("freq", freq, K_U32, TYPE_SLOTS),
    TF("util", util, K_U32, TYPE_SLOTS),
    TF("hbm.total", hbm_total, K_U64, 0),
    TF("hbm.used", hbm_used, K_U64, 0),
    TF("hbm.freq", hbm_freq, K_U32, 0),
    TF("hbm.temp", hbm_temp, K_I32, 0),
    TF("hbm.bw", hbm_bw, K_U32, 0),
    TF("ecc.enable_flag", ecc[0], K_I32, 0),
    TF("ecc.single_bit_error_cnt", ecc[1], K_U32, 0),
    TF("ecc.double_bit_error_cnt", ecc[2], K_U32, 0),
    TF("ecc.total_single_bit_error_cnt", ecc[3], K_U32, 0),
    TF("ecc.total_double_bit_error_cnt", ecc[4], K_U32, 0),
    TF("ecc.single_bit_isolated_pages_cnt", ecc[5], K_U32, 0),
    TF("ecc.double_bit_isolated_pages_cnt", ecc[6], K_U32, 0),
    TF("hccs.tx", hccs_tx, K_U64, HCCS_PORT_NUM),
    TF("hccs.rx", hccs_rx, K_U64, HCCS_PORT_NUM),
    TF("hccs.crc", hccs_crc, K_U64, HCCS_PORT_NUM),
    TF("hccs.retry", hccs_retry, K_U64, HCCS_PORT_NUM),
    TF("hccs_bw.tx", hccs_bw_tx, K_DBL, HCCS_PORT_NUM),
    TF("hccs_bw.rx", hccs_bw_rx, K_DBL, HCCS_PORT_NUM),
    TF("pcie.tx_p_bw", pcie[0], K_U32, PCIE_BW_VALUES),
    TF("pcie.tx_np_bw", pcie[1], K_U32, PCIE_BW_VALUES),
    TF("pcie.tx_cpl_bw", pcie[2], K_U32, PCIE_BW_VALUES),
    TF("pcie.tx_np_lantency", pcie[3], K_U32, PCIE_BW_VALUES),
    TF("pcie.rx_p_bw", pcie[4], K_U32, PCIE_BW_VALUES),
    TF("pcie.rx_np_bw", pcie[5], K_U32, PCIE_BW_VALUES),
    TF("pcie.rx_cpl_bw", pcie[6], K_U32, PCIE_BW_VALUES),
    TF("sio.tx", sio_tx, K_U16, 0),
    TF("sio.rx", sio_rx, K_U16, 0),
    TF("mainboard_id", mainboard_id, K_U32, 0),
    TF("board_id", board_id, K_U32, 0),
};

/* Readable aliases for the utilization / frequency types npu-exporter asks for. */
static const char *const g_tele_aliases[][2] = {
    {"util.aicore", "util.2"}, {"util.hbm", "util.6"},      {"util.vector", "util.12"},
    {"util.overall", "util.13"}, {"util.cube", "util.14"}, {"aicore_freq", "freq.7"},
};

/* Finds the field and the address of the value inside *t. */
static const struct tele_field *find_tele(const char *name, struct tele *t, void **where)
{
    for (size_t i = 0; i < sizeof g_tele_aliases / sizeof g_tele_aliases[0]; i++)
        if (!strcmp(name, g_tele_aliases[i][0]))
            name = g_tele_aliases[i][1];
    for (size_t i = 0; i < sizeof g_tele_fields / sizeof g_tele_fields[0]; i++) {
        const struct tele_field *f = &g_tele_fields[i];
        size_t n = strlen(f->name);
        static const size_t width[] = {[K_I32] = 4, [K_U32] = 4, [K_U16] = 2, [K_U64] = 8, [K_DBL] = 8};
        long long index = 0;

        if (strncmp(name, f->name, n))
            continue;
        if (f->count ? name[n] != '.' || parse_int(name + n + 1, 0, f->count - 1, &index) : name[n] != 0)
            continue;
        *where = (char *)t + f->offset + (size_t)index * width[f->kind];
        return f;
    }
    return NULL;
}

static int parse_tele_value(const struct tele_field *f, const char *s, void *where)
{
    static const long long lo[] = {[K_I32] = INT_MIN, [K_U32] = INT_MIN, [K_U16] = SHRT_MIN};
    static const long long hi[] = {[K_I32] = UINT_MAX, [K_U32] = UINT_MAX, [K_U16] = USHRT_MAX};
    long long v;
    char *end;

    errno = 0;
    switch (f->kind) {
    case K_DBL: {
        double d = strtod(s, &end);

        if (end == s || *end || errno)
            return -1;
        memcpy(where, &d, sizeof d);
        return 0;
    }
    case K_U64: {
        unsigned long long u = s[0] == '-' ? (unsigned long long)strtoll(s, &end, 10) : strtoull(s, &end, 10);

        if (end == s || *end || errno)
            return -1;
        memcpy(where, &u, sizeof u);
        return 0;
    }
    case K_U16:
        if (parse_int(s, lo[f->kind], hi[f->kind], &v))
            return -1;
        *(unsigned short *)where = (unsigned short)v;
        return 0;
    default:
        if (parse_int(s, lo[f->kind], hi[f->kind], &v))
            return -1;
        *(unsigned int *)where = (unsigned int)v;
        return 0;
    }
}

static int parse_logic(const char *s, int *logic, char *msg, size_t cap)
{
    long long v;

    if (parse_int(s, 0, g_ndev - 1, &v))
        return fail(msg, cap, "bad logic id '%s' (0..%d)", s, g_ndev - 1);
    *logic = (int)v;
    return 0;
}

static int cmd_tele(char **args, int nargs, char *msg, size_t cap)
{
    const struct tele_field *f;
    struct fn_ctl *fn;
    void *where;
    int logic, bad;

    if (parse_logic(args[0], &logic, msg, cap))
        return -1;
    pthread_mutex_lock(&g_lock);
    if (!strcmp(args[1], "unsupported") || !strcmp(args[1], "supported")) {
        fn = find_fn(args[2]);
        if (fn)
            fn->unsupported[logic] = args[1][0] == 'u';
        pthread_mutex_unlock(&g_lock);
        return fn ? 0 : fail(msg, cap, "unknown function '%s'", args[2]);
    }
    if (!strcmp(args[1], "serial")) {
        /* The elabel is card-level: the card's first chip keeps it. */
        struct device *first = &g_dev[logic - logic % g_chips];

        bad = strlen(args[2]) >= sizeof first->serial;
        if (!bad)
            strcpy(first->serial, args[2]);
        pthread_mutex_unlock(&g_lock);
        return bad ? fail(msg, cap, "serial too long") : 0;
    }
    f = find_tele(args[1], &g_dev[logic].tele, &where);
    bad = f ? parse_tele_value(f, args[2], where) : 0;
    pthread_mutex_unlock(&g_lock);
    if (!f)
        return fail(msg, cap, "unknown field '%s'", args[1]);
    return bad ? fail(msg, cap, "bad value '%s' for %s", args[2], args[1]) : 0;
}

/* "procs <logic> <pid:bytes,...|->": the chip's processes ("-": none). */
static int cmd_procs(char **args, int nargs, char *msg, size_t cap)
{
    struct dcmi_proc_mem_info procs[DCMI_MAX_PROC_NUM];
    const char *s = args[1];
    int logic, n = 0;

    if (parse_logic(args[0], &logic, msg, cap))
        return -1;
    while (strcmp(args[1], "-") && *s) {
        int pid, used = 0;
        unsigned long bytes;

        if (n == DCMI_MAX_PROC_NUM)
            return fail(msg, cap, "at most %d processes", DCMI_MAX_PROC_NUM);
        if (sscanf(s, "%d:%lu%n", &pid, &bytes, &used) != 2 || (s[used] && s[used] != ','))
            return fail(msg, cap, "bad process list near '%s' (pid:bytes,...)", s);
        procs[n++] = (struct dcmi_proc_mem_info){pid, bytes};
        s += used + (s[used] == ',');
    }
    pthread_mutex_lock(&g_lock);
    memcpy(g_dev[logic].tele.procs, procs, (size_t)n * sizeof procs[0]);
    g_dev[logic].tele.nprocs = n;
    pthread_mutex_unlock(&g_lock);
    return 0;
}

static int cmd_version(char **args, int nargs, char *msg, size_t cap)
{
    if (strlen(args[0]) >= sizeof g_version)
        return fail(msg, cap, "version too long");
    pthread_mutex_lock(&g_lock);
    strcpy(g_version, args[0]);
    pthread_mutex_unlock(&g_lock);
    return 0;
}

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
    {"hang", 2, 3, "hang <function> <seconds> [logic]", cmd_hang},
    {"fail", 2, 3, "fail <function> <rc> [logic]", cmd_fail},
    {"tele", 3, 3, "tele <logic> <field> <value> | tele <logic> (un)supported <function> | tele <logic> serial <text>",
     cmd_tele},
    {"procs", 2, 2, "procs <logic> <pid:bytes,...|->", cmd_procs},
    {"version", 1, 1, "version <text>", cmd_version},
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
    char msg[4096] = "";
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
    char buf[1024], reply[4200];
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
