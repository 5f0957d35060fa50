"""vtoken: token-level KV virtualization (the vToken substrate) and KV-eviction diagnostics."""

__version__ = "0.1.0"
