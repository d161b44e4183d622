"""docs/ describes the code as it is: the tables of configuration keys and metric families are made
from the code by tests/support/gendocs.py (`python -m tests.support.gendocs` rewrites them)."""

from __future__ import annotations

from testkit import REPO
from tests.support import genconfig, gendocs


def test_the_tables_of_the_docs_are_up_to_date():
    stale = [str(path.relative_to(REPO)) for path, text in gendocs.generated().items()
             if path.read_text(encoding="utf-8") != text]
    assert stale == [], "these differ from the code: run python -m tests.support.gendocs"


def test_every_configuration_key_has_a_meaning():
    written = genconfig.meanings(genconfig.CONFIGURATION.read_text(encoding="utf-8"))
    assert [key for key, _, _ in genconfig.config_keys() if not written.get(key)] == []


def test_the_environment_the_configuration_reads_is_documented():
    variables = genconfig.environment_variables()
    assert {"NODE_NAME", "MINDX_SERVER_IP"} <= set(variables)
    text = genconfig.CONFIGURATION.read_text(encoding="utf-8")
    assert [v for v in variables if f"| `{v}` |" not in text] == []


def test_the_metrics_table_covers_every_collector():
    """Each collector's families are found, those that need a sink included."""
    families = gendocs.metric_families()
    for name in ("npu_chip_info_health_status", "npu_agent_clusterd_public_faults", "npu_agent_outbox_pending",
                 "npu_agent_profiling_disk_usage_bytes", "training_step_duration_seconds",
                 "npu_agent_datatrace_switch_files", "npu_agent_taskd_proxy_messages_total"):
        assert name in families, name
    assert families["npu_agent_device_fault"][1] == (
        "node", "id", "fault_code", "fault_level", "namespace", "pod_name", "container_name")


def test_every_wire_definition_is_described():
    text = (REPO / "docs" / "interfaces.md").read_text(encoding="utf-8")
    assert [p.name for p in sorted((REPO / "proto").glob("*.proto")) if f"proto/{p.name}" not in text] == []
