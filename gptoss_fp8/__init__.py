"""gptoss-fp8: gpt-oss MXFP4 checkpoints to block-FP8 for Hopper, with proofs."""

__version__ = "0.1.0"
