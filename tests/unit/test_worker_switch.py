"""agent.worker.switch: the profilingSwitch file with TaskD's rules (taskd.md §2.2)."""

from __future__ import annotations

import json

import pytest

from agent.worker.switch import MAX_BYTES, parse_switch

ALL = ("CommunicationOperator", "Step", "SaveCheckpoint", "FP", "DataLoader")


def doc(**values) -> bytes:
    return json.dumps(values).encode()


def test_doc_example():
    data = b'{"CommunicationOperator":"off","Step":"on","SaveCheckpoint":"on","FP":"on","DataLoader":"on"}'
    assert parse_switch(data) == (True, False)


def test_all_off():
    assert parse_switch(doc(**dict.fromkeys(ALL, "off"))) == (False, False)


def test_all_on():
    assert parse_switch(doc(**dict.fromkeys(ALL, "on"))) == (True, True)


@pytest.mark.parametrize("key", ALL)
def test_any_one_not_off_turns_the_default_domain_on(key):
    values = dict.fromkeys(ALL, "off")
    values[key] = "on"
    assert parse_switch(doc(**values)) == (True, key == "CommunicationOperator")


@pytest.mark.parametrize("key", ALL)
def test_a_missing_key_counts_as_not_off(key):
    values = dict.fromkeys(ALL, "off")
    del values[key]
    assert parse_switch(doc(**values)) == (True, False)


def test_comm_alone_enables_default_too():
    assert parse_switch(b'{"CommunicationOperator":"on"}') == (True, True)


def test_empty_object_is_default_on_comm_off():
    assert parse_switch(b"{}") == (True, False)


@pytest.mark.parametrize("value", ["On", "ON", "OFF", "Off", " off", "off ", "", "1", "true", "enable"])
def test_values_compare_exactly(value):
    values = dict.fromkeys(ALL, "off")
    values["Step"] = value
    assert parse_switch(doc(**values)) == (True, False)
    comm = dict.fromkeys(ALL, "off")
    comm["CommunicationOperator"] = value
    assert parse_switch(doc(**comm)) == (True, False)  # only exactly "on" turns comm on


@pytest.mark.parametrize("key", ["communicationoperator", "COMMUNICATIONOPERATOR", "CommunicationOPERATOR"])
def test_keys_are_case_insensitive(key):
    data = json.dumps({key: "on", "step": "off", "SAVECHECKPOINT": "off", "fp": "off", "dataLoader": "off"})
    assert parse_switch(data.encode()) == (True, True)
    data = json.dumps({key: "off", "step": "off", "SAVECHECKPOINT": "off", "fp": "off", "dataLoader": "off"})
    assert parse_switch(data.encode()) == (False, False)


def test_go_unicode_folding_of_keys():
    # Go folds U+017F (long s) onto S and U+212A (Kelvin sign) onto K.
    values = dict.fromkeys(ALL, "off")
    del values["Step"], values["SaveCheckpoint"]
    values["\u017ftep"] = "off"
    values["SaveChec\u212apoint"] = "off"
    assert parse_switch(json.dumps(values).encode()) == (False, False)
    values["\u017ftep"] = "on"
    assert parse_switch(json.dumps(values).encode()) == (True, False)


def test_other_non_ascii_keys_do_not_match():
    values = dict.fromkeys(ALL, "off")
    del values["Step"]
    values["St\u00e9p"] = "off"  # not Step
    assert parse_switch(json.dumps(values).encode()) == (True, False)


def test_a_later_duplicate_key_wins():
    data = b'{"Step":"on","step":"off","SaveCheckpoint":"off","FP":"off","DataLoader":"off","CommunicationOperator":"off"}'
    assert parse_switch(data) == (False, False)
    data = b'{"Step":"off","STEP":"on","SaveCheckpoint":"off","FP":"off","DataLoader":"off","CommunicationOperator":"off"}'
    assert parse_switch(data) == (True, False)


def test_unknown_keys_are_ignored_whatever_their_type():
    values = dict.fromkeys(ALL, "off")
    values.update(Extra=[1, {"a": None}], Other=3.5, Flag=True)
    assert parse_switch(json.dumps(values).encode()) == (False, False)


def test_null_values_leave_the_field_unset():
    values = dict.fromkeys(ALL, "off")
    values["FP"] = None
    assert parse_switch(json.dumps(values).encode()) == (True, False)
    # null after a value keeps the value
    assert parse_switch(b'{"CommunicationOperator":"on","CommunicationOperator":null}') == (True, True)


def test_null_document_is_not_an_error():
    assert parse_switch(b"null") == (True, False)
    assert parse_switch(b"  null \n") == (True, False)


@pytest.mark.parametrize("data", [
    b"", b"   ", b"{", b'{"Step":"on"', b'{"Step":"on"} x', b"[]", b'["on"]', b'"on"', b"1", b"true",
    b'{"Step":1}', b'{"Step":true}', b'{"Step":["on"]}', b'{"Step":{"v":"on"}}', b'{"CommunicationOperator":0}',
    b'{"Step":"on",}', b"{'Step':'on'}", b'{"Step":NaN}', b'{"x":NaN}', b'{"x":Infinity}',
    b'{"Step":"o\x01n"}',  # a raw control character inside a string
    b"\xef\xbb\xbf{}",  # a byte-order mark
    b"\xff{}",
])
def test_invalid_documents(data):
    assert parse_switch(data) is None


def test_invalid_utf8_inside_a_string_is_not_an_error():
    assert parse_switch(b'{"Step":"\xff","SaveCheckpoint":"off","FP":"off","DataLoader":"off",'
                        b'"CommunicationOperator":"off"}') == (True, False)


def test_whitespace_around_is_fine():
    assert parse_switch(b'\n\t {"CommunicationOperator" : "on"}\r\n ') == (True, True)


def test_only_the_first_mib_is_read():
    body = b'{"CommunicationOperator":"on"}'
    assert parse_switch(body + b" " * (MAX_BYTES - len(body))) == (True, True)
    big = b'{"CommunicationOperator":"on","pad":"' + b"x" * MAX_BYTES + b'"}'
    assert parse_switch(big) is None  # cut at 1 MiB: no longer JSON
