"""The aggregation service. Imports numpy and the protocol only (no torch)."""
