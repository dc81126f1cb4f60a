"""``edge-agent``: the on-device ProtoFleet agent."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from edge_agent.config import AgentConfig
from edge_agent.config import load as load_config
from runtime.cliutil import (
    UsageError,
    add_example_config,
    make_parser,
    print_example_config,
    run,
)
from runtime.runlock import AlreadyRunning, RunLock, holder

if TYPE_CHECKING:
    from edge_agent.service import AgentService

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
        "version) take all of it. Put the multipliers into [privacy] of agent.toml.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p_plan.add_argument("--mechanism", choices=["dp", "dp-features"], default="dp",
                        help="default dp")  # fmt: skip
    p_plan.add_argument("--epsilon", type=float, required=True, help="total budget")
    p_plan.add_argument("--delta", type=float, default=1e-5, help="default 1e-5")
    p_plan.add_argument("--rounds", type=int, help="dp: rounds the agent will answer")
    p_plan.add_argument("--epochs", type=int, default=1, help="dp: local epochs per round (1)")
    p_plan.add_argument("--dataset-size", type=int,
                        help="dp: the public upper bound on a device's training samples")  # fmt: skip
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
        "offers and reports which ones work (a listed provider may still fall back to CPU).",
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
    add_example_config(sub, prog="edge-agent", example=EXAMPLE)
    return parser


def cmd_privacy_plan(args: argparse.Namespace) -> int:
    from edge_agent.privacy.accounting import plan, plan_features

    try:
        if args.mechanism == "dp-features":
            chosen = plan_features(epsilon_target=args.epsilon, delta=args.delta,
                                   releases=args.releases, accountant=args.accountant)  # fmt: skip
        else:
            if args.rounds is None or args.dataset_size is None:
                raise UsageError("--mechanism dp needs --rounds and --dataset-size")
            chosen = plan(
                epsilon_target=args.epsilon,
                delta=args.delta,
                rounds=args.rounds,
                epochs=args.epochs,
                dataset_size=args.dataset_size,
                batch=args.batch,
                release_share=args.release_share,
                accountant=args.accountant,
            )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    report: dict[str, object] = {"mechanism": args.mechanism}
    if args.mechanism == "dp":
        report |= {
            "sgd_noise_multiplier": round(chosen.sgd_noise_multiplier, 4),
            "dataset_size": args.dataset_size,
            "sample_rate": chosen.sample_rate,
            "sgd_steps": chosen.sgd_steps,
        }
    report |= {
        "release_noise_multiplier": round(chosen.release_noise_multiplier, 4),
        "releases": chosen.releases,
        "epsilon": round(chosen.epsilon, 4),
        "delta": chosen.delta,
        "accountant": chosen.accountant,
    }
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    import platform

    import onnxruntime as ort

    from export.probe import probe_providers
    from export.runtime import CPU

    probes = probe_providers(ort.get_available_providers())
    accelerated = [p.provider for p in probes if p.works and p.provider != CPU]
    report = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "onnxruntime": ort.__version__,
        "available": ort.get_available_providers(),
        "probes": [p.to_json() for p in probes],
        "accelerated": accelerated,
    }
    if args.engine_cache is not None and args.bundle is None:
        raise UsageError("--engine-cache applies with --bundle")
    if args.bundle is not None:
        report["bundle"] = _serving(args.bundle, args.engine_cache)
    json.dump(report, sys.stdout, indent=2)
    print()
    if args.require_gpu and not accelerated:
        print(
            "edge-agent: no GPU execution provider works here; the agent will run on the CPU",
            file=sys.stderr,
        )
        return 1
    return 0


def _serving(path: Path, engine_cache: Path | None) -> dict[str, object]:
    """Which provider serves each backbone of the bundle at ``path``, after one real
    inference (a provider can fall back at the first run, e.g. when an engine fails)."""
    from export.errors import BundleError
    from export.runtime import BackboneRuntime, RuntimeSettings

    try:
        runtime = BackboneRuntime(path, settings=RuntimeSettings(cache_dir=engine_cache))
    except BundleError as exc:
        raise UsageError(str(exc)) from exc
    return {
        "path": str(path),
        "bundle_id": runtime.bundle.id,
        "backbones": {
            m.name: {
                "precision": m.precision,
                "input_shape": list(m.input_shape),
                "served_by": runtime.active_providers[m.name][0],
                "providers": runtime.active_providers[m.name],
            }
            for m in runtime.bundle.members
        },
    }


def cmd_run(args: argparse.Namespace) -> int:
    from runtime.lifecycle import CannotServe, serve

    def make(cfg: AgentConfig) -> AgentService:
        # Imported once the configuration has loaded: torch takes seconds to import, and a
        # mistake in the file should be reported without that wait.
        from edge_agent.agent import Agent
        from edge_agent.data import DataError
        from edge_agent.service import AgentService
        from export.errors import BundleError
        from runtime.transport import load_credentials

        with contextlib.ExitStack() as taken:  # released again if the start fails
            try:
                # The broker's files first: a mistyped path is told before the backbones run.
                load_credentials(cfg.mqtt)
                taken.enter_context(RunLock.take(cfg.run_lock, what=f"agent state {cfg.state_dir}"))
                cache = cfg.data.feature_cache
                if cache is not None and not cfg.data.shared_feature_cache:
                    # A private cache drops entries it does not own: two agents on one would
                    # delete each other's features every start.
                    taken.enter_context(
                        RunLock.take(
                            cache / "run.lock",
                            what=f"feature cache {cache}",
                            remedy="stop that one first, or set [data] shared_feature_cache = "
                            "true in every agent that uses it",
                        )
                    )
                agent = Agent(cfg)
            except (AlreadyRunning, BundleError, DataError, ValueError) as exc:
                raise CannotServe(str(exc)) from exc
            agent.state.record(
                active_providers=agent.runtime.active_providers,
                backbone_samples_at_start=agent.runtime.samples_processed,
                started_at=time.time(),
            )
            held.append(taken.pop_all())
        return AgentService(agent=agent)

    def close(service: object) -> None:
        held.pop().close()  # before a reload's make(), which takes the same locks

    held: list[contextlib.ExitStack] = []
    try:
        serve(name="edge-agent", load=lambda: load_config(args.config), make=make, close=close)
    except CannotServe as exc:
        raise UsageError(str(exc)) from exc
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from edge_agent.features import FeatureCache
    from edge_agent.state import StateDir

    cfg = load_config(args.config)
    try:
        state = StateDir(cfg.state_dir, agent_id=cfg.agent_id, create=False)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    snap = state.snapshot
    report = {
        "agent_id": cfg.agent_id,
        "fleet": cfg.fleet,
        "method": cfg.method,
        # Signed messages, or the explicit choice to go without them.
        "security": "insecure" if cfg.security.insecure else "signed",
        "running_pid": holder(cfg.run_lock),  # null: no agent runs on this state
        "bundle_id": snap.bundle_id,
        "last_round": snap.last_round,
        "pending_round": snap.pending_round,
        "cache_entries": FeatureCache(cfg.data.feature_cache or state.cache_dir).entries(),
        "active_providers": snap.extra.get("active_providers"),
        "privacy": _privacy_status(cfg, snap.extra),
        # Announcements refused as no coordinator of this fleet would send them, by reason.
        "ignored_announcements": snap.extra.get("ignored_announcements", {}),
        "last_metrics": snap.history[-1] if snap.history else None,
    }
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


def _privacy_status(cfg: AgentConfig, extra: dict[str, object]) -> dict[str, object]:
    from edge_agent.privacy.ledger import Ledger, LedgerError

    p = cfg.privacy
    out: dict[str, object] = {"mechanism": p.mechanism, "epsilon_spent": None,
                              "guarantee": p.guarantee}  # fmt: skip
    if p.formal:
        try:
            ledger = Ledger(
                cfg.state_dir, epsilon_budget=p.epsilon, delta=p.delta, accountant=p.accountant
            )
        except LedgerError as exc:
            raise UsageError(str(exc)) from exc
        out |= {
            "epsilon_spent": ledger.spent(),
            "epsilon_budget": p.epsilon,
            "delta": p.delta,
            "accountant": p.accountant,
            "releases": len(ledger.spends),
            # What the ledger's past spends claim, whatever the configuration says now.
            "guarantee": ledger.guarantee if ledger.spends else p.guarantee,
            "publishing": not extra.get("privacy_exhausted", False),
        }
    return out


def _images(path: Path, size: int):  # type: ignore[no-untyped-def]
    """(name, image as 1 x 3 x H x W float) for each input image, read one at a time so
    that a folder of any size needs the memory of one image; an unreadable file is
    reported as a JSON line in its place."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    from edge_agent.data import IMAGE_SUFFIXES, to_nchw_float
    from runtime.npz import read_npz

    try:
        if path.is_file() and path.suffix == ".npz":
            x = read_npz(path, required=("x",))["x"]
            if x.ndim != 4:  # checked whole: a row's shape would misstate the file's
                raise UsageError(f"{path}: x must be 4-D (N,C,H,W or N,H,W,C), got {x.shape}")
            for i in range(len(x)):
                yield f"{path.name}[{i}]", to_nchw_float(x[i : i + 1], source=str(path))
            return
        # A folder is searched through its subfolders too: a tree of class folders, laid
        # out as for training, is a natural thing to point at.
        files = (
            sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
            if path.is_dir()
            else [path]
        )
        for file in files:
            try:
                with Image.open(file) as img:
                    rgb = np.asarray(img.convert("RGB").resize((size, size)), dtype=np.uint8)
            except (OSError, UnidentifiedImageError) as exc:
                print(json.dumps({"input": str(file), "error": f"unreadable: {exc}"}))
                continue
            yield str(file), to_nchw_float(rgb[None], source=str(file))
    except ValueError as exc:  # NpzError, or DataError for images of the wrong shape
        raise UsageError(str(exc)) from None


def _batches(images, size: int):  # type: ignore[no-untyped-def]
    """(names, images as B x 3 x H x W) of up to ``size`` consecutive images of one shape."""
    import numpy as np

    names: list[str] = []
    parts: list[np.ndarray] = []
    for name, image in images:
        if parts and (len(names) == size or image.shape[1:] != parts[0].shape[1:]):
            yield names, np.concatenate(parts)
            names, parts = [], []
        names.append(name)
        parts.append(image)
    if names:
        yield names, np.concatenate(parts)


def cmd_predict(args: argparse.Namespace) -> int:
    from edge_agent import inference
    from edge_agent.state import StateDir
    from edge_agent.train import LocalModel
    from export.errors import BundleError
    from export.runtime import BackboneRuntime

    cfg = load_config(args.config)
    if not args.input.exists():
        raise UsageError(f"no such input {args.input}")
    if args.batch < 1:
        raise UsageError(f"--batch must be at least 1, got {args.batch}")
    try:
        state = StateDir(cfg.state_dir, agent_id=cfg.agent_id, create=False)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    rule = inference.rule_of(cfg.method)
    refs = inference.stored_references(state)
    if state.load_prototypes() is None:
        raise UsageError(
            f"no prototypes in {cfg.state_dir} yet: the agent has not answered a round"
        )
    rule_name = rule.rule
    if cfg.privacy.mechanism == "dp-features":
        # The rule this device's own validation split chose (edge_agent.anchored), with
        # the model it chose (the head checkpoint): what its rounds were scored by.
        rule_name = next((h["predict_rule"] for h in reversed(state.snapshot.history)
                          if "predict_rule" in h), "classifier")  # fmt: skip
    else:
        try:
            inference.check_references(cfg.method, refs)
        except inference.MissingReference as exc:
            raise UsageError(f"{cfg.method} predicts by {rule.summary}: {exc}") from None
    try:
        runtime = BackboneRuntime(cfg.bundle, settings=cfg.runtime)
    except BundleError as exc:
        raise UsageError(str(exc)) from exc
    model = LocalModel(
        in_dim=runtime.feature_dim, num_classes=len(cfg.classes), cfg=cfg.train,
        dual=cfg.method == "feddbp",
    )  # fmt: skip
    if not state.load_model(model):
        raise UsageError(f"no head checkpoint in {cfg.state_dir} that fits this bundle")
    answered = 0
    for names, images in _batches(_images(args.input, cfg.data.image_size), args.batch):
        start = time.perf_counter()
        outputs = inference.outputs_of(model, runtime.extract(images))
        # The function the simulated fleet scores this device with.
        chosen = inference.RULES[rule_name](outputs, refs)
        latency = (time.perf_counter() - start) * 1e3 / len(names)
        for i, name in enumerate(names):
            print(
                json.dumps(
                    {
                        "input": name,
                        "class": cfg.classes[int(chosen.classes[i])],
                        "score": round(float(chosen.scores[i]), 5),
                        "rule": rule_name,
                        "latency_ms": round(latency, 3),
                    }
                )
            )
        answered += len(names)
    if not answered:
        raise UsageError(f"no readable images in {args.input}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(
        build_parser(),
        argv,
        handlers={
            "example-config": print_example_config,
            "run": cmd_run,
            "status": cmd_status,
            "predict": cmd_predict,
            "doctor": cmd_doctor,
            "privacy-plan": cmd_privacy_plan,
        },
    )
