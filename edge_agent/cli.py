"""``edge-agent``: the on-device ProtoFleet agent's command line.

This module parses it; each subcommand's work lives in its own module of
:mod:`edge_agent.commands`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from edge_agent.commands import doctor, predict, privacy_plan, run, status
from edge_agent.config import AgentConfig
from runtime.cliutil import add_example_config, make_parser, print_example_config
from runtime.cliutil import run as run_command

EXAMPLE = Path(__file__).resolve().parent / "agent.toml"


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser(
        "edge-agent",
        "Train a projection head on private data on this device and publish class\n"
        "prototypes to a ProtoFleet coordinator over MQTT. Raw data and weights never\n"
        "leave the device.",
        epilog="Configuration: a TOML file; `edge-agent example-config` prints one with every key.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p_run = sub.add_parser("run", help="connect to the broker and answer rounds until stopped")
    p_run.add_argument("--config", "-c", type=Path, required=True, help="agent TOML file")
    p_status = sub.add_parser("status", help="print this agent's state as JSON")
    p_status.add_argument("--config", "-c", type=Path, required=True, help="agent TOML file")
    p_predict = sub.add_parser(
        "predict",
        help="classify images by the method's inference rule, as the fleet scores it; JSON lines",
    )
    p_predict.add_argument("--config", "-c", type=Path, required=True, help="agent TOML file")
    p_predict.add_argument(
        "input",
        type=Path,
        help="an image, a folder of images (subfolders included), or an .npz with x",
    )
    p_predict.add_argument(
        "--batch",
        type=int,
        default=256,
        help="images per forward pass (default 256, as the feature cache extracts them); "
        "latency_ms is the pass's time per image: --batch 1 for one image's latency",
    )
    p_plan = sub.add_parser(
        "privacy-plan",
        help="choose DP noise multipliers for an (epsilon, delta) budget; JSON",
        description="Noise multipliers that spend --epsilon at --delta over the device's life,\n"
        "from public settings only (never from the data a device holds).\n\n"
        "dp: the releases (one per round) take --release-share of the budget, DP-SGD the\n"
        "rest; needs --rounds and --dataset-size (the bound also set as\n"
        "privacy.dataset_size). dp-features: --releases Gaussian releases (one per data\n"
        "version) take all of it. Put the multipliers into [privacy] of agent.toml.\n"
        "secure: the projection k for [closed_form] dim of a secure fleet, by the public\n"
        "rule (docs/privacy.md): needs --devices, --dataset-size, --classes, --quorum and\n"
        "--colluding, the fleet's [secure_aggregation] settings.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p_plan.add_argument("--mechanism", choices=["dp", "dp-features", "secure"], default="dp",
                        help="default dp")  # fmt: skip
    for flag, what in (
        ("--devices", "the fleet's devices"),
        ("--classes", "the classes"),
        ("--quorum", "T, the fewest survivors"),
        ("--colluding", "c"),
        ("--features", "the backbone's feature size (k stays below it)"),
    ):
        p_plan.add_argument(flag, type=int, help=f"secure: {what}")  # fmt: skip
    p_plan.add_argument("--basis", action="store_true",
                        help="secure: the fleet takes its statistics in a public basis "
                             "([closed_form] basis), whose rule has its own ratio")  # fmt: skip
    p_plan.add_argument("--epsilon", type=float, required=True, help="total budget")
    p_plan.add_argument("--delta", type=float, default=1e-5, help="default 1e-5")
    p_plan.add_argument("--rounds", type=int, help="dp: rounds the agent will answer")
    p_plan.add_argument("--epochs", type=int, default=1, help="dp: local epochs per round (1)")
    p_plan.add_argument("--dataset-size", type=int,
                        help="dp, secure: the public bound on a device's training samples")  # fmt: skip
    p_plan.add_argument("--releases", type=int, default=1,
                        help="dp-features: data versions the budget covers (default 1)")  # fmt: skip
    p_plan.add_argument("--batch", type=int, default=32, help="dp: expected batch size (32)")
    p_plan.add_argument(
        "--release-share", type=float, default=0.2, help="budget share of the releases (0.2)"
    )
    p_plan.add_argument("--accountant", choices=["rdp", "prv"], default="rdp")
    p_doctor = sub.add_parser(
        "doctor",
        help="check which ONNX Runtime execution providers really run here; JSON",
        description="Runs one inference with each execution provider this onnxruntime build\n"
        "offers and reports which ones work (a listed provider may still fall back to CPU).\n"
        "With --bundle, a backbone that runs in fp16 is checked against its fp32 features;\n"
        "exit status 1 when an fp16 backbone is refused (or with --require-gpu, no GPU).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p_doctor.add_argument(
        "--require-gpu",
        action="store_true",
        help="exit with status 1 unless the CUDA or TensorRT provider works",
    )
    p_doctor.add_argument(
        "--bundle",
        type=Path,
        help="also open this bundle's backbones as the agent does and report the provider "
        "that serves each (on a Jetson the first TensorRT run builds its engines: minutes)",
    )
    p_doctor.add_argument(
        "--engine-cache",
        type=Path,
        metavar="DIR",
        help="with --bundle: keep TensorRT engines here (the agent keeps them in its state "
        "directory's providers/ folder; point at it to build them before the agent starts)",
    )
    p_doctor.add_argument(
        "--refresh",
        type=Path,
        metavar="DIR",
        help="keep this probe in DIR, replacing the one the agent probed and kept there "
        "(the agent's <state_dir>/providers; it probes once per onnxruntime build and "
        "machine, and again after this)",
    )
    add_example_config(sub, prog="edge-agent", example=EXAMPLE, config=AgentConfig)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(
        build_parser(),
        argv,
        handlers={
            "example-config": print_example_config,
            "run": run.cmd_run,
            "status": status.cmd_status,
            "predict": predict.cmd_predict,
            "doctor": doctor.cmd_doctor,
            "privacy-plan": privacy_plan.cmd_privacy_plan,
        },
    )
