"""rlcd: calibrated typed decisions (candidate scoring on Qwen3.5 or a text decoder, the RLCD objective)."""

__version__ = "0.1.0"
