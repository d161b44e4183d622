"""Device plugin ids → physical NPU ids, and a PodResources answer → who holds which NPU."""

from agent._proto import podresources_pb2 as pb
from agent.kube.podresources import attribute, phy_id_of
from agent.model import PodRef


def test_device_ids_of_every_ascend_form():
    assert phy_id_of("huawei.com/Ascend910", "Ascend910-3") == 3
    assert phy_id_of("huawei.com/Ascend310P", "Ascend310P-12") == 12
    assert phy_id_of("huawei.com/npu", "7") == 7
    assert phy_id_of("huawei.com/npu", "npu-5") == 5
    assert phy_id_of("huawei.com/Ascend910-2c", "Ascend910-2c-100-4") == 4  # a virtual NPU on NPU 4
    assert phy_id_of("nvidia.com/gpu", "3") is None
    assert phy_id_of("huawei.com/Ascend910", "GPU-8f2c") is None
    assert phy_id_of("huawei.com/Ascend910", "Ascend910-") is None


def test_attribution_by_container_and_unknown_forms_reported():
    response = pb.ListPodResourcesResponse(pod_resources=[
        pb.PodResources(name="train-0", namespace="team-a", containers=[
            pb.ContainerResources(name="main", devices=[
                pb.ContainerDevices(resource_name="huawei.com/Ascend910", device_ids=["Ascend910-0", "Ascend910-1"]),
                pb.ContainerDevices(resource_name="cpu.example/thing", device_ids=["x"])]),
            pb.ContainerResources(name="sidecar")]),
        pb.PodResources(name="infer", namespace="team-b", containers=[
            pb.ContainerResources(name="srv", devices=[
                pb.ContainerDevices(resource_name="huawei.com/Ascend910", device_ids=["Ascend910-2", "weird!"])])]),
    ])
    holders, unknown = attribute(response)
    assert holders == {0: (PodRef("team-a", "train-0", "main"),), 1: (PodRef("team-a", "train-0", "main"),),
                       2: (PodRef("team-b", "infer", "srv"),)}
    assert unknown == ["huawei.com/Ascend910=weird!"]
