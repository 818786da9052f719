"""The JAX DeepSeek model's forward with each attention, and the GPU's SM clock and power while it runs.

    PYTHONPATH=$PWD:$PWD/adapters python3 scripts/gpu/jax_model_clocks.py [--batches 16,4] [--tokens 10000]

The model of :mod:`mla_bridge_jax.models` at the ttft bench's sizes (DeepSeek-V2-Lite attention dims, 4 dense
layers, random weights, bf16) with cuDNN, mla_bridge_jax and no-op attention, and each attention alone on the q, k, v
the model hands its first layer (x layers). Two ways of timing: each forward after ``--rest`` seconds idle (median of
``--rounds``, the attention alone in the same rounds), and five forwards back to back, as a serving engine runs them.
A thread samples NVML (``libnvidia-ml.so.1``, through ctypes) every half millisecond: the SM clock (MHz), the power
(W) and whether the software power cap is among the clock's throttle reasons, averaged over each timed span. Where
the "kept" share of the ttft bench (:mod:`mla_bridge.bench.ttft_jax`) falls below what the attention alone predicts,
this tells whether the clock is why. CUDA only (needs the NVIDIA driver's NVML and jax with CUDA).
"""

from __future__ import annotations

import argparse
import ctypes
import threading
import time

import numpy as np


class ClockSampler:
    """NVML samples ``(time.perf_counter(), SM MHz, watts, power-capped)`` of GPU ``index`` from a daemon thread."""

    SM_CLOCK = 1  # NVML_CLOCK_SM
    SW_POWER_CAP = 0x4  # nvmlClocksThrottleReasonSwPowerCap

    def __init__(self, index: int = 0, period_s: float = 0.0005):
        self.nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if self.nvml.nvmlInit_v2() != 0:
            raise RuntimeError("nvmlInit_v2 failed")
        self.handle = ctypes.c_void_p()
        if self.nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)) != 0:
            raise RuntimeError(f"no NVML device {index}")
        self.period_s, self.samples, self._stop = period_s, [], False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        clock, milliwatts, reasons = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
        while not self._stop:
            self.nvml.nvmlDeviceGetClockInfo(self.handle, self.SM_CLOCK, ctypes.byref(clock))
            self.nvml.nvmlDeviceGetPowerUsage(self.handle, ctypes.byref(milliwatts))
            self.nvml.nvmlDeviceGetCurrentClocksThrottleReasons(self.handle, ctypes.byref(reasons))
            capped = bool(reasons.value & self.SW_POWER_CAP)
            self.samples.append((time.perf_counter(), clock.value, milliwatts.value / 1000, capped))
            time.sleep(self.period_s)

    def summary(self, t0: float, t1: float) -> str:
        """The samples of ``[t0, t1]``: mean SM clock (and its minimum), mean power (and its maximum), capped share."""
        span = np.array([s[1:] for s in self.samples if t0 <= s[0] <= t1], dtype=float)
        if not len(span):
            return "no samples"
        return (
            f"sm {span[:, 0].mean():.0f} MHz (min {span[:, 0].min():.0f}), power {span[:, 1].mean():.0f} W "
            f"(max {span[:, 1].max():.0f}), power-capped {span[:, 2].mean():.2f} of {len(span)} samples"
        )

    def stop(self) -> None:
        self._stop = True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="16,4", help="batch sizes, comma-separated (default 16,4)")
    p.add_argument("--tokens", type=int, default=10000, help="prompt tokens per row (default 10000)")
    p.add_argument("--rounds", type=int, default=6, help="rested rounds (default 6)")
    p.add_argument("--rest", type=float, default=0.4, help="idle seconds before each rested call (default 0.4)")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import torch
    import transformers

    from mla_bridge.bench.ttft import model_fields
    from mla_bridge_jax import models

    sampler = ClockSampler()
    config = transformers.DeepseekV2Config(**model_fields(False))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    cfg = models.DeepseekConfig.from_dict(config.to_dict())
    params = models.params_from_state_dict(model.state_dict(), jnp.bfloat16)
    del model
    for batch in (int(b) for b in args.batches.split(",")):
        n = args.tokens
        ids = jnp.asarray(np.random.default_rng(batch).integers(3, cfg.vocab_size, (batch, n)), dtype=jnp.int32)
        forwards = {
            impl: models.make_forward(cfg, batch=batch, seq_len=n, attention=impl, dtype=jnp.bfloat16, logits_to_keep=1)
            for impl in ("cudnn", "mla_bridge", "noop")
        }
        q, k, v = jax.block_until_ready(models.attention_inputs(cfg, params, ids, None, prefix_len=0))
        alone = {
            impl: jax.jit(models.attention_fn(cfg, impl, batch, n, 0, jnp.bfloat16, None))
            for impl in ("cudnn", "mla_bridge")
        }
        calls = {f"model, {impl}": (lambda f=f: f(params, ids, None)[0]) for impl, f in forwards.items()}
        calls.update(
            {
                f"alone x {cfg.num_layers}, {impl}": (lambda a=a: [a(q, k, v) for _ in range(cfg.num_layers)])
                for impl, a in alone.items()
            }
        )
        for fn in calls.values():  # compile
            jax.block_until_ready(fn())
        spans: dict = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, fn in calls.items():
                time.sleep(args.rest)
                t0 = time.perf_counter()
                jax.block_until_ready(fn())
                spans[name].append((t0, time.perf_counter()))
        print(f"{batch} x {n}, each call after {args.rest} s idle (median of {args.rounds}; clocks of the last):")
        for name, xs in spans.items():
            ms = sorted(t1 - t0 for t0, t1 in xs)[len(xs) // 2] * 1e3
            print(f"  {name:24s} {ms:9.2f} ms | {sampler.summary(*xs[-1])}")
        print(f"{batch} x {n}, five forwards back to back:")
        for impl, f in forwards.items():
            jax.block_until_ready(f(params, ids, None)[0])
            t0 = time.perf_counter()
            for _ in range(5):
                out = f(params, ids, None)[0]
            jax.block_until_ready(out)
            t1 = time.perf_counter()
            print(f"  model, {impl:16s} {(t1 - t0) / 5 * 1e3:9.2f} ms per forward | {sampler.summary(t0, t1)}")
    sampler.stop()


if __name__ == "__main__":
    main()
