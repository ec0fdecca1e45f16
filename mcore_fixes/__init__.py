"""mcore-fixes: an upstreamable patch series for NVIDIA Megatron-Core, and the tool that applies it."""

__version__ = "0.1.0"
