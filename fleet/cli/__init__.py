"""The `edge-fleet` command: its subcommands, shared options, progress and resumable sweeps."""
