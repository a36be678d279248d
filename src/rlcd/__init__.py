"""rlcd: calibrated typed decisions with Qwen3.5 candidate scoring and the RLCD objective."""

__version__ = "0.1.0"
