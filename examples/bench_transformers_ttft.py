"""Time to first token of a transformers DeepSeek-V2 model: transformers' sdpa attention vs mla_bridge's.

    python examples/bench_transformers_ttft.py                 # the H200 run: 10000-token prompts, batch 1 and 4
    python examples/bench_transformers_ttft.py --quick         # a CPU smoke run (tiny model, float32)
    python examples/bench_transformers_ttft.py --json ttft.json

The model: DeepSeek-V2-Lite's published sizes for attention (16 heads, kv_lora_rank 512, q/k 128 + 64,
v 128, YaRN) and hidden size (2048, dense MLP 10944, vocab 102400), 4 decoder layers, all dense
(``first_k_dense_replace`` = 4) so that attention is what differs, random weights, bf16 on CUDA. It is built once and
loaded twice from one ``save_pretrained`` folder, ``attn_implementation="sdpa"`` and ``"mla_bridge"``
(:func:`mla_bridge_transformers.register`). Time to first token = one prefill forward of the whole prompt with
``logits_to_keep=1`` (what ``generate`` does for the first token), timed from the call to the last token's logits
on the host, median of ``--repeats`` after ``--warmup`` runs; the first token of both must agree. The ratio is
sdpa / mla_bridge (above 1: mla_bridge is faster).

``mla-bridge bench --sections ttft`` measures the same model side by side with the JAX model, with attention's share
of each forward (:mod:`mla_bridge.bench.ttft`); this script is the transformers half alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from mla_bridge.bench.ttft import model_fields  # the bench's model: DeepSeek-V2-Lite's sizes, all layers dense


def build(folder: str, layers: int, quick: bool) -> None:
    """Write the random model to ``folder`` (``save_pretrained``)."""
    import transformers

    config = transformers.DeepseekV2Config(**model_fields(quick, layers))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32 if quick else torch.bfloat16)
    model.save_pretrained(folder)  # about 1.5 GB in bf16 at the full size
    del model


def ttft(model, ids: torch.Tensor, warmup: int, repeats: int) -> tuple[list[float], torch.Tensor]:
    """Seconds per prefill forward (to the last token's logits on the host) and the first token per request."""
    times, first = [], None
    for i in range(warmup + repeats):
        if ids.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            logits = model(input_ids=ids, logits_to_keep=1).logits[:, -1]
        first = logits.argmax(-1).cpu()  # a host copy: waits for the GPU
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times, first


def main(argv=None) -> list[dict]:
    from mla_bridge.cli.args import nonnegative_int, positive_int

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and prompts (CPU smoke run)")
    parser.add_argument(
        "--prompt-len", type=positive_int, default=None, help="tokens per prompt (default 10000; quick 64)"
    )
    parser.add_argument("--batch", type=positive_int, nargs="+", default=[1, 4], help="batch sizes (default 1 4)")
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--warmup", type=nonnegative_int, default=None, help="untimed runs first (default 2; quick 1)")
    parser.add_argument("--repeats", type=positive_int, default=None, help="timed runs (default 5; quick 2)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if args.json is not None:  # refused now, not after minutes of timing (and no file left by the check)
        existed = os.path.exists(args.json)
        try:
            with open(args.json, "a", encoding="utf-8"):
                pass
        except OSError as err:
            parser.error(f"--json {args.json}: {err.strerror}")
        if not existed:
            os.remove(args.json)
    prompt = args.prompt_len or (64 if args.quick else 10000)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 5)
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    import transformers
    import mla_bridge_transformers

    impls = ("sdpa", mla_bridge_transformers.register())
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        build(folder, args.layers, args.quick)
        models = {
            impl: transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation=impl, dtype=dtype)
            .to(device)
            .eval()
            for impl in impls
        }
        vocab = models["sdpa"].config.vocab_size
        for batch in args.batch:
            ids = torch.randint(3, vocab, (batch, prompt), generator=torch.Generator().manual_seed(batch)).to(device)
            result = {}
            for impl in impls:
                times, first = ttft(models[impl], ids, warmup, repeats)
                result[impl] = (statistics.median(times), first)
                rows.append(
                    dict(
                        batch=batch,
                        prompt_len=prompt,
                        layers=args.layers,
                        attn_implementation=impl,
                        ttft_ms=statistics.median(times) * 1e3,
                        runs_ms=[t * 1e3 for t in times],
                        device=str(torch.cuda.get_device_name() if device == "cuda" else "cpu"),
                        dtype=str(dtype).replace("torch.", ""),
                    )
                )
            same = torch.equal(result["sdpa"][1], result[impls[1]][1])
            ratio = result["sdpa"][0] / result[impls[1]][0]
            rows[-1].update(ratio_sdpa_over_mla_bridge=ratio, same_first_token=same)
            print(
                f"batch {batch} x {prompt} tokens, {args.layers} layers, {rows[-1]['dtype']} on {rows[-1]['device']}: "
                f"sdpa {result['sdpa'][0] * 1e3:.2f} ms, mla_bridge {result[impls[1]][0] * 1e3:.2f} ms, "
                f"ratio {ratio:.2f}x, same first token: {same}"
            )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
