"""Conformance suite: every backend against the float64 reference."""
