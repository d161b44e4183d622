"""Smoke test of one built image (.ci/image runs it once per architecture).

The pod is the Helm chart's own: the DaemonSet that `helm template` renders is started with podman
the way the kubelet starts it - its volumes (ConfigMaps written out, hostPaths under a private
host root, emptyDirs), the container's securityContext, env, args and resource limits, the init
container first, probes on their schedule and in the pod's network namespace (nsenter), SIGTERM
with the pod's grace period. A pod field this runner does not know is an error, never ignored.

Checks: the init container hands state_dir to the agent's uid; the agent runs as that uid with no
capabilities on a read-only root; the readiness and liveness probes pass; /metrics serves the
simulated NPUs' series; the image's HEALTHCHECK passes; SIGTERM ends it with exit code 0 within the
grace period. Then, as a training container: the native MSPTI collector writes TaskD records with
the fake libmspti.so built for the image's architecture; and the wheel holds the extension compiled
for it. Prints what it measured; exits non-zero with the reason on the first failure.

    image-smoke.py run --image REF --arch amd64|arm64 --builder-image REF --wheel-dir DIR --work DIR
                       --helm PATH --values FILE [--set KEY=VALUE]...
    image-smoke.py probe JSON   (internal: one probe, run inside the pod's network namespace)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from testkit.fakes.cc import FLAGS  # noqa: E402 - the flags the tests build the fake with

ELF_MACHINE = {"amd64": 62, "arm64": 183}  # e_machine: EM_X86_64, EM_AARCH64
NODE = "smoke-node"
MSPTI_RECORDS = 500


class Failed(Exception):
    pass


def log(msg: str) -> None:
    print(f"image-smoke: {msg}", flush=True)


def podman(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise Failed(f"podman {shlex.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
    return done


def elf_machine(data: bytes) -> int:
    if data[:4] != b"\x7fELF":
        raise Failed("not an ELF file")
    return int.from_bytes(data[18:20], "little")


# -- the chart's pod, run by podman ---------------------------------------------------------------

# The pod and container fields this runner models, or that change nothing here (scheduling, the
# service account when no token is mounted, the DNS policy: the smoke pod resolves no name); any
# other one fails the run.
POD_FIELDS = {"serviceAccountName", "automountServiceAccountToken", "priorityClassName", "terminationGracePeriodSeconds",
              "hostNetwork", "hostPID", "dnsPolicy", "securityContext", "imagePullSecrets", "nodeSelector",
              "tolerations", "affinity", "initContainers", "containers", "volumes"}
CONTAINER_FIELDS = {"name", "image", "imagePullPolicy", "command", "args", "env", "ports", "livenessProbe",
                    "readinessProbe", "resources", "securityContext", "volumeMounts"}


class Pod:
    def __init__(self, docs: list[dict], work: Path, image: str):
        self.work = work
        self.image = image
        [ds] = [d for d in docs if d and d.get("kind") == "DaemonSet"]
        self.name = ds["metadata"]["name"]
        self.spec = ds["spec"]["template"]["spec"]
        if set(self.spec) - POD_FIELDS:
            raise self.unsupported(f"pod fields {sorted(set(self.spec) - POD_FIELDS)}")
        for c in self.spec.get("initContainers", []) + self.spec["containers"]:
            if set(c) - CONTAINER_FIELDS:
                raise self.unsupported(f"container {c['name']} fields {sorted(set(c) - CONTAINER_FIELDS)}")
        self.config_maps = {d["metadata"]["name"]: d for d in docs if d and d.get("kind") == "ConfigMap"}
        self.host_root = work / "host"
        self.mounts = self._volumes()
        self.pid = 0

    def unsupported(self, what: str) -> Failed:
        return Failed(f"the chart's pod uses {what}, which this runner does not model")

    def _volumes(self) -> dict[str, Path]:
        out = {}
        for vol in self.spec.get("volumes", []):
            name = vol["name"]
            if "configMap" in vol:
                cm = self.config_maps[vol["configMap"]["name"]]
                where = self.work / "configmaps" / name
                where.mkdir(parents=True)
                for key, value in (cm.get("data") or {}).items():
                    (where / key).write_text(value)
                out[name] = where
            elif "hostPath" in vol:
                where = self.host_root / vol["hostPath"]["path"].lstrip("/")
                kind = vol["hostPath"].get("type") or ""
                if kind == "DirectoryOrCreate":
                    where.mkdir(parents=True, exist_ok=True)  # the kubelet: 0755, root's
                elif kind == "Directory" and not where.is_dir():
                    raise Failed(f"hostPath {vol['hostPath']['path']} (type Directory) does not exist on the node")
                out[name] = where
            elif "emptyDir" in vol:
                where = self.work / "emptydirs" / name
                where.mkdir(parents=True)
                where.chmod(0o777)  # as the kubelet makes them
                out[name] = where
            else:
                raise self.unsupported(f"volume {vol}")
        return out

    def run_args(self, c: dict, *, detach: bool) -> list[str]:
        args = ["run", "--name", f"{self.name}-{c['name']}", "--pull=never", "--read-only-tmpfs=false",
                "--health-interval=disable"]  # no systemd timers here: .ci/image runs the check itself
        args += ["--network", "host" if self.spec.get("hostNetwork") else "none"]
        if self.spec.get("hostPID"):
            args += ["--pid", "host"]
        if self.spec.get("automountServiceAccountToken", True):
            raise self.unsupported("a service account token")
        pod_sc = self.spec.get("securityContext") or {}
        if set(pod_sc) - {"seccompProfile", "runAsUser", "runAsGroup", "runAsNonRoot", "supplementalGroups"}:
            raise self.unsupported(f"pod securityContext {pod_sc}")
        if (pod_sc.get("seccompProfile") or {}).get("type", "RuntimeDefault") != "RuntimeDefault":
            raise self.unsupported(f"seccompProfile {pod_sc['seccompProfile']}")
        # The kubelet adds the pod's supplementalGroups to every container's process.
        args += [f"--group-add={g}" for g in pod_sc.get("supplementalGroups", [])]
        pod_only = ("seccompProfile", "supplementalGroups")
        sc = {**{k: v for k, v in pod_sc.items() if k not in pod_only}, **(c.get("securityContext") or {})}
        known = {"runAsUser", "runAsGroup", "runAsNonRoot", "readOnlyRootFilesystem", "allowPrivilegeEscalation",
                 "capabilities", "privileged"}
        if set(sc) - known:
            raise self.unsupported(f"securityContext fields {sorted(set(sc) - known)}")
        if "runAsUser" in sc:
            args += ["--user", f"{sc['runAsUser']}:{sc.get('runAsGroup', 0)}"]
        if sc.get("runAsNonRoot"):
            user = sc.get("runAsUser", podman("image", "inspect", "--format", "{{.Config.User}}", self.image).stdout.strip())
            if str(user).split(":")[0] in ("", "0", "root"):
                raise Failed(f"{c['name']}: runAsNonRoot, but the container would run as {user!r}")
        if sc.get("readOnlyRootFilesystem"):
            args.append("--read-only")
        if sc.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        if sc.get("privileged"):
            args.append("--privileged")
        caps = sc.get("capabilities") or {}
        args += [f"--cap-drop={x}" for x in caps.get("drop", [])] + [f"--cap-add={x}" for x in caps.get("add", [])]
        for env in c.get("env", []):
            if "value" in env:
                args += ["--env", f"{env['name']}={env['value']}"]
            elif env.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
                args += ["--env", f"{env['name']}={NODE}"]
            else:
                raise self.unsupported(f"env {env}")
        limits = (c.get("resources") or {}).get("limits") or {}
        if "memory" in limits:
            args += ["--memory", str(limits["memory"]).replace("Mi", "m").replace("Gi", "g")]
        if "cpu" in limits:
            cpu = str(limits["cpu"])
            args += ["--cpus", str(int(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu))]
        for m in c.get("volumeMounts", []):
            if set(m) - {"name", "mountPath", "readOnly"}:
                raise self.unsupported(f"volumeMount {m}")
            # ConfigMap volumes are read-only whatever the mount says, as in Kubernetes.
            ro = m.get("readOnly") or any(v["name"] == m["name"] and "configMap" in v for v in self.spec["volumes"])
            args += ["--volume", f"{self.mounts[m['name']]}:{m['mountPath']}:{'ro' if ro else 'rw'}"]
        if c.get("command"):
            args += ["--entrypoint", json.dumps(c["command"])]
        args += ["--detach"] if detach else []
        return [*args, c["image"], *c.get("args", [])]

    def container_pid(self, name: str) -> int:
        return int(podman("inspect", "--format", "{{.State.Pid}}", name).stdout.strip())

    def probe(self, c: dict, spec: dict) -> tuple[bool, str]:
        """One probe as the kubelet makes it, from the pod's network namespace."""
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        if "httpGet" in spec:
            port = spec["httpGet"]["port"]
            target = {"http": f"http://127.0.0.1:{ports.get(port, port)}{spec['httpGet'].get('path', '/')}"}
        elif "grpc" in spec:
            target = {"grpc": f"127.0.0.1:{spec['grpc']['port']}", "service": spec["grpc"].get("service", "")}
        else:
            raise self.unsupported(f"probe {spec}")
        target["timeout"] = spec.get("timeoutSeconds", 1)
        cmd = [sys.executable, __file__, "probe", json.dumps(target)]
        if not self.spec.get("hostNetwork"):
            cmd = ["nsenter", f"--net=/proc/{self.pid}/ns/net", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=target["timeout"] + 30)
        return done.returncode == 0, (done.stdout + done.stderr).strip()


def probe_main(target: dict) -> int:
    if "http" in target:
        try:
            with urllib.request.urlopen(target["http"], timeout=target["timeout"]) as resp:
                print(resp.status)
                return 0 if 200 <= resp.status < 400 else 1
        except urllib.error.HTTPError as exc:
            print(exc.code, exc.read()[:500].decode("utf-8", "replace"))
        except OSError as exc:
            print(exc)
        return 1
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(target["grpc"]) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=target["service"]), timeout=target["timeout"])
        except grpc.RpcError as exc:
            print(exc.code(), exc.details())
            return 1
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


# -- the checks -----------------------------------------------------------------------------------

def wait_probe(pod: Pod, c: dict, kind: str, limit: float) -> float:
    """Probe on the kubelet's schedule (initialDelaySeconds, then every periodSeconds) until a success;
    the seconds from the start to it."""
    spec = c[kind]
    start = time.monotonic()
    time.sleep(spec.get("initialDelaySeconds", 0))
    while True:
        ok, said = pod.probe(c, spec)
        if ok:
            return time.monotonic() - start
        state = podman("inspect", "--format", "{{.State.Status}}", f"{pod.name}-{c['name']}").stdout.strip()
        if state != "running" or time.monotonic() - start > limit:
            raise Failed(f"{kind} did not pass within {limit:.0f} s (container {state}); last answer: {said}")
        time.sleep(spec.get("periodSeconds", 10))


def run_pod(pod: Pod, arch: str, metrics_family: str, devices: int) -> dict:
    measured = {}
    state_mount = None
    for c in pod.spec.get("initContainers", []):
        podman(*pod.run_args(c, detach=False))
        podman("rm", f"{pod.name}-{c['name']}")
        log(f"init container {c['name']} exited 0")
    [c] = pod.spec["containers"]
    for m in c["volumeMounts"]:
        if m["name"] == "state":
            state_mount = pod.mounts["state"]
    name = f"{pod.name}-{c['name']}"
    started = time.monotonic()
    podman(*pod.run_args(c, detach=True))
    try:
        pod.pid = pod.container_pid(name)
        status = Path(f"/proc/{pod.pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        uid, gid, cap_eff = fields["Uid"].split()[1], fields["Gid"].split()[1], fields["CapEff"].strip()
        want = str((c.get("securityContext") or {}).get("runAsUser"))
        if uid != want:
            raise Failed(f"the agent runs as uid {uid}, the chart says {want}")
        if want != "0" and int(cap_eff, 16) != 0:
            raise Failed(f"the non-root agent has capabilities {cap_eff}")
        log(f"agent process {pod.pid}: uid {uid}, gid {gid}, effective capabilities {cap_eff}")
        if state_mount is not None:
            st = state_mount.stat()
            if str(st.st_uid) != want:
                raise Failed(f"state_dir is owned by uid {st.st_uid}, not the agent's {want}")
        wrote = podman("exec", name, "python", "-c",
                       "import errno, sys\ntry: open('/etc/npu-node-agent-write-test', 'w')\n"
                       "except OSError as e: sys.exit(0 if e.errno == errno.EROFS else f'unexpected {e}')\n"
                       "sys.exit('the root filesystem is writable')", check=False)
        if wrote.returncode != 0:
            raise Failed(f"read-only root: {wrote.stdout}{wrote.stderr}")
        log("root filesystem read-only (EROFS)")

        measured["ready_s"] = wait_probe(pod, c, "readinessProbe", 120)
        log(f"readiness probe passed {measured['ready_s']:.1f} s after the start")
        ok, said = pod.probe(c, c["livenessProbe"])
        if not ok:
            raise Failed(f"liveness probe failed: {said}")
        http = next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
        done = subprocess.run(["nsenter", f"--net=/proc/{pod.pid}/ns/net", "python3", "-c",
                               f"import urllib.request; print(urllib.request.urlopen("
                               f"'http://127.0.0.1:{http}/metrics', timeout=10).read().decode())"],
                              capture_output=True, text=True, timeout=60)
        series = [line for line in done.stdout.splitlines() if line.startswith(metrics_family + "{")]
        if len(series) != devices:
            raise Failed(f"/metrics: {len(series)} {metrics_family} series, {devices} simulated NPUs:\n"
                         f"{done.stdout[:2000]}{done.stderr}")
        log(f"/metrics: {len(done.stdout.splitlines())} lines, {metrics_family} for {devices} NPUs")
        health = podman("healthcheck", "run", name, check=False)
        if health.returncode != 0:
            raise Failed(f"the image's HEALTHCHECK failed: {health.stdout}{health.stderr}")
        log("HEALTHCHECK healthy")

        grace = pod.spec.get("terminationGracePeriodSeconds", 30)
        t0 = time.monotonic()
        podman("stop", "--time", str(grace), name, timeout=grace + 60)
        measured["stop_s"] = time.monotonic() - t0
        code = podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
        logs = podman("logs", name).stdout + podman("logs", name).stderr
        if code != "0" or measured["stop_s"] >= grace:
            raise Failed(f"SIGTERM: exit code {code} after {measured['stop_s']:.1f} s (grace {grace} s):\n{logs[-3000:]}")
        if "Traceback" in logs:
            raise Failed(f"the agent logged a traceback:\n{logs[-3000:]}")
        log(f"SIGTERM: exit code 0 after {measured['stop_s']:.1f} s (grace {grace} s)")
        measured["run_s"] = time.monotonic() - started
    except Failed:
        logs = podman("logs", name, check=False)
        log(f"the agent's log, last lines:\n{(logs.stdout + logs.stderr)[-3000:]}")
        raise
    finally:
        podman("rm", "--force", "--time", "0", name, check=False)
    return measured


def build_fake_mspti(builder: str, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    podman("run", "--rm", "--pull=never", "--network", "none", "--volume", f"{REPO}:/src:ro",
           "--volume", f"{out}:/out", builder, "cc", *FLAGS, "-Wextra", "-o", "/out/libmspti.so",
           "/src/testkit/fakes/mspti/fake_mspti.c")  # it includes /src/native/mspti_abi.h
    return out


def check_mspti(image: str, arch: str, fake_dir: Path, work: Path) -> None:
    if elf_machine((fake_dir / "libmspti.so").read_bytes()) != ELF_MACHINE[arch]:
        raise Failed(f"the fake libmspti.so is not built for {arch}")
    data = work / "training"
    data.mkdir(mode=0o777)
    data.chmod(0o777)
    done = podman("run", "--rm", "--pull=never", "--network", "none", "--read-only", "--read-only-tmpfs=false",
                  "--user", "65532:65532", "--cap-drop=all", "--security-opt", "no-new-privileges",
                  "--volume", f"{fake_dir}:/opt/fake-mspti:ro", "--volume", f"{REPO / '.ci'}:/opt/ci:ro",
                  "--volume", f"{data}:/data", "--env", "LD_LIBRARY_PATH=/opt/fake-mspti",
                  "--env", "NPU_AGENT_PROFILING_ROOT=/data/profiling", "--env", "NPU_AGENT_PROFILING_SWITCH=/data/switch",
                  "--env", "MINDX_TASK_ID=smoke-job", "--entrypoint", "python", image,
                  "/opt/ci/image-mspti.py", str(MSPTI_RECORDS), check=False)
    if done.returncode != 0:
        raise Failed(f"agent.worker in the image:\n{done.stdout}{done.stderr}")
    said = json.loads(done.stdout.strip().splitlines()[-1])
    if said["implementation"] != "native":
        raise Failed(f"agent.worker used the {said['implementation']} collector, not the native extension")
    records = []
    for f in sorted((data / "profiling" / "smoke-job" / "0").iterdir()):
        records += [json.loads(line) for line in f.read_text().splitlines()]
    names = [r.get("Name") for r in records]
    if names.count("image-smoke") != MSPTI_RECORDS:
        raise Failed(f"{names.count('image-smoke')} of {MSPTI_RECORDS} marker records on disk: {records[:3]}")
    log(f"agent.worker (native collector) wrote {MSPTI_RECORDS} TaskD records as uid 65532")


def check_wheel(wheel_dir: Path, arch: str) -> Path:
    [wheel] = wheel_dir.glob("npu_node_agent-*.whl")
    with zipfile.ZipFile(wheel) as z:
        [so] = [n for n in z.namelist() if n.startswith("agent/_native.") and n.endswith(".so")]
        if elf_machine(z.read(so)) != ELF_MACHINE[arch]:
            raise Failed(f"{wheel.name}: {so} is not compiled for {arch}")
    log(f"{wheel.name}: {so} compiled for {arch}")
    return wheel


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("probe")
    p.add_argument("target")
    r = sub.add_parser("run")
    for opt in ("--image", "--builder-image", "--helm", "--values"):
        r.add_argument(opt, required=True)
    r.add_argument("--arch", required=True, choices=sorted(ELF_MACHINE))
    r.add_argument("--wheel-dir", type=Path, required=True)
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    if args.cmd == "probe":
        return probe_main(json.loads(args.target))
    try:
        check_wheel(args.wheel_dir, args.arch)
        values = yaml.safe_load(Path(args.values).read_text())
        devices = values["agent"]["devices"]["simulated"]["devices"]
        rendered = subprocess.run([args.helm, "template", "smoke", str(REPO / "helm" / "npu-node-agent"),
                                   "--values", args.values, *[x for s in args.set for x in ("--set", s)]],
                                  capture_output=True, text=True, check=True).stdout
        pod = Pod(list(yaml.safe_load_all(rendered)), args.work, args.image)
        for c in pod.spec.get("initContainers", []) + pod.spec["containers"]:
            ids = {podman("image", "inspect", "--format", "{{.Id}}", ref).stdout.strip() for ref in (c["image"], args.image)}
            if len(ids) != 1:
                raise Failed(f"the chart's image {c['image']} is not the image under test {args.image}")
        measured = run_pod(pod, args.arch, "npu_chip_info_health_status", devices)
        check_mspti(args.image, args.arch, build_fake_mspti(args.builder_image, args.work / "fake-mspti"), args.work)
    except (Failed, subprocess.CalledProcessError) as exc:
        log(f"FAILED ({args.arch}): {exc}")
        return 1
    log(f"passed ({args.arch}): ready after {measured['ready_s']:.1f} s, stopped in {measured['stop_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
