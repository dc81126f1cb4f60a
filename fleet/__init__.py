"""Simulated fleets on one machine: broker, data, runs, reports."""
