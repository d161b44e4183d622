"""`promtool check metrics` on a scrape of the running agent (simulated NPUs, disk guard and step
metrics on): Prometheus' own linter finds nothing to say."""

from __future__ import annotations

import subprocess

from testkit.agent import AgentProcess
from testkit.wait import wait_until
from tests.unit.test_promtool import PROMTOOL, needs_promtool


@needs_promtool
def test_the_scrape_passes_promtool_check_metrics(tmp_path):
    agent = AgentProcess(tmp_path, {"devices": {"backend": "simulated"},
                                    "profiling": {"disk_limit_mb": 10, "metrics": True}})

    def scrape_with_npus() -> str | None:
        status, text = agent.http("/metrics")
        return text if status == 200 and "npu_chip_info_health_status{" in text else None

    agent.start()
    try:
        text = wait_until(scrape_with_npus, 20, "a scrape with the NPUs")
    finally:
        agent.stop()
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout + done.stderr
