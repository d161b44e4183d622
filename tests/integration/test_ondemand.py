"""The profiling root's followers are built on demand (agent.ondemand): at once when the root holds
something at start, else at the first entry (seen by inotify, or after the root appears), on a real
directory with the agent's executor; and an agent on an empty root has not loaded them at all."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap

from agent.common.executor import Executor
from agent.lifecycle import Readiness, Tasks
from agent.ondemand import EMPTY, IN_USE, MISSING, OnDemand, look
from testkit import REPO
from testkit.wait import until


class Part:
    def __init__(self, name: str, journal: list, fail_starts: int = 0):
        self.name = name
        self.tasks = Tasks(name)
        self._journal = journal
        self._fail_starts = fail_starts

    async def start(self) -> None:
        if self._fail_starts:
            self._fail_starts -= 1
            raise OSError(f"{self.name} cannot start")
        self._journal.append(f"start {self.name}")

    async def stop(self) -> None:
        self._journal.append(f"stop {self.name}")

    def readiness(self) -> tuple[bool, str]:
        return False, "still scanning"


class Guard(Part):
    pass


class Tailer(Part):
    pass


class Builds:
    """The build callback: records each call's `fresh` and returns two parts."""

    def __init__(self, fail_starts: int = 0):
        self.calls: list[bool] = []
        self.journal: list[str] = []
        self._fail_starts = fail_starts

    def __call__(self, fresh: bool) -> list[Part]:
        self.calls.append(fresh)
        fail, self._fail_starts = self._fail_starts, 0
        return [Guard("guard", self.journal), Tailer("tailer", self.journal, fail_starts=fail)]


def on_demand(root, builds: Builds, **kwargs) -> OnDemand:
    return OnDemand("profiling", root, builds, lane=Executor(name="test").lane("look"), poll_s=0.05, **kwargs)


def test_look_tells_empty_missing_and_in_use(tmp_path):
    assert look(str(tmp_path / "none")) == MISSING
    (tmp_path / "empty").mkdir()
    assert look(str(tmp_path / "empty")) == EMPTY
    (tmp_path / "empty-link").symlink_to(tmp_path / "empty")
    assert look(str(tmp_path / "empty-link")) == IN_USE  # the followers refuse a symlinked root, and say so
    (tmp_path / "file").write_text("x")
    assert look(str(tmp_path / "file")) == IN_USE
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "0").mkdir()
    assert look(str(tmp_path / "job")) == IN_USE


def test_a_root_in_use_at_start_builds_them_at_once_as_found(tmp_path):
    (tmp_path / "job-a").mkdir()
    builds = Builds()

    async def main():
        gate = on_demand(tmp_path, builds)
        await gate.start()
        assert builds.calls == [False] and builds.journal == ["start guard", "start tailer"]
        assert [part.name for part in gate.parts] == ["guard", "tailer"] and gate.part(Tailer) is gate.parts[1]
        await gate.stop()
        assert builds.journal[2:] == ["stop tailer", "stop guard"] and gate.parts == ()

    asyncio.run(main())


def test_an_empty_root_builds_them_at_the_first_entry_and_readiness_reports_them_then(tmp_path):
    builds = Builds()

    async def main():
        gate = on_demand(tmp_path, builds)
        readiness = Readiness([gate])
        await gate.start()
        await asyncio.sleep(0.2)  # time for a wrong build to happen; what is asserted is that none did
        assert builds.calls == [] and gate.parts == () and gate.part(Guard) is None
        assert readiness.states() == [("profiling", True, "")]
        (tmp_path / "job-a").mkdir()
        await until(lambda: gate.parts, 10, "the parts built after the first entry")
        assert builds.calls == [True]  # fresh: all of it appeared while the agent ran
        assert readiness.states() == [("guard", False, "still scanning"), ("tailer", False, "still scanning")]
        await gate.stop()
        assert builds.journal == ["start guard", "start tailer", "stop tailer", "stop guard"]

    asyncio.run(main())


def test_a_missing_root_is_waited_for_then_watched(tmp_path):
    root = tmp_path / "profiling"
    builds = Builds()

    async def main():
        gate = on_demand(root, builds)
        await gate.start()
        root.mkdir()
        await asyncio.sleep(0.3)  # several polls: the root appeared empty, and is watched now
        assert builds.calls == []
        (root / "job-a").mkdir()
        await until(lambda: gate.parts, 10, "the parts built after the first entry")
        assert builds.calls == [True]
        await gate.stop()

    asyncio.run(main())


def test_a_part_that_fails_to_start_is_undone_and_the_build_retried_with_backoff(tmp_path):
    builds = Builds(fail_starts=1)

    async def main():
        gate = on_demand(tmp_path, builds)
        gate.tasks = Tasks("profiling", backoff_first_s=0.05)
        await gate.start()
        (tmp_path / "job-a").mkdir()
        await until(lambda: gate.tasks.problem, 10, "the failed start on the task")
        assert "tailer cannot start" in gate.tasks.problem
        await until(lambda: gate.parts, 10, "the parts built on the retry")
        assert builds.calls == [True, True]  # still fresh: the root was empty when the agent started
        assert builds.journal == ["start guard", "stop guard", "start guard", "start tailer"]
        await gate.stop()

    asyncio.run(main())


def test_stop_while_waiting_builds_nothing(tmp_path):
    builds = Builds()

    async def main():
        gate = on_demand(tmp_path, builds)
        await gate.start()
        await gate.stop()
        (tmp_path / "job-a").mkdir()
        await asyncio.sleep(0.2)  # a build after stop would show here
        assert builds.calls == [] and gate.tasks.running == []

    asyncio.run(main())


AGENT_ON_AN_EMPTY_ROOT = textwrap.dedent("""\
    import asyncio, json, pathlib, sys, time, urllib.request
    from agent.app import serve
    from agent.config import config_from_dict

    root = pathlib.Path(sys.argv[1]) / "profiling"
    root.mkdir()
    HEAVY = ("agent.steps.consumer", "agent.steps.tail", "agent.diskguard.guard", "agent.fstree.tree")

    async def main():
        config = config_from_dict({
            "node_name": "n", "state_dir": sys.argv[1] + "/state", "log": {"level": "warning"},
            "http": {"listen": "127.0.0.1:0"}, "grpc": {"listen": "127.0.0.1:0"},
            "devices": {"backend": "simulated", "poll_interval_seconds": 1},
            "kubernetes": {"pod_resources_socket": ""}, "profiling": {"root": str(root)}}, environ={})
        stop, started, seen = asyncio.Event(), [], {}
        run = asyncio.create_task(serve(config, stop, on_started=started.append))
        while not started:
            assert not run.done(), run.result()
            await asyncio.sleep(0.01)
        app = started[0]
        seen["idle"] = [m for m in HEAVY if m in sys.modules]
        seen["idle_components"] = [name for name, _ in app.readiness.ready_by_component()]
        url = f"http://127.0.0.1:{app.http.port}/metrics"
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
        seen["idle_samples"] = [line for line in text.splitlines()
                                if line.startswith(("npu_agent_profiling_disk", "training_profiling_parse"))]
        (root / "job-a" / "0").mkdir(parents=True)
        deadline = time.monotonic() + 30
        while (app.steps is None or app.guard is None) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        seen["busy"] = [m for m in HEAVY if m in sys.modules]
        seen["busy_components"] = [name for name, _ in app.readiness.ready_by_component()]
        stop.set()
        seen["exit"] = await run
        print(json.dumps(seen))

    asyncio.run(main())
""")


def test_an_agent_on_an_empty_profiling_root_loads_neither_the_disk_guard_nor_the_step_pipeline(tmp_path):
    result = subprocess.run([sys.executable, "-c", AGENT_ON_AN_EMPTY_ROOT, str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["idle"] == [], "loaded before anything was under the root"
    assert "profiling" in seen["idle_components"]
    # Their families are there from the start: the limit, the usage (0) and the skip counters at 0.
    assert 'npu_agent_profiling_disk_limit_bytes{node="n"} 5.24288e+09' in seen["idle_samples"]
    assert 'npu_agent_profiling_disk_usage_bytes{node="n"} 0.0' in seen["idle_samples"]
    assert 'training_profiling_parse_errors_total{node="n",reason="not_json"} 0.0' in seen["idle_samples"]
    assert seen["busy"] == ["agent.steps.consumer", "agent.steps.tail", "agent.diskguard.guard", "agent.fstree.tree"]
    assert {"disk-guard", "step-metrics", "profiling-tailer"} <= set(seen["busy_components"])
    assert "profiling" not in seen["busy_components"]
    assert seen["exit"] == 0

