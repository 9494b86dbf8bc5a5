"""Triton kernels, each with a PyTorch autograd wrapper and its reference math."""
