"""disagg: disaggregated prefill/decode LLM serving, simulated and real."""

__version__ = "0.1.0"
