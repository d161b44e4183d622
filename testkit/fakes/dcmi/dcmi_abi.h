/*
 * Minimal DCMI ABI used by the fake libdcmi.so.
 *
 * Written from the facts of Huawei's public dcmi_interface_api.h: only the
 * subset of structs, constants and functions the agent uses.  Layouts must
 * match the real header byte for byte, because the agent's ctypes loader
 * mirrors them; fake_dcmi.c asserts the sizes at compile time.
 */
#ifndef FAKE_DCMI_ABI_H
#define FAKE_DCMI_ABI_H

/* Return codes. */
#define DCMI_OK                  0
#define DCMI_ERR_INVALID_PARAM   (-8001) /* bad card/device id, NULL pointer */
#define DCMI_ERR_NOT_READY       (-8012) /* device not ready (dropped card) */
#define FAKE_DCMI_ERR_NOT_INIT   (-8020) /* called before dcmi_init (fake only) */

#define DCMI_MAX_EVENT_NAME_LENGTH 256
#define DCMI_MAX_EVENT_DATA_LENGTH 32
#define DCMI_MAX_EVENT_RESV_LENGTH 32
#define MAX_CHIP_NAME_LEN 32

/* dcmi_event_filter.filter_flag bits; only the event id filter is honoured. */
#define DCMI_EVENT_FILTER_FLAG_EVENT_ID (1ULL << 0)

struct dcmi_chip_info {
    unsigned char chip_type[MAX_CHIP_NAME_LEN];
    unsigned char chip_name[MAX_CHIP_NAME_LEN];
    unsigned char chip_ver[MAX_CHIP_NAME_LEN];
    unsigned int aicore_cnt;
};

enum dcmi_die_type {
    NDIE = 0,
    VDIE = 1
};

#define DIE_ID_NUM 5
struct dcmi_die_id {
    unsigned int soc_die[DIE_ID_NUM];
};

struct dcmi_pcie_info_all {
    unsigned int venderid;
    unsigned int subvenderid;
    unsigned int deviceid;
    unsigned int subdeviceid;
    int domain;
    unsigned int bdf_busid;
    unsigned int bdf_deviceid;
    unsigned int bdf_funcid;
    unsigned char reserve[32];
};

struct dcmi_event_filter {
    unsigned long long filter_flag;
    unsigned int event_id;
    unsigned char severity;
    unsigned char node_type;
    unsigned char resv[DCMI_MAX_EVENT_RESV_LENGTH];
};

struct dcmi_dms_fault_event {
    unsigned int event_id;
    unsigned short deviceid;
    unsigned char node_type;
    unsigned char node_id;
    unsigned char sub_node_type;
    unsigned char sub_node_id;
    unsigned char severity;
    unsigned char assertion;         /* 0 recovery, 1 occur, 2 one-off */
    int event_serial_num;
    int notify_serial_num;
    unsigned long long alarm_raised_time;
    char event_name[DCMI_MAX_EVENT_NAME_LENGTH];
    char additional_info[DCMI_MAX_EVENT_DATA_LENGTH];
    unsigned char os_id;
    unsigned char resv_1[1];
    unsigned short node_type_ex;
    unsigned short sub_node_type_ex;
    unsigned char resv_2[2];
    unsigned char resv[24];
};

enum dcmi_event_type {
    DCMI_DMS_FAULT_EVENT = 0,
    DCMI_EVENT_TYPE_MAX
};

struct dcmi_event {
    enum dcmi_event_type type;
    union {
        struct dcmi_dms_fault_event dms_event;
    } event_t;
};

typedef void (*dcmi_fault_event_callback)(struct dcmi_event *event);

int dcmi_init(void);
int dcmi_get_card_list(int *card_num, int *card_list, int list_len);
int dcmi_get_device_num_in_card(int card_id, int *device_num);
int dcmi_get_device_logic_id(int *device_logic_id, int card_id, int device_id);
int dcmi_get_device_phyid_from_logicid(unsigned int logicid, unsigned int *phyid);
int dcmi_get_device_logicid_from_phyid(unsigned int phyid, unsigned int *logicid);
int dcmi_get_card_id_device_id_from_logicid(int *card_id, int *device_id,
                                            unsigned int device_logic_id);
int dcmi_get_device_chip_info(int card_id, int device_id,
                              struct dcmi_chip_info *chip_info);
int dcmi_get_device_die_v2(int card_id, int device_id, enum dcmi_die_type input_type,
                           struct dcmi_die_id *die_id);
int dcmi_get_device_pcie_info_v2(int card_id, int device_id,
                                 struct dcmi_pcie_info_all *pcie_info);
int dcmi_get_device_health(int card_id, int device_id, unsigned int *health);
int dcmi_get_device_errorcode_v2(int card_id, int device_id, int *error_count,
                                 unsigned int *error_code_list,
                                 unsigned int list_len);
int dcmi_subscribe_fault_event(int card_id, int device_id,
                               struct dcmi_event_filter filter,
                               dcmi_fault_event_callback handler);

/* Test-only extra: JSON with sizeof/offsetof of every struct above. */
const char *fake_dcmi_layout(void);

#endif /* FAKE_DCMI_ABI_H */
