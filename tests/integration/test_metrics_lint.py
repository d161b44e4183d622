"""`promtool check metrics` on a scrape of the running agent (simulated NPUs, telemetry, disk guard and step
metrics on, two ranks training): Prometheus' own linter finds nothing to say but npu-exporter's own
camelCase label names, which the agent keeps so that existing queries go on working."""

from __future__ import annotations

import subprocess
import time

from agent.demo.job import DemoJob
from testkit.agent import AgentProcess
from testkit.wait import wait_until
from tests.unit.test_promtool import PROMTOOL, needs_promtool

# npu-exporter's label names (exporterVersion, driverVersion, npuID, containerID, containerName) are camelCase.
NPU_EXPORTER_CAMEL_CASE = {"node_base_info", "npu_exporter_version_info", "npu_container_info"}


@needs_promtool
def test_the_scrape_passes_promtool_check_metrics(tmp_path):
    agent = AgentProcess(tmp_path, {"devices": {"backend": "simulated"},
                                    "profiling": {"disk_limit_mb": 10, "metrics": True},
                                    "telemetry": {"enabled": True}})
    # Two ranks of a job, so that the step families have series (a summary per rank, histograms per job).
    job = DemoJob(tmp_path / "profiling", ranks=2, stages=1, step_s=0.5, started=time.time())
    job.prepare()

    def scrape_with_npus_and_steps() -> str | None:
        for rank, text in enumerate(job.lines_until(job._step_start + 0.75)):  # one more step
            job.append(rank, "1800000000", text)
        status, text = agent.http("/metrics")
        every = ("npu_chip_info_health_status{", "npu_chip_info_hbm_used_memory{", "node_base_info{",
                 "training_step_duration_seconds_sum{", "training_node_step_duration_seconds_bucket{",
                 "training_node_phase_duration_seconds_bucket{")
        return text if status == 200 and all(name in text for name in every) else None

    agent.start()
    try:
        text = wait_until(scrape_with_npus_and_steps, 20, "a scrape with the NPUs and the steps", interval=0.2)
    finally:
        agent.stop()
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    said = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    camel = " label names should be written in 'snake_case' not 'camelCase'"
    assert [line for line in said if line.removesuffix(camel) not in NPU_EXPORTER_CAMEL_CASE] == [], said
