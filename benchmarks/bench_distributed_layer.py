"""Time one DeepSeek-V3-shaped decoder layer on this machine, for the wall-time estimates of docs/distributed.md.

The layer has DeepSeek-V3's shapes (hidden 7168, MLA attention with its ranks and 128 heads, experts of 2048, top-8
routing and one shared expert) but ``--experts`` routed experts instead of 256: a token's compute (8 routed experts,
the shared one, attention) is the real layer's, only the weight bytes are smaller. It prints, as JSON: the layer's
forward time per token, with and without an amax hook on every Linear (what calibration adds), the achieved FLOP
rate, and the real layer's weight bytes::

    python benchmarks/bench_distributed_layer.py --tokens 256 --experts 8 --repeats 1
    python benchmarks/bench_distributed_layer.py --gemms --tokens 512 --repeats 3

``--gemms`` times the same FLOPs as plain GEMMs of the layer's shapes (fp32 and bf16), with and without an amax of
every input and output: the rate the hardware gives, without the module's routing and dispatch.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn


def _config(experts: int):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(num_hidden_layers=1, first_k_dense_replace=0, n_routed_experts=experts, n_group=1,
                            topk_group=1, num_experts_per_tok=8, vocab_size=1024)


def _real_layer_bytes(dtype_bytes: int = 2) -> dict[str, int]:
    """Weight bytes of a real DeepSeek-V3 MoE layer (256 experts), from the same config's shapes."""
    c = _config(256)
    expert = 3 * c.hidden_size * c.moe_intermediate_size
    heads = c.num_attention_heads
    attention = (c.hidden_size * c.q_lora_rank + c.q_lora_rank * heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
                 + c.hidden_size * (c.kv_lora_rank + c.qk_rope_head_dim)
                 + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim) + heads * c.v_head_dim * c.hidden_size)
    params = 256 * expert + expert + attention + 256 * c.hidden_size
    return {"params": params, "bytes": params * dtype_bytes, "flops_per_token": 2 * (9 * expert + attention)}


def _time(layer: nn.Module, hidden: torch.Tensor, position: tuple, repeats: int) -> float:
    with torch.no_grad():
        warm = hidden[:, :16]
        layer(warm, position_embeddings=tuple(p[:, :16] for p in position), attention_mask=None)  # first-call costs
        started = time.perf_counter()
        for _ in range(repeats):
            layer(hidden, position_embeddings=position, attention_mask=None)
    return (time.perf_counter() - started) / repeats


def _gemms(tokens: int, dtype: torch.dtype, repeats: int, amax: bool) -> float:
    """Seconds for one token block through the layer's projections: MLA's five, and nine expert MLPs (eight routed,
    one shared; one expert's weights stand for each, the FLOPs are the same), with an amax of every input and
    output when ``amax`` (what the calibration's hooks add). Attention scores are left out."""
    c = _config(256)
    heads, qk = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    shapes = [(c.hidden_size, c.q_lora_rank), (c.q_lora_rank, heads * qk),
              (c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim),
              (c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim)), (heads * c.v_head_dim, c.hidden_size)]
    weights = [torch.randn(n, k, dtype=dtype) * 0.02 for k, n in shapes]
    gate, up = (torch.randn(c.moe_intermediate_size, c.hidden_size, dtype=dtype) * 0.02 for _ in range(2))
    down = torch.randn(c.hidden_size, c.moe_intermediate_size, dtype=dtype) * 0.02
    inputs = {k: torch.randn(tokens, k, dtype=dtype) for k, _ in shapes}
    x = torch.randn(tokens, c.hidden_size, dtype=dtype)
    seen = []

    def linear(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(a, w)
        if amax:
            seen.append(torch.stack([a.abs().amax().float(), out.abs().amax().float()]))
        return out

    def once() -> None:
        for (k, _), w in zip(shapes, weights, strict=True):
            linear(inputs[k], w)
        for _ in range(9):
            linear(nn.functional.silu(linear(x, gate)) * linear(x, up), down)

    with torch.no_grad():
        once()
        started = time.perf_counter()
        for _ in range(repeats):
            once()
    return (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens a forward runs (one sequence)")
    parser.add_argument("--experts", type=int, default=16, help="routed experts built (256 in the real model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--gemms", action="store_true",
                        help="time the layer's projections as plain GEMMs instead of the transformers module")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    real = _real_layer_bytes()
    if args.gemms:
        rows = {}
        for dtype in (torch.float32, torch.bfloat16):
            plain = _gemms(args.tokens, dtype, args.repeats, amax=False)
            hooked = _gemms(args.tokens, dtype, args.repeats, amax=True)
            flops = real["flops_per_token"] * args.tokens
            rows[str(dtype).removeprefix("torch.")] = {
                "s": round(plain, 3), "s_with_amax": round(hooked, 3), "gflops": round(flops / plain / 1e9, 1),
                "amax_overhead": round(hooked / plain, 3), "us_per_token": round(plain / args.tokens * 1e6, 1)}
        print(json.dumps({"tokens": args.tokens, "threads": args.threads, "gemms": rows,
                          "real_layer_gflop_per_token": round(real["flops_per_token"] / 1e9, 3)}, indent=2))
        return
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RotaryEmbedding,
    )

    config = _config(args.experts)
    config._attn_implementation = "sdpa"
    dtype = getattr(torch, args.dtype)
    with torch.device("meta"):  # random weights without the init's cost: only the shapes and dtype matter here
        layer = DeepseekV3DecoderLayer(config, layer_idx=0)
    layer = layer.to_empty(device="cpu").to(dtype).eval()
    for tensor in [*layer.parameters(), *layer.buffers()]:
        if tensor.is_floating_point():
            tensor.data.normal_(0.0, 0.02)
    hidden = torch.randn(1, args.tokens, config.hidden_size, dtype=dtype)
    positions = torch.arange(args.tokens).unsqueeze(0)
    position = DeepseekV3RotaryEmbedding(config)(hidden, positions)
    plain = _time(layer, hidden, position, args.repeats)
    amax: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(_module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            seen = torch.stack([inputs[0].detach().abs().amax().float(), output.detach().abs().amax().float()])
            amax[name] = seen if name not in amax else torch.maximum(amax[name], seen)
        return hook

    handles = [module.register_forward_hook(record(name)) for name, module in layer.named_modules()
               if isinstance(module, nn.Linear)]
    hooked = _time(layer, hidden, position, args.repeats)
    for handle in handles:
        handle.remove()
    print(json.dumps({
        "tokens": args.tokens, "experts_built": args.experts, "threads": args.threads, "dtype": args.dtype,
        "linears_hooked": len(handles), "layer_s": round(plain, 3), "layer_with_amax_hooks_s": round(hooked, 3),
        "us_per_token": round(plain / args.tokens * 1e6, 1),
        "us_per_token_with_hooks": round(hooked / args.tokens * 1e6, 1),
        "achieved_gflops": round(real["flops_per_token"] * args.tokens / plain / 1e9, 1),
        "real_layer": {"params": real["params"], "bf16_bytes": real["bytes"],
                       "gflop_per_token": round(real["flops_per_token"] / 1e9, 3)},
    }, indent=2))


if __name__ == "__main__":
    main()
