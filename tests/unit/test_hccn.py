"""hccn_tool output parsers, on text in the real tool's formats (as npu-exporter reads them)."""

from __future__ import annotations

import pytest

from agent.telemetry.families import BY_NAME
from agent.telemetry.hccn import (OPTICAL_FAMILIES, STAT_FAMILIES, Garbled, optical_value, parse_bandwidth,
                                  parse_link, parse_link_up, parse_optical, parse_speed, parse_stat)


@pytest.mark.parametrize("text, value", [
    ("link status: UP\n", 1.0),
    ("link status: DOWN\n", 0.0),
    ("  Link Status :up", 1.0),
    ("garbage\nlink status: DOWN\n", 0.0),
])
def test_link_status(text, value):
    assert parse_link(text) == value


def test_link_status_missing_or_unknown():
    assert parse_link("") is None
    assert parse_link("device is busy\n") is None
    with pytest.raises(Garbled):
        parse_link("link status: FLAPPING\n")


def test_bandwidth_both_ways_and_partial():
    assert parse_bandwidth("Bandwidth TX: 12.50 MB/sec\nBandwidth RX: 0.00 MB/sec\n") == {"tx": 12.5, "rx": 0.0}
    assert parse_bandwidth("Bandwidth TX:   3.25   MB/sec\n") == {"tx": 3.25}
    assert parse_bandwidth("Bandwidth TX: n/a MB/sec\nBandwidth RX: 1.00 MB/sec\n") == {"rx": 1.0}
    assert parse_bandwidth("nothing here\n") == {}


def test_speed():
    assert parse_speed("Speed: 100000 Mb/s\n") == 100000.0
    assert parse_speed("speed : 200000 Mb/s") == 200000.0
    assert parse_speed("Speed: Unknown!\n") is None
    assert parse_speed("") is None
    with pytest.raises(Garbled):
        parse_speed("Speed: fast Mb/s\n")


def test_link_up_count():
    text = ("[device 3]current time : Tue Nov 24 10:00:00 2026\n[device 3]link up count : 7\n"
            "[device 3]link down count : 6\n")
    assert parse_link_up(text) == 7.0
    assert parse_link_up("[device 3]link down count : 6\n") is None
    with pytest.raises(Garbled):
        parse_link_up("[device 3]link up count : many\n")


def test_stat_keys_values_and_garbled():
    text = "packet statistics:\nmac_tx_mac_pause_num:3\nroce_rx_all_pkt_num : 123456789012\nroce_ecn_db_num:x\n"
    assert parse_stat(text) == {"mac_tx_mac_pause_num": 3.0, "roce_rx_all_pkt_num": 123456789012.0,
                                "roce_ecn_db_num": None}


def test_optical_fields_and_values():
    fields = parse_optical("optical info:\npresent              : present\nTx Power0            : 0.8123 mW\n"
                           "Rx_Power3 : NA\nVcc                  : 3285.20 mV\ntemperature          : 45 C\n"
                           "Vendor Name          : ACME\n")
    assert fields["present"] == "present" and fields["tx_power0"] == "0.8123 mW" and fields["rx_power3"] == "NA"
    assert optical_value(fields["tx_power0"]) == 0.8123
    assert optical_value(fields["vcc"]) == 3285.2
    assert optical_value(fields["temperature"]) == 45.0
    assert optical_value("NA") is None
    assert optical_value("not supported") is None
    with pytest.raises(Garbled):
        optical_value(fields["vendor_name"])


def test_every_family_is_known():
    names = [family for family, _ in (*STAT_FAMILIES, *OPTICAL_FAMILIES)]
    assert len(names) == len(set(names))
    for name in names:
        assert BY_NAME[name].group in ("roce", "optical")
    assert {f.name for f in BY_NAME.values() if f.group == "roce"} == {name for name, _ in STAT_FAMILIES}
    assert ({f.name for f in BY_NAME.values() if f.group == "optical"}
            == {name for name, _ in OPTICAL_FAMILIES} | {"npu_chip_optical_state"})
