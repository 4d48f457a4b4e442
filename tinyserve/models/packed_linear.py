"""Linear layers on weights packed once for the CPU's matrix units (oneDNN), as an opaque op.

``F.linear`` hands oneDNN a plain row-major weight on every call, and oneDNN rearranges it into
the blocked layout its bf16 kernels (AVX-512 BF16, AMX) read: at a decode step's few rows that
rearranging costs as much as the multiply. Packing each weight once, at start-up, and calling
oneDNN's linear on the packed copy halves a batch-16 projection on the book's machine
(``benchmarks/profile_step.py`` measures it). vLLM's CPU backend does the same with oneDNN
matmul handles made once per layer.

A packed weight is an opaque oneDNN tensor that ``torch.compile`` cannot trace, so the call is
registered as a custom op taking a *handle* (an index into this module's table) rather than
the tensor: a compiled graph sees ``packed_linear(x, handle)`` with a known output shape and
fuses everything around it. Only bf16 weights on a CPU whose oneDNN has bf16 kernels are
packed; elsewhere ``pack_linears`` packs nothing and every layer stays ``F.linear``.
"""

from __future__ import annotations

import torch
from torch import nn

# handle -> (packed weight, bias or None, out_features); entries live as long as the process,
# like the model they belong to (an engine's model is never unloaded mid-run).
_TABLE: list[tuple[torch.Tensor, torch.Tensor | None, int]] = []


def packing_supported(weight: torch.Tensor) -> bool:
    """True where oneDNN can pack this weight: bf16, on a CPU with bf16 kernels."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> int:
    """Pack ``weight [out, in]`` once; the handle ``packed_linear`` takes."""
    # The batch-size hint only tunes the blocking; one packing serves every batch size.
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)
    _TABLE.append((packed, None if bias is None else bias.detach(), weight.shape[0]))
    return len(_TABLE) - 1


@torch.library.custom_op("tinyserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    """``x W^T + b`` with the weight packed under ``handle``."""
    weight, bias, _ = _TABLE[handle]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@packed_linear.register_fake
def _(x, handle):
    return x.new_empty((*x.shape[:-1], _TABLE[handle][2]))


def pack_linears(model: nn.Module) -> int:
    """Pack every ``Linear`` of ``model`` that has a ``packed`` slot (see ``models.llama.Linear``)
    and the model's LM head; returns the bytes of the packed copies (0 where packing is not
    supported). The plain weights stay: prefill, tests and ``load_weights`` use them. Loading
    new weights afterwards needs packing again."""
    total = 0
    for module in model.modules():
        if hasattr(module, "packed") and packing_supported(module.weight):
            module.packed = pack(module.weight, module.bias)
            total += module.weight.numel() * module.weight.element_size()
    head = getattr(model, "head_weight", None)
    if head is not None and packing_supported(head):
        model.packed_head = pack(head)
        total += head.numel() * head.element_size()
    return total
