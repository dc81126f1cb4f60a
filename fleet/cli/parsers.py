"""The command lines of ``edge-fleet run``, ``compare`` and ``demo``, and the options they
share with ``privacy``: data, federation, backbone, transport, output. What they mean,
resolved and checked, is :mod:`fleet.cli.options`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from coordinator.downlink import DEFAULT_BUDGET
from edge_agent.methods import CORE, METHODS
from fleet.data.bundles import BACKBONES
from fleet.data.partition import SPLITS
from fleet.transports.protocols import PROTOCOLS
from fleet.transports.spec import DEFAULT_STATS_DIM, TRANSPORTS
from runtime.settings import parse_value

DATA_HELP = """data:
  digits-5 (default) is built locally from scikit-learn's bundled digits and photos.
  --data FILE.npz   train_x_<i>, train_y_<i>, test_x_<i>, test_y_<i> (x uint8 or float32
                    in N,3,H,W; y integers) and optionally domain_<i>, for clients 0..N-1
  --data DIR        DIR/<client>/train/<class>/*, DIR/<client>/test/<class>/* (one
                    client per folder), or DIR/<domain>/<class>/* (Digit-5, Office-10,
                    DomainNet laid out as folders: one client per domain, 30% for testing)
"""


def downlink_budget(text: str) -> int:
    """``--downlink-budget``: bytes, or ``exact`` (0) for every local set."""
    if text.strip().lower() == "exact":
        return 0
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes or 'exact', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 bytes (0: exact), got {value}")
    return value


class TrainParams(argparse.Action):
    """``--train-param KEY=VALUE``, repeatable, gathered into one dict."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        key, sep, raw = str(values).partition("=")
        key = key.strip()
        if not sep or not key:
            parser.error(f"{option_string} expects KEY=VALUE, got {values!r}")
        if key in ("out_dim", "epochs"):
            parser.error(f"{option_string} {key}: use --{key.replace('_', '-')}")
        # A copy: argparse hands every parse the same default dict.
        params = {**getattr(namespace, self.dest), key: parse_value(raw.strip())}
        setattr(namespace, self.dest, params)


def add_common_options(
    parser: argparse.ArgumentParser,
    *,
    rounds: int,
    clients: int,
    out: str,
    one_split: bool = True,
    sharded: bool = False,
    secure: bool = False,
    transport_help: str | None = None,
) -> None:
    """The data, federation and output options. ``one_split=False`` hides ``--split`` from
    the help of a command that sweeps several (it still parses, to be refused by name).
    ``sharded`` offers ``--coordinator-workers``, to commands whose every method may run
    over the worker tier (not ``privacy``, whose floor, solo, has no server step).
    ``secure`` offers ``--secure-aggregation`` with its ``--epsilon`` and ``--delta`` (not
    to ``privacy``, which sweeps epsilons and compares the aggregations itself).
    ``transport_help``: ``--transport``'s help, for a command whose transports differ
    from a run's (``privacy``)."""
    data = parser.add_argument_group("data")
    data.add_argument("--data", type=Path, help="an .npz of clients or a folder (see below)")
    # The digits-5 options default to None so that one given with --data, where it would
    # be ignored, can be told from a default (see fleet.cli.options.resolve_data).
    data.add_argument("--split", choices=SPLITS,
                      help="digits-5 non-IID setting (default feature)" if one_split
                      else argparse.SUPPRESS)  # fmt: skip
    data.add_argument("--clients", type=int,
                      help=f"digits-5 clients (default {clients})")  # fmt: skip
    data.add_argument("--alpha", type=float,
                      help="Dirichlet alpha of the label splits (default 0.5)")  # fmt: skip
    data.add_argument("--domain",
                      help="digits-5 domain of the label split (default clean)")  # fmt: skip
    data.add_argument("--train", type=int,
                      help="digits-5 training images per client (default 100)")  # fmt: skip
    data.add_argument("--test", type=int,
                      help="digits-5 test images per client (default 100)")  # fmt: skip
    parser.set_defaults(digits5_defaults={"split": "feature", "clients": clients, "alpha": 0.5,
                                          "domain": "clean", "train": 100, "test": 100})  # fmt: skip
    data.add_argument("--image-size", type=int,
                      help="side that --data folder images are resized to (default 32; 224 "
                           "with --backbone effnet-lite0)")  # fmt: skip
    fl = parser.add_argument_group("federation")
    fl.add_argument("--rounds", type=int, default=rounds, help=f"rounds (default {rounds})")
    fl.add_argument("--epochs", type=int, default=1, help="local epochs per round (default 1)")
    fl.add_argument("--out-dim", type=int, default=256, help="projection head size (default 256)")
    fl.add_argument("--protocol", choices=list(PROTOCOLS), default="fair",
                    help="fair (default): every method with a classifier has a plain linear "
                         "one; paper: the bounded classifier of FedPCL's released code for "
                         "every method that has one (docs/fleet.md)")  # fmt: skip
    fl.add_argument("--train-param", action=TrainParams, default={}, metavar="KEY=VALUE",
                    help="any other key of the agents' [train] table (edge-agent example-config) "
                         "for every method, over the protocol's settings, e.g. tau=0.2, "
                         "fpl_tau=0.07, lr=1e-4, norm=group; repeatable")  # fmt: skip
    fl.add_argument("--downlink-budget", type=downlink_budget, default=DEFAULT_BUDGET,
                    metavar="BYTES",
                    help="the coordinator's [model] downlink_budget: the most bytes of a round "
                         "announcement; past it FedPCL sends a seeded uniform sample of the "
                         "clients' local sets, as many as fit (docs/fleet.md). 0 or 'exact': "
                         f"every set, however large (default {DEFAULT_BUDGET})")  # fmt: skip
    fl.add_argument("--stats-dim", type=int, default=DEFAULT_STATS_DIM, metavar="K",
                    help="lda, ridge, fedcof: the public random projection of the backbone "
                         "features their statistics are taken in (the agents' [closed_form] "
                         "dim); 0 keeps every feature, whose second moment grows as the "
                         f"square (docs/fleet.md) (default {DEFAULT_STATS_DIM})")  # fmt: skip
    fl.add_argument("--stats-basis", action="store_true",
                    help="lda, ridge, fedcof: take their statistics in the bundle's public "
                         "whitening basis (its basis.npy, written by edge-export basis if "
                         "missing) instead of the random projection: lda's private release "
                         "kept far more in it (docs/privacy.md)")  # fmt: skip
    fl.add_argument("--bundle", type=Path,
                    help="backbone bundle; --backbone is built there if missing (default runs/BACKBONE)")  # fmt: skip
    fl.add_argument("--backbone", choices=list(BACKBONES),
                    help="what a missing --bundle is built as: zoo (three glyph-pretrained "
                         "backbones, 32x32, 896-d), zoo-fontdigits (its 192-d digit CNN "
                         "alone: heads a quarter the size, for fleets of 10,000) or "
                         "effnet-lite0 (ImageNet EfficientNet-Lite0, images resized to 224; the "
                         "imagenet extra) (default zoo)")  # fmt: skip
    fl.add_argument("--zoo-size", choices=["small", "full"], default="full",
                    help="zoo to build when --bundle is missing (default full, ~5 min once)")  # fmt: skip
    tr = parser.add_argument_group("transport")
    tr.add_argument("--transport", choices=TRANSPORTS, default="mqtt",
                    help=transport_help or
                         "mqtt: broker + processes; memory: one process, no broker; vector: every "
                         "client trained as one batched computation (fedpcl, fedproto, solo, "
                         "fedavg without a privacy mechanism; lda, ridge, fedcof also with "
                         "dp-features; no --resume), for fleets of thousands "
                         "(default mqtt)")  # fmt: skip
    tr.add_argument("--broker", help="external broker mqtt://host:port (default: start one)")
    tr.add_argument("--workers", type=int,
                    help="worker processes hosting the agents over mqtt (default 2)")  # fmt: skip
    if sharded:
        tr.add_argument("--coordinator-workers", type=int, metavar="N",
                        help="mqtt: run the coordinator sharded, as the round owner over N "
                             "edge-coordinator worker processes on a shared subscription, for "
                             "the methods whose aggregation splits (fedpcl then announces no "
                             "local sets; docs/fleet.md) (default: the single coordinator)")  # fmt: skip
    if secure:
        add_secure_options(parser)
    parser.add_argument(
        "--out", type=Path, default=Path(out), help=f"report folder (default {out})"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the newest sweep under --out after a crash or Ctrl-C: runs that "
        "finished are read back, the others run again from round 0",
    )


def add_secure_options(parser: argparse.ArgumentParser) -> None:
    """``--secure-aggregation`` and the budget of its noise (fleet/transports/secure.py)."""
    group = parser.add_argument_group("secure aggregation")
    group.add_argument("--secure-aggregation", action="store_true",
                       help="lda, ridge: the devices' statistics reach the coordinator only "
                            "inside the fleet's secure sum (mqtt: the protocol itself, "
                            "--rounds 1 or 2; vector: its sum simulated); fedproto: its "
                            "prototypes, over mqtt, without noise (docs/fleet.md)")  # fmt: skip
    group.add_argument("--epsilon", type=float,
                       help="with --secure-aggregation: the (epsilon, delta) the sum's "
                            "distributed noise spends over the whole run (default: no noise, "
                            "the exact sum)")  # fmt: skip
    group.add_argument("--delta", type=float, default=1e-5,
                       help="with --epsilon (default 1e-5)")  # fmt: skip


def add_parsers(sub: Any) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p_run = sub.add_parser("run", help="run one method over a simulated fleet and report",
                           description="Run R rounds of one method over N agents.",
                           epilog=DATA_HELP, formatter_class=fmt)  # fmt: skip
    p_run.add_argument("--method", choices=METHODS, default=CORE, help=f"default {CORE}")
    p_run.add_argument("--seed", type=int, default=0)
    add_common_options(p_run, rounds=30, clients=5, out="runs/fleet", sharded=True, secure=True)

    p_cmp = sub.add_parser("compare", help="several methods x seeds on the same partitions",
                           description="Every method and seed on the same bundle and partitions.",
                           epilog=DATA_HELP, formatter_class=fmt)  # fmt: skip
    p_cmp.add_argument("--methods", default=",".join(METHODS),
                       help=f"comma-separated (default {','.join(METHODS)})")  # fmt: skip
    p_cmp.add_argument("--seeds", default="0,1,2", help="comma-separated (default 0,1,2)")
    add_common_options(p_cmp, rounds=30, clients=5, out="runs/compare", sharded=True,
                       secure=True)  # fmt: skip

    p_demo = sub.add_parser("demo", help="what `make demo` runs: solo, fedavg, fedproto, "
                            "fedpcl and lda on 5 feature-shifted devices over MQTT",
                            description="The feature-shift comparison of solo, fedavg, fedproto, "
                            "fedpcl and lda with 5 devices over a private Mosquitto.")  # fmt: skip
    p_demo.add_argument("--seeds", default="0", help="comma-separated (default 0)")
    p_demo.add_argument("--methods", default="solo,fedavg,fedproto,fedpcl,lda")
    add_common_options(p_demo, rounds=30, clients=5, out="runs/demo", sharded=True, secure=True)
