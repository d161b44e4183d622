import os, resource, time, json
from tests.fakes.clusterd import ClusterdStandIn
from tests.integration.conftest import phy
from tests.integration.harness import wait_until

def test_emfile(start_agent, kube, tmp_path):
    standin, kubeconfig = kube
    with ClusterdStandIn() as cd:
        root = tmp_path / "profiling"
        agent, fake = start_agent(devices={"poll_interval_seconds": 1},
                                  kubernetes={"enabled": True, "device_info_configmap": True},
                                  clusterd={"enabled": True, "address": f"127.0.0.1:{cd.port}"},
                                  profiling={"root": str(root)},
                                  env={"KUBECONFIG": kubeconfig})
        pid = agent.process.pid
        n = len(os.listdir(f"/proc/{pid}/fd"))
        soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (n, hard))
        fake.occur(2, 0x80E18402)
        (root / "job1" / "0").mkdir(parents=True)
        t = time.monotonic()
        while time.monotonic() - t < 12:
            time.sleep(0.5)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        time.sleep(15)
        print(agent.http("/readyz"))
        print(agent.http("/metrics")[1][-3000:])
        raise AssertionError("".join(agent.raw_stderr)[-25000:])
