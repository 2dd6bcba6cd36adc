"""Train the small gpt-oss fixture shipped in golden/trained/ (GPU, a few minutes), and export it.

    python tools/train_fixture.py --out DIR [--seconds 330]

A gpt-oss of the real architecture (transformers' GptOssForCausalLM, bf16 autocast over fp32
weights): 4 layers alternating sliding (window 64) / full attention with learned sinks, hidden 320,
8 query / 2 kv heads of 64, 16 experts top-4 (intermediate 256), clamped SwiGLU, YaRN RoPE; a
byte-level vocabulary (ByT5's: pad 0, eos 1, unk 2, byte b -> b + 3; 259 ids). Data every machine
has: the Python standard library's own .py sources (files whose crc32 % 16 == 0 held out). The
learning rate follows a cosine over the time budget, so the run ends on time whatever the GPU.
After training, the experts are rounded to MXFP4 (``quant.mxfp4.encode_mxfp4``) and the whole model
is written as an HF-layout MXFP4 source checkpoint (``convert.export.write_hf_mxfp4``) to DIR, with
``train.json`` (held-out loss before and after the MXFP4 rounding, steps, seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gptoss_fp8.config import GptOssConfig, hf_config_dict  # noqa: E402
from gptoss_fp8.convert.export import write_hf_mxfp4  # noqa: E402
from gptoss_fp8.tokenizer import BYT5_FILES, BYT5_IDS, ByteTokenizer  # noqa: E402

CFG = GptOssConfig(num_hidden_layers=4, num_local_experts=16, num_experts_per_tok=4, hidden_size=320,
                   intermediate_size=256, head_dim=64, num_attention_heads=8, num_key_value_heads=2,
                   vocab_size=ByteTokenizer.vocab_size, sliding_window=64)
SEQ, BATCH = 512, 48
AUX_LOSS = 0.02  # transformers' router load-balancing loss coefficient


def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) token streams: each stdlib .py file as bytes + 3, then eos."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for p in sorted(root.rglob("*.py")):
        rel = str(p.relative_to(root))
        if "site-packages" in rel or "/test" in "/" + rel:
            continue
        try:
            data = p.read_bytes()
        except OSError:
            continue
        if not data:
            continue
        ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long() + BYT5_IDS["offset"]
        seq = torch.cat([ids, torch.tensor([BYT5_IDS["eos"]])])
        (held if zlib.crc32(rel.encode()) % 16 == 0 else train).append(seq)
    return torch.cat(train), torch.cat(held)


def build_model(device: str):
    from transformers import GptOssConfig as HfConfig
    from transformers import GptOssForCausalLM

    d = hf_config_dict(CFG)
    d.pop("quantization_config")
    d |= {"eos_token_id": BYT5_IDS["eos"], "pad_token_id": BYT5_IDS["pad"], "bos_token_id": None,
          "output_router_logits": True, "router_aux_loss_coef": AUX_LOSS}
    hf = HfConfig(**d)
    last = None
    for kw in ({"attn_implementation": "eager", "experts_implementation": "grouped_mm"},
               {"attn_implementation": "eager"}):
        try:
            model = GptOssForCausalLM._from_config(hf, **kw).to(device)
            x = torch.randint(3, 200, (2, 64), device=device)
            with torch.autocast(torch.device(device).type, torch.bfloat16):
                model(input_ids=x, labels=x).loss.backward()
            model.zero_grad(set_to_none=True)
            print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, {kw}", flush=True)
            return model
        except Exception as e:  # an option this transformers does not have: try the next
            last = e
            print(f"model options {kw} failed: {type(e).__name__}: {e}", flush=True)
    raise RuntimeError(f"no working model configuration: {last}")


@torch.no_grad()
def held_out_loss(model, held: torch.Tensor, device: str, n: int = 64) -> float:
    g = torch.Generator().manual_seed(1)
    starts = torch.randint(0, held.numel() - SEQ - 1, (n,), generator=g)
    x = torch.stack([held[s:s + SEQ] for s in starts.tolist()]).to(device)
    total = 0.0
    for a in range(0, n, 16):
        with torch.autocast(torch.device(device).type, torch.bfloat16):
            total += float(model(input_ids=x[a:a + 16], labels=x[a:a + 16]).loss) * min(16, n - a)
    return total / n


def export(model, out: Path) -> None:
    tensors = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    write_hf_mxfp4(out, CFG, tensors, config_extra={"eos_token_id": BYT5_IDS["eos"], "pad_token_id": BYT5_IDS["pad"],
                                                     "bos_token_id": None, "router_aux_loss_coef": AUX_LOSS},
                   files=BYT5_FILES | {"generation_config.json": {"eos_token_id": BYT5_IDS["eos"],
                                                                  "pad_token_id": BYT5_IDS["pad"]}},
                   expert_layout="transformers")


def load_mxfp4_into(model, out: Path) -> None:
    """Put the exported (MXFP4-rounded) experts back into the model, to measure what the rounding costs."""
    from safetensors.torch import load_file

    from gptoss_fp8.quant.mxfp4 import decode_mxfp4

    st = load_file(str(out / "model.safetensors"))
    sd = model.state_dict()
    with torch.no_grad():
        for k, v in sd.items():
            if k.endswith(("gate_up_proj", "down_proj")):
                w = decode_mxfp4(st[k + "_blocks"], st[k + "_scales"], torch.float32)  # [E, out, in]
                v.copy_(w if w.shape == v.shape else w.transpose(1, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=330.0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cuda (the real run); cpu only to smoke-test the script")
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    dev = a.device
    train, held = corpus()
    print(f"corpus: {train.numel() / 1e6:.1f} M train bytes, {held.numel() / 1e6:.2f} M held out", flush=True)
    model = build_model(dev)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), fused=dev.startswith("cuda"))
    g = torch.Generator().manual_seed(a.seed)
    t0, step, warm = time.time(), 0, 60
    model.train()
    while True:
        frac = (time.time() - t0) / a.seconds
        if frac >= 1:
            break
        lr = a.lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for grp in opt.param_groups:
            grp["lr"] = lr
        starts = torch.randint(0, train.numel() - SEQ - 1, (BATCH,), generator=g)
        x = torch.stack([train[s:s + SEQ] for s in starts.tolist()]).to(dev, non_blocking=True)
        with torch.autocast(torch.device(dev).type, torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.3f} lr {lr:.2e} {time.time() - t0:.0f}s", flush=True)
        step += 1
    seconds = time.time() - t0
    model.eval()
    model.config.output_router_logits = False
    bf16_loss = held_out_loss(model, held, dev)
    export(model, a.out)
    load_mxfp4_into(model, a.out)
    mx_loss = held_out_loss(model, held, dev)
    info = {"steps": step, "seconds": round(seconds, 1), "batch": BATCH, "seq": SEQ,
            "held_out_loss_nats_per_byte": {"trained": round(bf16_loss, 4), "experts_mxfp4": round(mx_loss, 4)},
            "corpus": "Python standard library .py sources (crc32(path) % 16 == 0 held out)",
            "python": sys.version.split()[0], "torch": torch.__version__}
    (a.out / "train.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info), flush=True)


if __name__ == "__main__":
    main()
