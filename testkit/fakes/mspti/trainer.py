"""A stand-in training process: `agent.worker` on the fake libmspti, driven over stdin/stdout.

Run as ``python -m testkit.fakes.mspti.trainer --rank N [--give-up S] [--register-delays 0,1,...]``
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
import sys
import threading
from pathlib import Path

from testkit.fakes.tasknet.driver import REPO, PeerProcess


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
    from testkit.fakes.mspti import load_fake_mspti

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


class Trainer(PeerProcess):
    """Test side: one trainer process, its events, and request/response over its pipes."""

    def __init__(self, rank: int, env: dict, *, give_up: float | None = None,
                 register_delays: list[float] | None = None, start_timeout: float = 30.0):
        args = ["--rank", str(rank)]
        if give_up is not None:
            args += ["--give-up", str(give_up)]
        if register_delays is not None:
            args += ["--register-delays", ",".join(str(d) for d in register_delays)]
        super().__init__(args, env, name=f"trainer rank {rank}", module="testkit.fakes.mspti.trainer",
                         inherit_env=False, stderr_lines=None)
        self.rank = rank
        self._next_id = 0
        self.started = self.wait_event("started", start_timeout)

    def _ask(self, op: str, timeout: float = 30.0, **fields) -> dict:
        self._next_id += 1
        cid = self._next_id
        self.send(op=op, id=cid, **fields)
        return self.wait_event(lambda e: e.get("id") == cid, timeout)

    def emit(self, name: str, domain: str, count: int) -> dict:
        return self._ask("emit", name=name, domain=domain, count=count)

    def stats(self) -> dict:
        return self._ask("stats")["stats"]

    def state(self) -> int:
        return self._ask("stats")["state"]

    def stderr(self) -> str:
        return self.stderr_tail(None)

    def stop(self, timeout: float = 20.0) -> int | None:
        """Quit (the atexit hook stops the worker); SIGKILL and None if it does not go in time."""
        return super().stop(timeout)


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
