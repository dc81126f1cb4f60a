"""The subcommands of ``edge-agent``, one module each; edge_agent.cli parses the command
line and hands each its arguments. Each imports torch and onnxruntime only when it runs,
so ``--help`` and a usage error answer at once."""
