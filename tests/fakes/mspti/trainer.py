"""A stand-in training process: `agent.worker` on the fake libmspti, driven over stdin/stdout.

Run as ``python -m tests.fakes.mspti.trainer --rank N [--give-up S] [--register-delays 0,1,...]``
with the fake's directory in ``LD_LIBRARY_PATH`` (the worker finds ``libmspti.so`` there and this
process loads the same instance to emit records). It calls ``init_taskd_worker(N)`` and
``start_taskd_worker()`` exactly as a training script does, so the worker reads its switch file
and TaskD environment (``MINDX_TASK_ID``, ``MASTER_ADDR``, ``NPU_AGENT_TASKD_PROXY``, ...) from the
real process environment - which is what the node agent's TaskD proxy looks at too.

``--give-up`` and ``--register-delays`` hand the TaskD manager client other constructor arguments
(the registration window and the pauses before each REGISTER try), for tests only.

Every stdout line is one JSON event; the first is ``started{init,start,impl}``. Commands (JSON lines
on stdin, each answered by one event carrying the command's ``id``):

  emit{name,domain,count[,flag]} -> emitted{emitted,filtered}   (records from the fake's threads;
                                                                 waits until they are all made)
  stats -> stats{stats,state}                                   (agent.worker.stats(), fake state bits)
  foreign{on} -> foreign{}                                      (another profiler holds MSPTI's slot)
  quit -> (exits through the atexit hook, which writes the rest)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[3]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainer")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--give-up", type=float)
    parser.add_argument("--register-delays")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s")

    import agent.worker as worker
    from agent.worker import tasknet
    from tests.fakes.mspti import load_fake_mspti

    overrides = {}
    if args.give_up is not None:
        overrides["give_up_s"] = args.give_up
    if args.register_delays is not None:
        overrides["register_delays"] = [float(x) for x in args.register_delays.split(",") if x]
    if overrides:
        make_client = tasknet.client_from_env
        tasknet.client_from_env = lambda rank_id, env=None, **kw: make_client(rank_id, env, **{**overrides, **kw})

    out_lock = threading.Lock()

    def emit(**event) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
            sys.stdout.flush()

    ok = worker.init_taskd_worker(args.rank)
    started = worker.start_taskd_worker() if ok else False
    emit(event="started", init=ok, start=started, impl=worker.implementation())
    fake = load_fake_mspti(worker.find_library()) if ok else None

    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        op, cid = cmd.get("op"), cmd.get("id")
        if op == "quit":
            break
        if op == "emit":
            fake.fake_mspti_emit(int(cmd["count"]), cmd["name"].encode(), cmd["domain"].encode(),
                                 int(cmd.get("flag", 16)), 0)
            fake.fake_mspti_wait_idle()
            emit(event="emitted", id=cid, emitted=fake.fake_mspti_emitted(), filtered=fake.fake_mspti_filtered())
        elif op == "stats":
            emit(event="stats", id=cid, stats=worker.stats(), state=fake.fake_mspti_state() if fake else 0)
        elif op == "foreign":
            fake.fake_mspti_set_foreign_subscriber(1 if cmd.get("on") else 0)
            emit(event="foreign", id=cid)
        else:
            emit(event="error", id=cid, error=f"unknown op {op!r}")
    return 0


class Trainer:
    """Test side: one trainer process, its events, and request/response over its pipes."""

    def __init__(self, rank: int, env: dict, *, give_up: float | None = None,
                 register_delays: list[float] | None = None, start_timeout: float = 30.0):
        args = [sys.executable, "-m", "tests.fakes.mspti.trainer", "--rank", str(rank)]
        if give_up is not None:
            args += ["--give-up", str(give_up)]
        if register_delays is not None:
            args += ["--register-delays", ",".join(str(d) for d in register_delays)]
        self.rank = rank
        self.env = env
        self._events: list[dict] = []
        self._stderr: list[str] = []
        self._cond = threading.Condition()
        self._eof = False
        self._next_id = 0
        self.process = subprocess.Popen(args, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, bufsize=1)
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        self.started = self.wait_event(lambda e: e.get("event") == "started", start_timeout)

    def _read_stdout(self) -> None:
        for line in self.process.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                event = {"event": "garbage", "line": line}
            with self._cond:
                self._events.append(event)
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _read_stderr(self) -> None:
        for line in self.process.stderr:
            with self._cond:
                self._stderr.append(line)

    def stderr(self) -> str:
        with self._cond:
            return "".join(self._stderr)

    def wait_event(self, match: Callable[[dict], bool], timeout: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for event in self._events:
                    if match(event):
                        return event
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._eof:
                    break
                self._cond.wait(remaining)
        raise AssertionError(f"trainer rank {self.rank}: {'exited' if self._eof else 'timed out'}; events "
                             f"{self._events[-20:]}\n--- stderr tail ---\n{self.stderr()[-4000:]}")

    def request(self, op: str, timeout: float = 30.0, **fields) -> dict:
        self._next_id += 1
        cid = self._next_id
        self.process.stdin.write(json.dumps({"op": op, "id": cid, **fields}) + "\n")
        self.process.stdin.flush()
        return self.wait_event(lambda e: e.get("id") == cid, timeout)

    def emit(self, name: str, domain: str, count: int) -> dict:
        return self.request("emit", name=name, domain=domain, count=count)

    def stats(self) -> dict:
        return self.request("stats")["stats"]

    def state(self) -> int:
        return self.request("stats")["state"]

    def stop(self, timeout: float = 20.0) -> int | None:
        """Quit (the atexit hook stops the worker); SIGKILL and None if it does not go in time."""
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.process.stdin.flush()
                self.process.stdin.close()
            except (BrokenPipeError, ValueError, OSError):
                pass
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
                return None
        return self.process.returncode


def trainer_env(fake_library: Path, root: Path, switch: Path, **extra: str) -> dict:
    """A clean environment for a trainer: none of the caller's TaskD or MSPTI variables, the fake first
    in LD_LIBRARY_PATH, profiling paths under the test's directory; then `extra`."""
    drop = ("MINDX_TASK_ID", "MASTER_ADDR", "MS_SCHED_HOST", "LOCAL_PROXY_ENABLE", "RANK", "LOCAL_WORLD_SIZE",
            "MS_NODE_RANK", "LD_LIBRARY_PATH", "FAKE_MSPTI_FOREIGN_SUBSCRIBER")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("NPU_AGENT_")}
    env.update(LD_LIBRARY_PATH=str(Path(fake_library).parent), NPU_AGENT_PROFILING_ROOT=str(root),
               NPU_AGENT_PROFILING_SWITCH=str(switch), PYTHONPATH=str(REPO))
    env.update(extra)
    return env


if __name__ == "__main__":
    sys.exit(main())
