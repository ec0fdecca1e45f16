"""mcore-fixes: an upstreamable patch series for NVIDIA Megatron-Core, and its tool."""

__version__ = "0.1.0"
