"""Decode steps run as graphs: a batch padded to one of a few sizes, each size built once.

A decode step of a small model is hundreds of small ops, and on either device most of their time
is the fixed cost of launching each one. vLLM removes it by recording the step once per batch
size and replaying the record: CUDA graphs in v0.4 (``CUDAGraphRunner``), ``torch.compile`` with
piecewise CUDA graphs in V1. Batches are padded up to a handful of sizes so that a few records
cover every batch. ``sizes`` has the sizes and the padding rule, ``compiled`` the CPU's version
(``torch.compile``, attention an opaque op), ``cuda`` the GPU's (``torch.cuda.CUDAGraph`` over
static buffers). Chapter 11 teaches them.
"""
