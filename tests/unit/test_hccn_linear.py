"""Every parser of hccn_tool's output is linear in its input: a hostile line costs milliseconds, not the agent.

A parser that backtracks catastrophically holds the GIL for hours, so each input is parsed in a child process
that is given up on after WALL_LIMIT_S; the CPU time it reports must stay under CPU_LIMIT_S (the fixed parsers
take a few milliseconds; the old `key : value` regex took 52 s on 4,000 spaces and grew with their cube).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agent.telemetry.hccn import parse_stat
from testkit import REPO

CPU_LIMIT_S = 2.0
WALL_LIMIT_S = 20.0
PARSERS = ("parse_stat", "parse_optical", "parse_link", "parse_bandwidth", "parse_speed", "parse_link_up",
           "optical_value", "NOT_SUPPORTED.search")
N = 100_000

HOSTILE = {  # name: a Python expression of the text
    "spaces without a colon": f"' ' * {N}",
    "spaces around inner text, then a colon": f"'k' + ' ' * {N // 2} + 'x' + ' ' * {N // 2} + ':v'",
    "spaces inside a value": f"'k: a' + ' ' * {N} + 'b'",
    "keywords then spaces": f"'link status  speed TX RX link up count not' + ' ' * {N}",
    "repeated keywords": f"'link status TX: speed link up count not ' * {N // 40}",
    "a 1 MiB line": "'x' * (1 << 20)",
    "a thousand lines of 1,000 spaces": "(' ' * 1000 + '\\n') * 1000",
}

CHILD = """
import json, sys, time
from agent.telemetry import hccn
text = eval(sys.argv[1])
seconds = {}
for name in sys.argv[2:]:
    print(name, flush=True)  # the last name printed is the parser a child that is given up on was stuck in
    parse = eval("hccn." + name)
    started = time.process_time()
    try:
        parse(text)
    except hccn.Garbled:
        pass
    seconds[name] = time.process_time() - started
print(json.dumps(seconds))
"""


@pytest.mark.parametrize("name", HOSTILE)
def test_every_parser_is_linear_on_hostile_text(name):
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, HOSTILE[name], *PARSERS], cwd=REPO, capture_output=True,
                              text=True, timeout=WALL_LIMIT_S)
    except subprocess.TimeoutExpired as stuck:
        printed = (stuck.stdout or b"").decode().split()
        pytest.fail(f"{printed[-1] if printed else '?'} still parsing {name!r} after {WALL_LIMIT_S} s")
    assert done.returncode == 0, done.stderr
    seconds = json.loads(done.stdout.splitlines()[-1])
    assert set(seconds) == set(PARSERS)
    slow = {parser: round(cpu, 3) for parser, cpu in seconds.items() if cpu >= CPU_LIMIT_S}
    assert not slow, f"CPU seconds on {name!r}: {slow}"


def test_a_counter_too_big_for_a_float_is_garbled_not_an_error():
    assert parse_stat("roce_rx_all_pkt_num:" + "9" * 400 + "\nroce_tx_all_pkt_num:4\n") == {
        "roce_rx_all_pkt_num": None, "roce_tx_all_pkt_num": 4.0}
