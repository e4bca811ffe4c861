"""Capacity planning: memory budget, a calibrated performance model, and a simulation that drives
the engine's own scheduler."""
