"""torchao's 8-bit weight-only layers (AI Toolkit's `float8` and `int8` qtypes) as torchao 0.10 runs them.

AI Toolkit (commit 27a03a91) quantizes `float8` and `int8` with torchao (toolkit/util/quantize.py
`torchao_qtypes`: Float8WeightOnlyConfig, Int8WeightOnlyConfig) and pins torchao 0.10.0
(requirements_base.txt). Its ModelConfig turns `qfloat8` into `float8` under `layer_offloading`
(toolkit/config_modules.py), and Z-Image's loader does with a training adapter (z_image.py load_model).

The weight holds what quanto's qfloat8 / qint8 hold, one byte a weight and a scale per row in the
weight's dtype (torchao's int8 also keeps an int64 zero point per row, 8 bytes a row, which this
layer leaves out), so the layer is quanto's QLinear with torchao's forward (torchao 0.10,
torchao/dtypes/floatx/float8_layout.py `_linear_fp_act_fp8_weight_impl`, uintx/plain_layout.py
`_linear_fp_act_int8_weight_impl`):

- float8: `F.linear(x, weight.dequantize(), bias)`: the codes cast to the weight's dtype, times the
  scale (quant_primitives.py `_dequantize_affine_no_dtype_check`, ZeroPointDomain.NONE), then a plain
  linear, whose autograd keeps that dequantized weight for the backward;
- int8: `torch.mm(x, codes.t().to(x.dtype))` (autograd keeps the cast weight), times the scale, plus
  the bias in place.

quanto's own linear function instead keeps the 8-bit weight and dequantizes it in the backward: inside
a recomputed block, torchao holds each layer's weight in the model's dtype until the block's backward.
"""

from __future__ import annotations

import torch
from optimum.quanto.nn import QLinear


class TorchaoLinear(QLinear):
    """quanto's 8-bit weight, torchao 0.10's weight-only forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        codes, scale = self.weight._data, self.weight._scale
        if codes.dtype == torch.int8:
            rows = torch.mm(x.reshape(-1, x.shape[-1]), codes.t().to(x.dtype))
            out = rows * scale.view(-1).to(rows.dtype)
            out = out.reshape(*x.shape[:-1], out.shape[-1])
            if self.bias is not None:
                out += self.bias.to(rows.dtype)
            return out
        weight = codes.to(scale.dtype) * scale
        return torch.nn.functional.linear(x, weight, self.bias)
