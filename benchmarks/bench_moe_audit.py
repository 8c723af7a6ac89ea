"""Audit full-size mixture-of-experts models built on the meta device: completion, findings,
wall time and peak RSS, on fake tensors for CPU and for a simulated CUDA device.

    python benchmarks/bench_moe_audit.py [--seq 128] [--only mixtral-8x22b] [--device cuda]

Configs (transformers 5.x classes, published sizes):
- Mixtral 8x22B: hidden 6144, 56 layers, 48 heads / 8 KV, 8 experts top-2, expert FFN 16384.
- Qwen3-MoE 235B-A22B: hidden 4096, 94 layers, 64 heads / 4 KV, 128 experts top-8, expert FFN 1536.
- DeepSeek-V3 671B: hidden 7168, 61 layers (3 dense), MLA, 256 routed + 1 shared experts top-8.

Each (model, device) audit (policy bf16-mixed, mode both: forward + backward, and eval) runs in
its own process, so its peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import warnings
from typing import Any

import torch


def _configs() -> dict[str, Any]:
    import transformers as tf

    return {
        "mixtral-8x22b": (
            tf.MixtralForCausalLM,
            tf.MixtralConfig(
                vocab_size=32768,
                hidden_size=6144,
                intermediate_size=16384,
                num_hidden_layers=56,
                num_attention_heads=48,
                num_key_value_heads=8,
                num_local_experts=8,
                num_experts_per_tok=2,
                max_position_embeddings=65536,
                rope_theta=1e6,
            ),
        ),
        "qwen3-moe-235b-a22b": (
            tf.Qwen3MoeForCausalLM,
            tf.Qwen3MoeConfig(
                vocab_size=151936,
                hidden_size=4096,
                intermediate_size=12288,
                moe_intermediate_size=1536,
                num_hidden_layers=94,
                num_attention_heads=64,
                num_key_value_heads=4,
                head_dim=128,
                num_experts=128,
                num_experts_per_tok=8,
                max_position_embeddings=40960,
            ),
        ),
        "deepseek-v3-671b": (
            tf.DeepseekV3ForCausalLM,
            tf.DeepseekV3Config(
                vocab_size=129280,
                hidden_size=7168,
                intermediate_size=18432,
                moe_intermediate_size=2048,
                num_hidden_layers=61,
                first_k_dense_replace=3,
                num_attention_heads=128,
                num_key_value_heads=128,
                n_routed_experts=256,
                n_shared_experts=1,
                num_experts_per_tok=8,
                n_group=8,
                topk_group=4,
                kv_lora_rank=512,
                q_lora_rank=1536,
                qk_rope_head_dim=64,
                qk_nope_head_dim=128,
                v_head_dim=128,
            ),
        ),
    }


def one(name: str, device: str, seq: int) -> dict[str, Any]:
    """Build ``name`` on meta and audit it once on fake tensors for ``device``."""
    import castwise

    warnings.filterwarnings("ignore")
    cls, config = _configs()[name]
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = cls(config)
    built = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    report = castwise.audit(model, {"input_ids": ids, "labels": ids}, policy="bf16-mixed", device=device)
    took = time.perf_counter() - t0
    return {
        "model": name,
        "device": device,
        "params_b": round(params / 1e9, 1),
        "build_s": round(built, 1),
        "audit_s": round(took, 1),
        "ok": report.ok,
        "runs": [r.status for r in report.runs],
        "errors": [(f.code, f.module) for f in report.errors],
        "findings": sorted({f.code for f in report.findings}),
        "ops_traced": report.summary.get("ops_traced"),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--only", default=None, help="one model name")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"])
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one audit, JSON out
    opts = parser.parse_args()
    if opts.one:
        print(json.dumps(one(opts.only, opts.device, opts.seq)))
        return
    names = [opts.only] if opts.only else list(_configs())
    devices = [opts.device] if opts.device else ["cpu", "cuda"]
    print(f"{'model':22} {'device':6} {'params':>7} {'audit':>8} {'RSS':>9}  status")
    for name in names:
        for device in devices:
            cmd = [sys.executable, __file__, "--one", "--only", name, "--device", device, "--seq", str(opts.seq)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(f"{name:22} {device:6} FAILED: {done.stderr.strip().splitlines()[-1:]}")
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            status = "complete" if r["runs"] == ["ok", "ok"] else f"runs {r['runs']}"
            print(
                f"{name:22} {device:6} {r['params_b']:>6}B {r['audit_s']:>7}s {r['peak_rss_gib']:>6} GiB  "
                f"{status}, ok={r['ok']}, errors={r['errors']}, findings={r['findings']}, "
                f"ops={r['ops_traced']}"
            )


if __name__ == "__main__":
    main()
