"""A coordinator's rounds: one cycle (cycle.py) whose result comes from a plugged-in tally
(tally.py; stored.py, secure.py), and the single coordinator's driver of it (manager.py)."""

from coordinator.rounds.manager import RoundManager

__all__ = ["RoundManager"]
