"""Steady decode tok/s at batch B: pagedserve's step vs a dense plain-torch ceiling.

The ceiling is the same Llama's decode step written straight in torch over one
contiguous KV cache `[B, kv_heads, max_len, head]`: RMSNorm, QKV, rotary, a write at the
next position, SDPA over the filled prefix, MLP, LM head, argmax. No paging, no
scheduling, no per-request bookkeeping: what the weights and the math cost at these
shapes. Ours is `LLM`'s in-process engine (text processor, engine core, worker), timed
over steps where every one of the B sequences decodes. Same weights, same threads, one
run, so the ratio compares; the absolute numbers depend on the machine.

    python bench/decode_ceiling.py --out bench/results/decode_ceiling.json
    python bench/decode_ceiling.py --quick
    python bench/decode_ceiling.py --batch 8 64 --compile-model both   # torch.compile or not
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from report import invocation, machine, write_report  # noqa: E402
from systems import MODEL_SHAPE, write_model  # noqa: E402

COMPILE = {"off": (False,), "on": (True,), "both": (False, True)}


def log(msg: str) -> None:
    print(f"[decode_ceiling] {msg}", file=sys.stderr, flush=True)


class DenseLlama:
    """The checkpoint's decode step in plain torch over a contiguous KV cache."""

    def __init__(self, state: dict, shape: dict, batch: int, max_len: int, dtype) -> None:
        self.w = {k: v.to(dtype) for k, v in state.items()}
        self.layers = shape["num_hidden_layers"]
        self.heads, self.kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
        self.head = shape["hidden_size"] // self.heads
        self.eps = shape["rms_norm_eps"]
        kv = (self.layers, batch, self.kv_heads, max_len, self.head)
        self.k, self.v = torch.zeros(kv, dtype=dtype), torch.zeros(kv, dtype=dtype)
        inv = 1.0 / (10000.0 ** (torch.arange(0, self.head, 2).float() / self.head))
        angles = torch.outer(torch.arange(max_len).float(), inv)  # [max_len, head / 2]
        self.cos, self.sin = angles.cos().to(dtype), angles.sin().to(dtype)
        for i in range(self.layers):  # fused QKV and gate/up, as a fast engine would
            p = f"model.layers.{i}."
            self.w[p + "qkv"] = torch.cat([self.w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
            self.w[p + "gate_up"] = torch.cat(
                [self.w[p + "mlp.gate_proj.weight"], self.w[p + "mlp.up_proj.weight"]]
            )

    def _norm(self, x, weight):
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def _rotate(self, x, pos):  # x [B, heads, head]
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)  # [B, 1, head/2]
        x1, x2 = x[..., : self.head // 2], x[..., self.head // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:  # tokens [B]
        w, b = self.w, tokens.shape[0]
        x = w["model.embed_tokens.weight"][tokens]  # [B, hidden]
        positions = torch.full((b,), pos)
        q_size, kv_size = self.heads * self.head, self.kv_heads * self.head
        for i in range(self.layers):
            p = f"model.layers.{i}."
            h = self._norm(x, w[p + "input_layernorm.weight"])
            qkv = h @ w[p + "qkv"].t()
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = self._rotate(q.view(b, self.heads, self.head), positions)
            k = self._rotate(k.view(b, self.kv_heads, self.head), positions)
            self.k[i, :, :, pos] = k
            self.v[i, :, :, pos] = v.view(b, self.kv_heads, self.head)
            o = F.scaled_dot_product_attention(
                q.unsqueeze(2),
                self.k[i, :, :, : pos + 1],
                self.v[i, :, :, : pos + 1],
                enable_gqa=self.heads != self.kv_heads,
            )  # [B, heads, 1, head]
            x = x + o.reshape(b, q_size) @ w[p + "self_attn.o_proj.weight"].t()
            h = self._norm(x, w[p + "post_attention_layernorm.weight"])
            gate, up = (h @ w[p + "gate_up"].t()).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].t()
        x = self._norm(x, w["model.norm.weight"])
        return (x @ w["lm_head.weight"].t()).argmax(dim=-1)


def dense_tok_s(model_dir: Path, batch: int, context: int, steps: int, dtype) -> float:
    from safetensors.torch import load_file

    state = load_file(str(model_dir / "model.safetensors"))
    shape = json.loads((model_dir / "config.json").read_text())
    model = DenseLlama(state, shape, batch, context + steps + 1, dtype)
    tokens = torch.randint(3, shape["vocab_size"], (batch,))
    times = []  # positions < context hold zeros: the same work as real keys
    for pos in range(context, context + steps):
        start = time.perf_counter()
        tokens = model.step(tokens, pos)
        times.append(time.perf_counter() - start)
    return batch / statistics.median(times)


def ours_tok_s(
    model_dir: Path, batch: int, context: int, steps: int, dtype: str, backend: str, compiled: bool
):
    from engine import LLM, SamplingParams

    llm = LLM(
        str(model_dir),
        skip_tokenizer_init=True,
        dtype=dtype,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch),
        attention_backend=backend,
        compile_model=compiled,
    )
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 40, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{i}", [3 + (i * 7 + j) % 30000 for j in range(context)], params)
    while engine.core.stats().num_waiting or any(  # past every prefill
        r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.core.scheduler.running
    ):
        engine.step()
    for _ in range(4):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    chosen = llm.stats().attention_backend
    for i in range(batch):
        engine.abort_request(f"d{i}")
    return batch / statistics.median(times), chosen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[64])
    p.add_argument("--context", type=int, default=256, help="tokens already in each sequence")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps (median)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backends", nargs="+", default=["auto", "sdpa"])
    p.add_argument(
        "--compile-model",
        choices=["off", "on", "both"],
        default="off",
        help="ours eager, through torch.compile, or both side by side",
    )
    p.add_argument("--quick", action="store_true", help="batch 8, 8 steps")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    if a.quick:
        a.batch, a.steps, a.context = [8], 8, 64
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        write_model(model_dir, seed=0)
        for batch in a.batch:
            ceiling = dense_tok_s(model_dir, batch, a.context, a.steps, dtype)
            log(f"batch {batch}: dense ceiling {ceiling:.1f} tok/s")
            for backend, compiled in itertools.product(a.backends, COMPILE[a.compile_model]):
                ours, chosen = ours_tok_s(
                    model_dir, batch, a.context, a.steps, a.dtype, backend, compiled
                )
                how = f"{chosen}{', compiled' if compiled else ''}"
                log(f"batch {batch}: ours ({how}) {ours:.1f} tok/s = {ours / ceiling:.0%}")
                rows.append(
                    dict(
                        batch=batch,
                        backend=chosen,
                        asked=backend,
                        compile_model=compiled,
                        ours_tok_s=round(ours, 1),
                        dense_ceiling_tok_s=round(ceiling, 1),
                        ours_over_ceiling=round(ours / ceiling, 3),
                    )
                )
    result = dict(
        command=invocation(__file__),
        model=MODEL_SHAPE,
        context=a.context,
        steps=a.steps,
        dtype=a.dtype,
        threads=a.threads,
        rows=rows,
        machine=machine(),
    )
    write_report(result, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
