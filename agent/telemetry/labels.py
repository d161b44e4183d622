"""npu-exporter's per-chip label names and pod label values (a leaf: the fault metrics use it without telemetry)."""

from __future__ import annotations

from agent.model import PodRef

POD_LABELS = ("namespace", "pod_name", "container_name")
CARD_LABELS = ("id", "model_name", "vdie_id", "pcie_bus_info", *POD_LABELS)  # in npu-exporter's order
MULTI_POD = "not_displayed_for_multi_pod"


def pod_labels(pods: tuple[PodRef, ...]) -> tuple[str, str, str]:
    """npu-exporter's pod labels of a chip: its one container, "" when free, a placeholder when shared (one
    series per chip either way, so a chip's series do not multiply with its containers)."""
    if not pods:
        return ("", "", "")
    if len(pods) > 1:
        return (MULTI_POD, MULTI_POD, MULTI_POD)
    return (pods[0].namespace, pods[0].pod, pods[0].container)
