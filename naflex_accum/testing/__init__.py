"""Helpers for checking accumulation steps: reference bugs and tasks that stress the task protocol.

Nothing here runs in training; the tests, the benchmarks and ``naflex-accum verify --step`` import it.
"""
