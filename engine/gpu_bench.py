"""`python -m engine.gpu_bench`: CUDA graph replay vs eager decode, and decode at batch 1 against
the memory roofline, for a ~1B-parameter random Llama in bfloat16 (weights made on the device:
nothing to download or write). Needs CUDA and Triton."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from engine.attention import create_attention_backend
from engine.config import ModelConfig
from engine.cuda_graph import CudaGraphRunner
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.memory import KVCache, ReqToTokenPool
from engine.models import model_class

ARCH = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
            num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)


def random_weights(cfg: ModelConfig, dev: torch.device) -> dict[str, torch.Tensor]:
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16) * 0.02

    w = {"model.embed_tokens.weight": r(cfg.vocab_size, h), "model.norm.weight": torch.ones(h, device=dev),
         "lm_head.weight": r(cfg.vocab_size, h)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        w |= {p + "input_layernorm.weight": torch.ones(h, device=dev),
              p + "post_attention_layernorm.weight": torch.ones(h, device=dev),
              p + "self_attn.q_proj.weight": r(q, h), p + "self_attn.k_proj.weight": r(kv, h),
              p + "self_attn.v_proj.weight": r(kv, h), p + "self_attn.o_proj.weight": r(h, q),
              p + "mlp.gate_proj.weight": r(i, h), p + "mlp.up_proj.weight": r(i, h), p + "mlp.down_proj.weight": r(h, i)}
    return w


def cuda_time(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    dev = torch.device("cuda")
    cfg = ModelConfig.from_hf({**ARCH, "model_type": "llama", "tie_word_embeddings": False})
    model = model_class(cfg.architecture)(cfg, random_weights(cfg, dev), torch.bfloat16, dev, 4096)
    params = model.num_parameters()
    ctx, max_bs = 256, 64
    pool = ReqToTokenPool(max_bs, 4096, dev)
    kv = KVCache(max_bs * ctx + 1, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16, dev)
    attn = create_attention_backend("triton", pool, kv, model.scale, dev)
    # Every request row holds `ctx` cached tokens.
    pool.req_to_token[1:] = torch.arange(1, max_bs * ctx + 1, device=dev, dtype=torch.int32).view(max_bs, ctx)
    runner = SimpleNamespace(model=model, attn_backend=attn, device=dev)
    graphs = CudaGraphRunner(runner, max_bs)

    def decode_fb(bs: int) -> ForwardBatch:
        seq = torch.full((bs,), ctx, device=dev)
        return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=bs,
                            input_ids=torch.randint(0, 32000, (bs,), device=dev), seq_lens=seq,
                            out_cache_loc=torch.arange(1, bs + 1, device=dev), req_pool_indices=torch.arange(1, bs + 1, device=dev),
                            positions=seq - 1, seq_lens_cpu=[ctx] * bs, last_token_indices=torch.arange(bs, device=dev))

    def eager(fb: ForwardBatch):
        fb.attn_metadata = attn.init_forward_metadata(fb)
        return model.forward(fb, attn)

    buf = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(buf)
    bw = 2 * buf.numel() / cuda_time(lambda: dst.copy_(buf))  # read + write bytes per second
    weight_bytes = params * 2
    print(f"# gpu bench: {torch.cuda.get_device_name()}, {params / 1e9:.2f}B params bf16, ctx {ctx}, "
          f"D2D copy {bw / 1e9:.0f} GB/s", flush=True)
    for bs in (1, 8, 64):
        fb = decode_fb(bs)
        t_eager = cuda_time(lambda fb=fb: eager(fb))
        t_graph = cuda_time(lambda fb=fb: graphs.replay(fb))
        print(f"graph      bs={bs:<3} eager={1e3 * t_eager:.2f} ms  graph={1e3 * t_graph:.2f} ms  "
              f"ratio={t_eager / t_graph:.2f}x (floor 1.5x at bs=1)", flush=True)
        if bs == 1:
            roof = weight_bytes / bw
            print(f"roofline   bs=1 step={1e3 * t_graph:.2f} ms  weights/bandwidth={1e3 * roof:.2f} ms  "
                  f"fraction={roof / t_graph:.0%} (floor 60%)", flush=True)


if __name__ == "__main__":
    main()
