"""Test set-up: run Triton kernels in the interpreter when there is no CUDA device.

This must happen before any module defining kernels is imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("ENGINE_DEBUG", "1")
