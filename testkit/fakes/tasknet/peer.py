"""Entry point: run one TaskNet peer as its own process, driven by JSON lines on stdin/stdout.

    python -m testkit.fakes.tasknet.peer manager --listen HOST:PORT [--config JSON]
    python -m testkit.fakes.tasknet.peer worker --proxy HOST:PORT --server-rank N --process-rank M
                                              [--role Worker|Agent] [--retry-interval 0.2]

The command and event protocol is described in ``testkit/fakes/tasknet/__init__.py``.
Logs go to stderr; stdout carries only events.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from . import manager_peer, worker_peer
from .wire import Pos


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m testkit.fakes.tasknet.peer")
    roles = parser.add_subparsers(dest="kind", required=True)
    mgr = roles.add_parser("manager", help="a TaskD manager (Mgr, level 3): a TaskNet server")
    mgr.add_argument("--listen", required=True, help="HOST:PORT (port 0 picks one; see the ready event)")
    mgr.add_argument("--config", type=json.loads, default=None,
                     help='knobs in force from the start, as the config command takes them: {"stream_delay": 1}')
    wrk = roles.add_parser("worker", help="a TaskD worker or agent (level 1): a TaskNet client")
    wrk.add_argument("--proxy", required=True, help="HOST:PORT of the upstream (proxy, or a manager directly)")
    wrk.add_argument("--server-rank", required=True)
    wrk.add_argument("--process-rank", default=None, help="global rank; required for a Worker")
    wrk.add_argument("--role", choices=("Worker", "Agent"), default="Worker")
    wrk.add_argument("--retry-interval", type=float, default=0.2, help="seconds between join attempts (TaskD: 1)")
    # Long: the node proxy and the manager stand-in confirm a stream with headers at once, and "ready" must
    # not come before a slow server (a busy machine) has taken the stream.
    wrk.add_argument("--stream-grace", type=float, default=10.0,
                     help="seconds a stream must stay open to count as accepted when the server sends no headers")
    args = parser.parse_args(argv)
    if args.kind == "worker" and args.role == "Worker" and args.process_rank is None:
        parser.error("--process-rank is required for a Worker")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(stream=sys.stderr, level=os.environ.get("TASKNET_PEER_LOG", "INFO"),
                        format=f"%(asctime)s {args.kind} %(levelname)s %(message)s")
    if args.kind == "manager":
        code = asyncio.run(manager_peer.run(args.listen, args.config))
    else:
        pos = (Pos("Worker", args.server_rank, args.process_rank) if args.role == "Worker"
               else Pos("Agent", args.server_rank, "-1"))
        code = asyncio.run(worker_peer.run(args.proxy, pos, args.retry_interval, args.stream_grace))
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
