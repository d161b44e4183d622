"""A fake hccn_tool (a POSIX sh script) that answers from files a test writes, in the real tool's formats.

    fake = FakeHccn(tmp_path, chips=2)          # installs <tmp_path>/hccn_tool, writes healthy defaults
    HccnTool(str(fake.path), timeout_s=2.0)
    fake.set(0, "link", link_text(False))       # chip 0's link is down
    fake.set_stat(1, roce_rx_all_pkt_num=7)     # one counter of chip 1
    fake.fail(0, "speed", rc=1)                 # non-zero exit
    fake.hang(1, "optical", 30)                 # blocks 30 s before answering
    fake.leave_behind(0, "stat", 1000)          # each run leaves a `sleep 1000` behind in its process group

Layout the script reads: <dir>/<phy>/<command> (stdout), <command>.rc (exit code), <command>.sleep (seconds),
<command>.orphan (seconds of a process left behind, "stdout" if it holds stdout open);
<dir> is <root>/chips, or $FAKE_HCCN_DIR when whoever runs the script passes it (HccnTool passes only PATH and
LD_LIBRARY_PATH). A chip without a directory gets exit code 1.
"""

from __future__ import annotations

import shutil
from pathlib import Path

SCRIPT = Path(__file__).with_name("hccn_tool")
COMMANDS = ("link", "bandwidth", "speed", "link_stat", "stat", "optical")
STAT_KEYS = (
    "mac_tx_mac_pause_num", "mac_rx_mac_pause_num", "mac_tx_pfc_pkt_num", "mac_rx_pfc_pkt_num",
    "mac_tx_bad_pkt_num", "mac_rx_bad_pkt_num", "mac_tx_bad_oct_num", "mac_rx_bad_oct_num", "mac_rx_fcs_err_pkt_num",
    "roce_rx_all_pkt_num", "roce_tx_all_pkt_num", "roce_rx_err_pkt_num", "roce_tx_err_pkt_num",
    "roce_rx_cnp_pkt_num", "roce_tx_cnp_pkt_num", "roce_new_pkt_rty_num", "roce_unexpected_ack_num",
    "roce_out_of_order_num", "roce_verification_err_num", "roce_qp_status_err_num", "roce_ecn_db_num",
)
OPTICAL_DEFAULTS = {
    "present": "present",
    **{f"Tx Power{n}": "0.8123 mW" for n in range(4)},
    **{f"Rx Power{n}": "0.7456 mW" for n in range(4)},
    "Vcc": "3285.20 mV",
    "temperature": "45 C",
}


def link_text(up: bool) -> str:
    return f"link status: {'UP' if up else 'DOWN'}\n"


def bandwidth_text(tx: float, rx: float) -> str:
    return f"Bandwidth TX: {tx:.2f} MB/sec\nBandwidth RX: {rx:.2f} MB/sec\n"


def speed_text(mbps: int | str) -> str:
    return f"Speed: {mbps} Mb/s\n"


def link_stat_text(phy: int, up_count: int, down_count: int = 0) -> str:
    return (f"[device {phy}]current time : Tue Nov 24 10:00:00 2026\n"
            f"[device {phy}]link up count : {up_count}\n"
            f"[device {phy}]link down count : {down_count}\n")


def stat_text(counters: dict[str, int | str]) -> str:
    return "packet statistics:\n" + "".join(f"{key}:{value}\n" for key, value in counters.items())


def optical_text(fields: dict[str, str]) -> str:
    return "optical info:\n" + "".join(f"{key:<21}: {value}\n" for key, value in fields.items())


class FakeHccn:
    def __init__(self, root: Path, chips: int):
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / "hccn_tool"
        shutil.copyfile(SCRIPT, self.path)
        self.path.chmod(0o755)
        self.dir = root / "chips"
        self._stat: dict[int, dict[str, int | str]] = {}
        self._optical: dict[int, dict[str, str]] = {}
        for phy in range(chips):
            self.defaults(phy)

    def defaults(self, phy: int) -> None:
        """A healthy 200G port: link up, some traffic, zero error counters, a present module."""
        (self.dir / str(phy)).mkdir(parents=True, exist_ok=True)
        for command in COMMANDS:
            self.clear(phy, command)
        self.set(phy, "link", link_text(True))
        self.set(phy, "bandwidth", bandwidth_text(1.5, 2.25))
        self.set(phy, "speed", speed_text(200000))
        self.set(phy, "link_stat", link_stat_text(phy, 1))
        self._stat[phy] = dict.fromkeys(STAT_KEYS, 0)
        self._optical[phy] = dict(OPTICAL_DEFAULTS)
        self.set_stat(phy)
        self.set_optical(phy)

    def set(self, phy: int, command: str, stdout: str) -> None:
        self._file(phy, command).write_text(stdout)

    def set_stat(self, phy: int, **counters: int | str) -> None:
        self._stat[phy].update(counters)
        self.set(phy, "stat", stat_text(self._stat[phy]))

    def set_optical(self, phy: int, **fields: str) -> None:
        """Fields by their printed name with `_` for spaces, e.g. Tx_Power0="NA"."""
        self._optical[phy].update({key.replace("_", " "): value for key, value in fields.items()})
        self.set(phy, "optical", optical_text(self._optical[phy]))

    def fail(self, phy: int, command: str, rc: int = 1, stdout: str | None = None) -> None:
        """Exit with rc, printing stdout (default: the output as it is)."""
        if stdout is not None:
            self.set(phy, command, stdout)
        self._file(phy, command, ".rc").write_text(f"{rc}\n")

    def hang(self, phy: int, command: str, seconds: float) -> None:
        self._file(phy, command, ".sleep").write_text(f"{seconds}\n")

    def hung_pid(self, phy: int, command: str) -> int | None:
        """The pid of the run that is (or was) sleeping in hang()."""
        path = self._file(phy, command, ".pid")
        text = path.read_text().strip() if path.exists() else ""
        return int(text) if text else None

    def leave_behind(self, phy: int, command: str, seconds: float, holds_stdout: bool = False) -> None:
        """Each run starts `sleep seconds` in the background and exits without waiting for it, as a tool that
        forks a helper does: a grandchild in the run's process group, holding the run's stdout open or not."""
        self._file(phy, command, ".orphan").write_text(f"{seconds}{' stdout' if holds_stdout else ''}\n")

    def left_behind(self, phy: int, command: str) -> list[tuple[int, int]]:
        """(process group, pid) of every process a run left behind so far."""
        path = self._file(phy, command, ".orphans")
        lines = path.read_text().splitlines() if path.exists() else []
        return [(int(group), int(pid)) for group, pid in (line.split() for line in lines if line.strip())]

    def clear(self, phy: int, command: str) -> None:
        """Undo fail(), hang() and leave_behind() (the output stays, and so does the record of left_behind())."""
        for suffix in (".rc", ".sleep", ".pid", ".orphan"):
            self._file(phy, command, suffix).unlink(missing_ok=True)

    def _file(self, phy: int, command: str, suffix: str = "") -> Path:
        return self.dir / str(phy) / f"{command}{suffix}"
