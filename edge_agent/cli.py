"""``edge-agent``: the on-device ProtoFleet agent."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from edge_agent.config import load as load_config
from protocol.cliutil import UsageError, make_parser, run

EXAMPLE = Path(__file__).resolve().parent.parent / "docs" / "agent.toml"


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser(
        "edge-agent",
        "Train a projection head on private data on this device and publish class\n"
        "prototypes to a ProtoFleet coordinator over MQTT. Raw data and weights never\n"
        "leave the device.",
        epilog="Configuration: a TOML file; see docs/agent.toml for every key.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p_run = sub.add_parser("run", help="connect to the broker and answer rounds until stopped")
    p_run.add_argument("--config", "-c", type=Path, required=True, help="agent TOML file")
    p_status = sub.add_parser("status", help="print this agent's state as JSON")
    p_status.add_argument("--config", "-c", type=Path, required=True, help="agent TOML file")
    p_predict = sub.add_parser(
        "predict", help="classify images with the local prototypes; JSON lines"
    )
    p_predict.add_argument("--config", "-c", type=Path, required=True, help="agent TOML file")
    p_predict.add_argument(
        "input", type=Path, help="an image, a folder of images, or an .npz with x"
    )
    return parser


def cmd_run(args: argparse.Namespace) -> int:
    from edge_agent.agent import Agent
    from edge_agent.data import DataError
    from edge_agent.service import AgentService
    from export.errors import BundleError

    cfg = load_config(args.config)
    try:
        agent = Agent(cfg)
    except (BundleError, DataError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    agent.state.record(
        active_providers=agent.runtime.active_providers,
        backbone_samples_at_start=agent.runtime.samples_processed,
        started_at=time.time(),
    )
    service = AgentService(agent=agent)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        service.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    service.run()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from edge_agent.features import FeatureCache
    from edge_agent.state import StateDir

    cfg = load_config(args.config)
    try:
        state = StateDir(cfg.state_dir, agent_id=cfg.agent_id)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    snap = state.snapshot
    report = {
        "agent_id": cfg.agent_id,
        "fleet": cfg.fleet,
        "method": cfg.method,
        "bundle_id": snap.bundle_id,
        "last_round": snap.last_round,
        "pending_round": snap.pending_round,
        "cache_entries": FeatureCache(state.cache_dir).entries(),
        "active_providers": snap.extra.get("active_providers"),
        "privacy": {"mechanism": "none", "epsilon_spent": None},
        "last_metrics": snap.history[-1] if snap.history else None,
    }
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


def _images(path: Path, size: int):  # type: ignore[no-untyped-def]
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    from edge_agent.data import IMAGE_SUFFIXES, DataError, to_nchw_float

    if path.is_file() and path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as data:
                return [f"{path.name}[{i}]" for i in range(len(data["x"]))], to_nchw_float(
                    data["x"], source=str(path)
                )
        except (OSError, KeyError, ValueError) as exc:
            raise UsageError(f"cannot read {path}: {exc}") from exc
    files = (
        sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if path.is_dir()
        else [path]
    )
    names, arrays = [], []
    for file in files:
        try:
            with Image.open(file) as img:
                arrays.append(np.asarray(img.convert("RGB").resize((size, size)), dtype=np.uint8))
                names.append(str(file))
        except (OSError, UnidentifiedImageError) as exc:
            print(json.dumps({"input": str(file), "error": f"unreadable: {exc}"}))
    if not arrays:
        raise UsageError(f"no readable images in {path}")
    try:
        return names, to_nchw_float(np.stack(arrays), source=str(path))
    except DataError as exc:
        raise UsageError(str(exc)) from exc


def cmd_predict(args: argparse.Namespace) -> int:
    import torch

    from edge_agent.head import predict
    from edge_agent.state import StateDir
    from edge_agent.train import LocalModel, embed
    from export.errors import BundleError
    from export.runtime import BackboneRuntime

    cfg = load_config(args.config)
    if not args.input.exists():
        raise UsageError(f"no such input {args.input}")
    state = StateDir(cfg.state_dir, agent_id=cfg.agent_id)
    loaded = state.load_prototypes()
    if loaded is None:
        raise UsageError(
            f"no prototypes in {cfg.state_dir} yet: the agent has not answered a round"
        )
    protos, counts = loaded
    try:
        runtime = BackboneRuntime(cfg.bundle, settings=cfg.runtime)
    except BundleError as exc:
        raise UsageError(str(exc)) from exc
    model = LocalModel(in_dim=runtime.feature_dim, num_classes=len(cfg.classes), cfg=cfg.train)
    if not state.load_model(model):
        raise UsageError(f"no head checkpoint in {cfg.state_dir} that fits this bundle")
    names, images = _images(args.input, cfg.data.image_size)
    present = torch.from_numpy(counts > 0)
    for name, image in zip(names, images, strict=True):
        start = time.perf_counter()
        z, _ = embed(model, runtime.extract(image[None]))
        cls, score = predict(torch.from_numpy(z), torch.from_numpy(protos), present)
        latency = (time.perf_counter() - start) * 1e3
        print(
            json.dumps(
                {
                    "input": name,
                    "class": cfg.classes[int(cls[0])],
                    "score": round(float(score[0]), 5),
                    "latency_ms": round(latency, 3),
                }
            )
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(
        build_parser(),
        argv,
        handlers={"run": cmd_run, "status": cmd_status, "predict": cmd_predict},
    )
