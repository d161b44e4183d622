"""Command line: run, demo, check-config, faults, version (exit 0 ok, 1 runtime failure, 2 bad usage/config,
3 `faults` from an agent that cannot see all of its devices)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import math
import platform
import sys

from agent import __version__
from agent.config import load_config, split_host_port
from agent.common.errors import ConfigError

log = logging.getLogger("agent")

EXIT_OK, EXIT_USAGE = 0, 2  # 1: a runtime failure (agent.app.serve); 3: see agent.sinks.stream.client
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


LOG_LEVELS = ("debug", "info", "warning", "error")

EXIT_CODES = """exit codes:
  0  ok
  1  runtime failure: a port that cannot be bound (run, demo); the agent cannot be reached or
     its fault stream failed (faults)
  2  bad usage or configuration: one line on stderr per problem, naming the key, file or value
  3  faults: the agent cannot see all of its devices (driver not opened, not every device read
     yet, a device that does not answer): what it printed may be incomplete or out of date"""


def target(text: str) -> str:
    """An argparse type: the agent's gRPC address, HOST:PORT (an IPv6 host in brackets), port 1-65535."""
    try:
        _, port = split_host_port(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT with a port 1-65535 (an IPv6 address in brackets: [::1]:9411), got {text[:80]!r}")
    return text


def make_parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="npu-node-agent", formatter_class=formatter,
        description="Node agent for Ascend NPU training clusters: NPU fault detection through the driver, its\n"
                    "fault stream, delivery to ClusterD, metrics, and the profiling housekeeping of training jobs.",
        epilog="start with:\n  npu-node-agent demo          the whole agent on a simulated node, with scripted "
               "faults\n  npu-node-agent COMMAND -h    the options of a command\n\n" + EXIT_CODES)
    parser.add_argument("--version", action="version", version=f"npu-node-agent {__version__}",
                        help="print the version (the first line of `version`) and exit")
    log_level = {"choices": LOG_LEVELS, "metavar": "{" + ",".join(LOG_LEVELS) + "}",
                 "help": "log this much, whatever the configuration's log.level says (run, demo)"}
    parser.add_argument("--log-level", **log_level)
    # After the command as well (`run --config F --log-level debug`: a chart appends arguments); SUPPRESS keeps
    # the value given before the command when none comes after.
    log_level_after = {**log_level, "default": argparse.SUPPRESS}
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = commands.add_parser("run", help="run the agent (the DaemonSet's main process)", formatter_class=formatter,
                              description="Run the agent until SIGTERM (it stops within 10 s).", epilog=EXIT_CODES)
    run.add_argument("--config", metavar="FILE", help="YAML configuration file (every key optional; default: none, "
                                                      "all defaults)")
    run.add_argument("--log-level", **log_level_after)

    demo = commands.add_parser(
        "demo", help="the whole agent on a simulated 8-NPU node with scripted faults", formatter_class=formatter,
        description="Run the agent on a simulated 8-NPU node with scripted faults, a demo ClusterD, a demo kubelet "
                    "and a simulated training job, printing what happens (README.md, \"The demo\").")
    demo.add_argument("--duration", type=seconds(zero_ok=True), default=100.0, metavar="S",
                      help="seconds to run (0: until Ctrl-C); default 100")
    demo.add_argument("--slow-after", type=seconds(zero_ok=True), default=60.0, metavar="S",
                      help="seconds until rank 5 of the simulated training job gets 15 %% slower; default 60")
    demo.add_argument("--workdir", metavar="DIR",
                      help="where the demo writes its configuration, state and log (default: a new temp dir)")
    demo.add_argument("--log-level", **log_level_after)

    check = commands.add_parser(
        "check-config", help="validate a configuration file and the rule files it names", formatter_class=formatter,
        description="Validate a configuration file and the rule, scenario and TLS files it names. Prints "
                    "\"FILE: ok\" (exit 0), or one line per problem on stderr (exit 2), every problem at once.")
    check.add_argument("file", metavar="FILE")

    faults = commands.add_parser(
        "faults", help="show the active faults of a running agent", formatter_class=formatter,
        description="Show the active faults of a running agent, read from its fault stream (gRPC).",
        epilog="columns:\n"
               "  DEVICE   the NPU's physical id (as in Ascend910-<id>); LOGIC: the driver's logic id\n"
               "  LEVEL    the worst active fault's level, NormalNPU .. ManuallySeparateNPU (the device plugin's\n"
               "           fault types: what the cluster should do with the chip)\n"
               "  HEALTH   what the driver last said of the chip: healthy, unhealthy (any alarm), unknown (the\n"
               "           driver did not answer, or the card dropped); independent of LEVEL, which the\n"
               "           agent's rules give: a fault held by an escalation rule keeps its level on a chip\n"
               "           the driver calls healthy again\n"
               "  SINCE    when the oldest active code first occurred; CODES: each code, its own level, and\n"
               "           the rule that escalated it\n\n"
               "examples:\n"
               "  npu-node-agent faults                          the node's faulty devices, once\n"
               "  npu-node-agent faults --follow --json          then every change, one JSON object a line\n"
               "  npu-node-agent faults --target 10.0.0.7:9411   another node's agent\n\n"
               "--follow runs until interrupted (exit 0) and says on stderr when the agent stops or starts\n"
               "seeing all of its devices; without it the exit code says so (3).\n\n" + EXIT_CODES)
    faults.add_argument("--target", type=target, default="127.0.0.1:9411", metavar="HOST:PORT",
                        help="the agent's gRPC address (grpc.listen; default 127.0.0.1:9411)")
    faults.add_argument("--follow", action="store_true", help="then keep printing each change")
    faults.add_argument("--json", action="store_true", help="one JSON object per faulty device per line")
    faults.add_argument("--timeout", type=seconds(zero_ok=False), default=5.0, metavar="S",
                        help="seconds to wait for the agent (default 5)")
    faults.add_argument("--ca-file", default="", metavar="FILE", help="TLS: the CA certificates of the agent's certificate (PEM)")
    faults.add_argument("--cert-file", default="", metavar="FILE", help="TLS: this client's certificate, for an agent that asks (PEM)")
    faults.add_argument("--key-file", default="", metavar="FILE", help="TLS: the private key of --cert-file (PEM)")

    commands.add_parser("version", help="version and build information",
                        description="Print the version, the Python it runs on and whether the native extension loaded.")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    del parser  # not kept for the agent's life
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
    if args.log_level:
        config.log.level = args.log_level
    setup_logging(config.log.level, config.log.format)
    return asyncio.run(serve(config))


def cmd_demo(args) -> int:
    from agent.demo.run import run_demo

    return run_demo(args.duration, args.workdir, args.slow_after, log_level=args.log_level or "info")


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
