"""Test support any backend can use: a conformance suite, a controllable fake backend, a reference model."""
