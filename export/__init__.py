"""Backbones to ONNX bundles, and the ONNX Runtime wrapper the agent uses."""
