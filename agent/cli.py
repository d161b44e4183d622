"""Command line: run, demo, check-config, faults, version (exit 0 ok, 1 runtime failure, 2 bad usage/config)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import math
import platform
import sys

from agent import __version__
from agent.config import load_config
from agent.common.errors import ConfigError

log = logging.getLogger("agent")

EXIT_OK, EXIT_USAGE = 0, 2  # 1: a runtime failure (agent.app.serve)
MAX_SECONDS = 30 * 86400  # longer waits are mistakes (and overflow the C timeouts beneath)


def seconds(zero_ok: bool):
    """An argparse type: a finite number of seconds, > 0 (or >= 0 when `zero_ok`), at most MAX_SECONDS."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (0 <= value if zero_ok else 0 < value) and value <= MAX_SECONDS):
            raise argparse.ArgumentTypeError(
                f"expected seconds {'>=' if zero_ok else '>'} 0 and <= {MAX_SECONDS}, got {text[:40]!r}")
        return value
    return parse


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="npu-node-agent", description="Node agent for Ascend NPU training clusters.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="run the agent (the DaemonSet's main process)")
    run.add_argument("--config", help="YAML configuration file (every key optional)")

    demo = commands.add_parser("demo", help="the whole agent on a simulated 8-NPU node with scripted faults")
    demo.add_argument("--duration", type=seconds(zero_ok=True), default=100.0, help="seconds to run (0: until Ctrl-C); default 100")
    demo.add_argument("--slow-after", type=seconds(zero_ok=True), default=60.0, metavar="S",
                      help="seconds until rank 5 of the simulated training job gets 15 %% slower; default 60")
    demo.add_argument("--workdir", help="where the demo writes its configuration, state and log (default: a new temp dir)")

    check = commands.add_parser("check-config", help="validate a configuration file and the rule files it names")
    check.add_argument("file")

    faults = commands.add_parser("faults", help="show the active faults of a running agent")
    faults.add_argument("--target", default="127.0.0.1:9411", help="the agent's gRPC address (default 127.0.0.1:9411)")
    faults.add_argument("--follow", action="store_true", help="keep printing changes")
    faults.add_argument("--json", action="store_true", help="one JSON object per faulty device per line")
    faults.add_argument("--timeout", type=seconds(zero_ok=False), default=5.0, help="seconds to wait for the agent (default 5)")
    faults.add_argument("--ca-file", default="", help="TLS: the CA certificates of the agent's certificate (PEM)")
    faults.add_argument("--cert-file", default="", help="TLS: this client's certificate, for an agent that asks (PEM)")
    faults.add_argument("--key-file", default="", help="TLS: the private key of --cert-file (PEM)")

    commands.add_parser("version", help="version and build information")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)  # the parser goes with this line, not kept for the agent's life
    try:
        return {"run": cmd_run, "demo": cmd_demo, "check-config": cmd_check_config,
                "faults": cmd_faults, "version": cmd_version}[args.command](args)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"npu-node-agent: {problem}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_OK


def cmd_version(args) -> int:
    try:
        importlib.import_module("agent._native")
        native = "loaded (agent.worker serialises MSPTI records in C)"
    except ImportError as exc:
        native = f"not loaded ({exc}); agent.worker uses its pure-Python collector"
    print(f"npu-node-agent {__version__}\npython {platform.python_version()} ({platform.machine()})\n"
          f"native extension: {native}")
    return EXIT_OK


def cmd_check_config(args) -> int:
    from agent.devices.scenario import load_scenario
    from agent.faults.service import load_tables
    from agent.tls import TlsFiles as load_tls

    problems: list[str] = []
    try:
        config = load_config(args.file, environ={}, hosts=False)  # a `${NAME}` host is known only where it runs
    except ConfigError as exc:
        problems = exc.problems
    else:
        for check in (lambda: load_tables(config.faults), lambda: config.tls.cert_file and load_tls(config.tls),
                      lambda: config.devices.simulated.scenario and config.devices.backend == "simulated"
                      and load_scenario(config.devices.simulated.scenario, config.devices.simulated.devices)):
            try:
                check()
            except ConfigError as exc:
                problems += exc.problems
    if problems:
        for problem in problems:
            print(problem, file=sys.stderr)
        return EXIT_USAGE
    print(f"{args.file}: ok")
    return EXIT_OK


def cmd_run(args) -> int:
    from agent.common.logs import setup_logging

    from agent.app import serve

    config = load_config(args.config)
    setup_logging(config.log.level, config.log.format)
    return asyncio.run(serve(config))


def cmd_demo(args) -> int:
    from agent.demo.run import run_demo

    return run_demo(args.duration, args.workdir, args.slow_after)


def cmd_faults(args) -> int:
    from agent.sinks.stream.client import channel_credentials, print_faults

    if bool(args.cert_file) != bool(args.key_file):
        raise ConfigError(["faults: --cert-file and --key-file go together"])
    try:
        credentials = channel_credentials(args.ca_file, args.cert_file, args.key_file)
    except OSError as exc:
        raise ConfigError([f"faults: {exc.filename}: cannot read: {exc.strerror}"]) from None
    return print_faults(args.target, follow=args.follow, as_json=args.json, timeout=args.timeout,
                        credentials=credentials)
