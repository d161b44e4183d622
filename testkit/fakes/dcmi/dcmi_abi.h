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

/* ---- telemetry (what npu-exporter reads) ---- */
#define DCMI_ERR_NOT_SUPPORTED   (-8255)
#define HCCS_PORT_NUM 16
#define DCMI_MAX_PROC_NUM 32
#define DCMI_ELABEL_LEN 256

enum dcmi_freq_type {
    DCMI_FREQ_DDR = 1,
    DCMI_FREQ_CTRLCPU = 2,
    DCMI_FREQ_HBM = 6,
    DCMI_FREQ_AICORE_CURRENT_ = 7,
    DCMI_FREQ_AICORE_MAX = 9,
    DCMI_FREQ_VECTORCORE_CURRENT = 12
};

enum dcmi_rdfx_detect_result {
    DCMI_RDFX_DETECT_OK = 0,
    DCMI_RDFX_DETECT_SOCK_FAIL = 1,
    DCMI_RDFX_DETECT_RECV_TIMEOUT = 2,
    DCMI_RDFX_DETECT_UNREACH = 3,
    DCMI_RDFX_DETECT_TIME_EXCEEDED = 4,
    DCMI_RDFX_DETECT_FAULT = 5,
    DCMI_RDFX_DETECT_INIT = 6
};

enum dcmi_device_type {
    DCMI_DEVICE_TYPE_DDR = 0,
    DCMI_DEVICE_TYPE_SRAM = 1,
    DCMI_DEVICE_TYPE_HBM = 2,
    DCMI_DEVICE_TYPE_NPU = 3,
    DCMI_DEVICE_TYPE_NONE = 0xff
};

enum dcmi_main_cmd {
    DCMI_MAIN_CMD_HCCS = 16,
    DCMI_MAIN_CMD_SIO = 56
};
#define DCMI_HCCS_CMD_GET_STATISTIC_INFO 3
#define DCMI_HCCS_CMD_GET_STATISTIC_INFO_U64 5
#define DCMI_SIO_CMD_GET_CRC_ERR_STATISTIC 0

struct dcmi_hbm_info {
    unsigned long long memory_size;  /* MB */
    unsigned int freq;               /* MHz */
    unsigned long long memory_usage; /* MB */
    int temp;                        /* degrees C */
    unsigned int bandwith_util_rate; /* %, the header's spelling */
};

/* mind-cluster's header has nine members; the driver writes only the first seven. */
struct dcmi_ecc_info {
    int enable_flag;
    unsigned int single_bit_error_cnt;
    unsigned int double_bit_error_cnt;
    unsigned int total_single_bit_error_cnt;
    unsigned int total_double_bit_error_cnt;
    unsigned int single_bit_isolated_pages_cnt;
    unsigned int double_bit_isolated_pages_cnt;
    unsigned int single_bit_next_isolated_pages_cnt;
    unsigned int double_bit_next_isolated_pages_cnt;
};
#define DCMI_ECC_WRITTEN_MEMBERS 7

struct dcmi_multi_utilization_info {
    unsigned int aic_util;    /* cube */
    unsigned int aiv_util;    /* vector */
    unsigned int aicore_util;
    unsigned int npu_util;    /* overall */
    unsigned int reserved[8];
};

#define PCIE_BW_VALUES 3 /* {min, max, avg} */
struct dcmi_pcie_link_bandwidth_info {
    int profiling_time; /* input, ms */
    unsigned int tx_p_bw[PCIE_BW_VALUES];
    unsigned int tx_np_bw[PCIE_BW_VALUES];
    unsigned int tx_cpl_bw[PCIE_BW_VALUES];
    unsigned int tx_np_lantency[PCIE_BW_VALUES];
    unsigned int rx_p_bw[PCIE_BW_VALUES];
    unsigned int rx_np_bw[PCIE_BW_VALUES];
    unsigned int rx_cpl_bw[PCIE_BW_VALUES];
};

struct dcmi_hccs_statistic_info {
    unsigned int tx_cnt[HCCS_PORT_NUM];
    unsigned int rx_cnt[HCCS_PORT_NUM];
    unsigned int crc_err_cnt[HCCS_PORT_NUM];
    unsigned int retry_cnt[HCCS_PORT_NUM];
    unsigned int reserved_field_cnt[64];
};

struct dcmi_hccs_statistic_info_u64 {
    unsigned long long tx_cnt[HCCS_PORT_NUM];
    unsigned long long rx_cnt[HCCS_PORT_NUM];
    unsigned long long crc_err_cnt[HCCS_PORT_NUM];
    unsigned long long retry_cnt[HCCS_PORT_NUM];
    unsigned long long reserved[64];
};

struct dcmi_hccs_bandwidth_info {
    int profiling_time; /* input, ms */
    double total_txbw;  /* GB/s */
    double total_rxbw;
    double tx_bandwidth[HCCS_PORT_NUM];
    double rx_bandwidth[HCCS_PORT_NUM];
};

struct dcmi_sio_crc_err_statistic_info {
    unsigned short tx_error_count;
    unsigned short rx_error_count;
    unsigned char reserved[8];
};

struct dcmi_proc_mem_info {
    int proc_id;                   /* host PID */
    unsigned long proc_mem_usage;  /* bytes */
};

struct dcmi_board_info {
    unsigned int board_id; /* the product's board: tells the A3 (910_93) boards from the A2 ones */
    unsigned int pcb_id;
    unsigned int bom_id;
    unsigned int slot_id; /* PCIe slot of the chip */
};

struct dcmi_elabel_info {
    char product_name[DCMI_ELABEL_LEN];
    char model[DCMI_ELABEL_LEN];
    char manufacturer[DCMI_ELABEL_LEN];
    char manufacturer_date[DCMI_ELABEL_LEN];
    char serial_number[DCMI_ELABEL_LEN];
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

int dcmi_get_device_temperature(int card_id, int device_id, int *temperature);
int dcmi_get_device_power_info(int card_id, int device_id, int *power);
int dcmi_get_device_voltage(int card_id, int device_id, unsigned int *voltage);
int dcmi_get_device_frequency(int card_id, int device_id, enum dcmi_freq_type input_type,
                              unsigned int *frequency);
int dcmi_get_device_network_health(int card_id, int device_id,
                                   enum dcmi_rdfx_detect_result *result);
int dcmi_get_device_utilization_rate(int card_id, int device_id, int input_type,
                                     unsigned int *utilization_rate);
int dcmi_get_device_multi_utilization_rate(int card_id, int device_id,
                                           struct dcmi_multi_utilization_info *util_info);
int dcmi_get_device_multi_utilization_rate_period(int card_id, int device_id,
                                                  struct dcmi_multi_utilization_info *util_info,
                                                  int period);
int dcmi_get_device_hbm_info(int card_id, int device_id, struct dcmi_hbm_info *hbm_info);
int dcmi_get_device_ecc_info(int card_id, int device_id, enum dcmi_device_type input_type,
                             struct dcmi_ecc_info *device_ecc_info);
int dcmi_get_device_info(int card_id, int device_id, enum dcmi_main_cmd main_cmd,
                         unsigned int sub_cmd, void *buf, unsigned int *size);
int dcmi_get_hccs_link_bandwidth_info(int card_id, int device_id,
                                      struct dcmi_hccs_bandwidth_info *hccs_bandwidth_info);
int dcmi_get_pcie_link_bandwidth_info(int card_id, int device_id,
                                      struct dcmi_pcie_link_bandwidth_info *pcie_link_bandwidth_info);
int dcmi_get_device_resource_info(int card_id, int device_id, struct dcmi_proc_mem_info *proc_info,
                                  int *proc_num);
int dcmi_get_card_elabel_v2(int card_id, struct dcmi_elabel_info *elabel_info);
int dcmi_get_mainboard_id(int card_id, int device_id, unsigned int *mainboard_id);
int dcmi_get_device_board_info(int card_id, int device_id, struct dcmi_board_info *board_info);
int dcmi_get_dcmi_version(char *dcmi_ver, int buf_size);

/* Test-only extra: JSON with sizeof/offsetof of every struct above. */
const char *fake_dcmi_layout(void);

#endif /* FAKE_DCMI_ABI_H */
