"""Cross-framework parity tests: the same inputs (tests/parity/inputs.py) through the torch core and each adapter."""
