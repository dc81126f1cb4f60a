"""Rewrites of an exported ONNX graph that leave its arithmetic unchanged.

Only one so far: a zero ``Pad`` in front of a ``Conv`` moves into the Conv's ``pads``
attribute. Torch has no asymmetric convolution padding, so TensorFlow "SAME" layers
(EfficientNet-Lite's stride-2 convolutions) export as Pad + Conv, with the pad amounts
computed by a chain of shape nodes that ONNX Runtime does not fuse. Left in place, each
Pad copies a full activation in fp32 and breaks ONNX Runtime's blocked fp32 layout; in a
quantized model it also becomes a dequantize, float Pad, quantize detour on the largest
activations of the network (a third of the int8 time).
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator


def _constant(graph: onnx.GraphProto, name: str) -> np.ndarray | None:
    """The value of tensor ``name`` when it depends on no graph input, else None."""
    inits = {t.name: t for t in graph.initializer}
    if name in inits:
        return numpy_helper.to_array(inits[name])
    producer = {o: n for n in graph.node for o in n.output}
    needed: list[onnx.NodeProto] = []
    stack, seen = [name], set()
    while stack:
        tensor = stack.pop()
        if tensor in seen or tensor == "" or tensor in inits:
            continue
        seen.add(tensor)
        node = producer.get(tensor)
        if node is None:  # a graph input
            return None
        needed.append(node)
        stack.extend(node.input)
    order = [n for n in graph.node if any(n is m for m in needed)]
    used = {i for n in order for i in n.input}
    sub = onnx.helper.make_graph(
        order,
        "constant",
        [],
        [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.UNDEFINED, None)],
        [t for t in graph.initializer if t.name in used],
    )
    # run() with no output names returns the list of outputs (typed as a union upstream)
    values = cast(list[Any], ReferenceEvaluator(onnx.helper.make_model(sub)).run(None, {}))
    return np.asarray(values[0])


def _attribute(node: onnx.NodeProto, name: str) -> onnx.AttributeProto | None:
    return next((a for a in node.attribute if a.name == name), None)


def fold_pads_into_convs(model: onnx.ModelProto) -> int:
    """Move every constant zero Pad that feeds only a Conv into that Conv's ``pads``
    (spatial axes only), drop what only computed the pad amounts; returns how many."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    folded = 0
    for pad in [n for n in graph.node if n.op_type == "Pad"]:
        readers = [n for n in graph.node if pad.output[0] in n.input]
        mode = _attribute(pad, "mode")
        if (
            len(readers) != 1
            or readers[0].op_type != "Conv"
            or readers[0].input[0] != pad.output[0]
            or pad.output[0] in outputs
            or (mode is not None and mode.s != b"constant")
            or len(pad.input) > 3  # an axes input
        ):
            continue
        conv = readers[0]
        auto = _attribute(conv, "auto_pad")
        if auto is not None and auto.s not in (b"", b"NOTSET"):
            continue
        amounts = _constant(graph, pad.input[1])
        if amounts is None:
            continue
        if len(pad.input) > 2 and pad.input[2]:
            value = _constant(graph, pad.input[2])
            if value is None or np.any(value != 0):
                continue
        rank = len(amounts) // 2
        before, after = amounts[:rank], amounts[rank:]
        # Only spatial, non-negative padding has a Conv equivalent.
        if np.any(amounts < 0) or np.any(before[:2]) or np.any(after[:2]):
            continue
        current = _attribute(conv, "pads")
        spatial = rank - 2
        old = list(current.ints) if current is not None else [0] * (2 * spatial)
        new = [int(v) for v in np.concatenate([before[2:], after[2:]])]
        merged = [a + b for a, b in zip(old, new, strict=True)]
        if current is not None:
            conv.attribute.remove(current)
        conv.attribute.append(onnx.helper.make_attribute("pads", merged))
        conv.input[0] = pad.input[0]
        graph.node.remove(pad)
        folded += 1
    if folded:
        _prune(graph)
    return folded


def _prune(graph: onnx.GraphProto) -> None:
    """Drop nodes and initializers nothing reads any more."""
    live = {o.name for o in graph.output}
    keep: list[onnx.NodeProto] = []
    for node in reversed(list(graph.node)):
        if any(o in live for o in node.output):
            keep.append(node)
            live.update(node.input)
    del graph.node[:]
    graph.node.extend(reversed(keep))
    unused = [t for t in graph.initializer if t.name not in live]
    for t in unused:
        graph.initializer.remove(t)
