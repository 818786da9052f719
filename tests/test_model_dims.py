"""The MLA dims of the models people serve (every MLA model type of transformers: head dims 96/64 to 256/256, a zero
RoPE part, 20 to 128 heads, kv_lora_rank 128 to 1024) through the core on the CPU, the dispatch rows that serve them
on the GPU, and the dims presets of ``mla-bridge prefill --model``.

mla_prefill (torch backend) equals the float64 reference over a paged cache of width kv_lora_rank +
qk_rope_head_dim, fused and in chunks, from a bf16-width float32 cache and an FP8 one; presets equal the dims of
transformers' config of their model type.
"""

from __future__ import annotations

import json

import pytest
import torch

import mla_bridge.dispatch as dispatch
from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill, select_backend
from mla_bridge.cache import quantize_latent_cache
from mla_bridge.cli import main
from mla_bridge.dims import PRESETS

#: (num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim) of one model type per row of the table
#: (transformers 5.25's default configs; dots3_note's sliding-window layers as "dots3_note-swa").
MODEL_DIMS = {
    "deepseek_v3": (128, 512, 128, 64, 128),
    "kimi_k2": (64, 512, 128, 64, 128),
    "glm4_moe_lite": (20, 512, 192, 64, 256),
    "glm_moe_dsa": (64, 512, 192, 64, 256),
    "glm5_next": (64, 512, 256, 0, 256),
    "mistral4": (32, 256, 64, 64, 128),
    "minicpm3": (40, 256, 64, 32, 64),
    "axk2": (32, 128, 64, 32, 64),
    "dots3_note-swa": (64, 1024, 192, 64, 128),
}
Q_LENS, C_LENS = [3, 2, 0, 1], [5, 0, 4, 9]
SCHEDULES = [(100, True), (100, False), (4, False)]  # (chunk_tokens, fuse_context): fused, one chunk, 5 chunks


def dims_of(name: str) -> MLADims:
    h, r, n, p, v = MODEL_DIMS[name]
    return MLADims(num_heads=h, kv_lora_rank=r, qk_nope_head_dim=n, qk_rope_head_dim=p, v_head_dim=v)


@pytest.mark.parametrize("name", MODEL_DIMS)
def test_mla_prefill_at_model_dims_equals_float64(ref, name):
    dims = dims_of(name)
    batch = ref.make_mla_batch(dims, Q_LENS, C_LENS, 4, seed=3)
    assert batch.cache.shape[-1] == dims.kv_lora_rank + dims.qk_rope_head_dim
    assert batch.k_pe.shape == (sum(Q_LENS), dims.qk_rope_head_dim)
    exp_out, exp_lse = ref.mla_reference(batch)
    for chunk, fuse in SCHEDULES:
        plan = PrefillPlan.build(
            Q_LENS,
            C_LENS,
            dims=dims,
            workspace=Workspace("cpu", chunk_tokens=chunk),
            block_size=4,
            dtype=torch.float32,
            fuse_context=fuse,
        )
        out, lse = mla_prefill(
            batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan, return_lse=True
        )
        assert out.shape == (sum(Q_LENS), dims.num_heads, dims.v_head_dim)
        ref.assert_out_close(out, exp_out, atol=1e-4)
        ref.assert_lse_close(lse, exp_lse, atol=1e-4)


@pytest.mark.parametrize("name", ["glm5_next", "minicpm3", "glm4_moe_lite"])
def test_fp8_cache_at_model_dims(ref, name):
    dims = dims_of(name)
    batch = ref.make_mla_batch(dims, Q_LENS, C_LENS, 4, seed=4)
    cache, scale = quantize_latent_cache(batch.cache.float() * 3.0)
    deq = ref.make_mla_batch(dims, Q_LENS, C_LENS, 4, seed=4)
    deq.cache = cache.double() * float(scale)  # the same bytes, read back in float64
    exp_out, _ = ref.mla_reference(deq)
    for chunk, fuse in SCHEDULES:
        plan = PrefillPlan.build(
            Q_LENS,
            C_LENS,
            dims=dims,
            workspace=Workspace("cpu", chunk_tokens=chunk),
            block_size=4,
            dtype=torch.float32,
            fuse_context=fuse,
            kv_cache_dtype="fp8",
        )
        out = mla_prefill(
            batch.q, batch.kv_c, batch.k_pe, batch.w, cache, batch.block_table, plan, kv_cache_scale=scale
        )
        ref.assert_out_close(out, exp_out, atol=1e-4)


def test_zero_rope_is_the_nope_attention(ref):
    # qk_rope_head_dim 0: the cache rows are kv_c alone, q is q_nope; a k_pe of [T, 0] or [T, 1, 0] is accepted, and
    # a wrong k_pe width is refused naming it.
    dims = dims_of("glm5_next")
    batch = ref.make_mla_batch(dims, Q_LENS, C_LENS, 4, seed=5)
    plan = PrefillPlan.build(Q_LENS, C_LENS, dims=dims, workspace=Workspace("cpu"), block_size=4, dtype=torch.float32)
    a = mla_prefill(batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan)
    b = mla_prefill(
        batch.q, batch.kv_c, batch.k_pe.reshape(sum(Q_LENS), 1, 0), batch.w, batch.cache, batch.block_table, plan
    )
    assert torch.equal(a, b) and a.abs().max() > 0.1
    with pytest.raises(ValueError, match="k_pe"):
        mla_prefill(batch.q, batch.kv_c, torch.zeros(sum(Q_LENS), 64), batch.w, batch.cache, batch.block_table, plan)


@pytest.mark.parametrize(
    "dims,sm100,sm90,sm80",
    [
        ((192, 128), "flashinfer-cutlass", "flashinfer-fa3", "flashinfer-fa2"),  # DeepSeek, Kimi, ..., dots3_note
        ((256, 256), "flashinfer-fa2", "flashinfer-fa3", "flashinfer-fa2"),  # GLM-4.7-Flash, GLM-5, hy_v4, glm5_next
        ((128, 128), "flashinfer-cutlass", "flashinfer-fa3", "flashinfer-fa2"),  # mistral4, Mistral Large 3
        ((256, 128), "flashinfer-fa2", "flashinfer-fa2", "flashinfer-fa2"),  # dots3_note's sliding-window layers
        ((96, 64), "torch", "torch", "torch"),  # minicpm3, axk2: 96 is not a multiple of 64
    ],
)
def test_dispatch_rows_of_model_head_dims(monkeypatch, dims, sm100, sm90, sm80):
    qk, vo = dims
    monkeypatch.setattr(dispatch, "flashinfer_version", lambda: "0.7.4")
    kw = dict(cuda_version=(12, 8), dtype=torch.bfloat16, head_dim_qk=qk, head_dim_vo=vo, causal=True)
    for cap, want in (((10, 0), sm100), ((9, 0), sm90), ((8, 0), sm80)):
        choice = select_backend(capability=cap, **kw)
        assert choice.name == want, (cap, choice.reason)
        if want == "torch":
            assert "head_dim_qk 96" in choice.reason  # the reason names what no FlashInfer row serves
        if cap == (9, 0) and want != "flashinfer-fa3":
            assert f"head dims {qk}/{vo} not in" in dict(choice.passed_over)["flashinfer-fa3"]


#: preset -> (model type whose transformers default config has its dims, overrides of that config)
PRESET_SOURCES = {
    "deepseek-v3": ("deepseek_v3", {}),
    "deepseek-v3.2": ("deepseek_v32", {}),
    "kimi-k2": ("deepseek_v3", {"num_attention_heads": 64, "num_key_value_heads": 64}),
    "glm-4.7-flash": ("glm4_moe_lite", {}),
    "glm-5": ("glm_moe_dsa", {}),
    "mistral-large-3": ("mistral_large4", {}),
}


def test_presets_cover_the_served_models():
    assert PRESETS == (
        "deepseek-v2-lite",
        "deepseek-v3",
        "deepseek-v3.2",
        "kimi-k2",
        "glm-4.7-flash",
        "glm-5",
        "mistral-large-3",
    )


@pytest.mark.parametrize("name", PRESET_SOURCES)
def test_preset_dims_are_the_model_types(name):
    transformers = pytest.importorskip("transformers")
    model_type, overrides = PRESET_SOURCES[name]
    config = transformers.AutoConfig.for_model(model_type, **overrides)
    want = MLADims.from_hf_config(config)
    got = MLADims.preset(name)
    assert (got.num_heads, got.kv_lora_rank, got.qk_nope_head_dim, got.qk_rope_head_dim, got.v_head_dim) == (
        want.num_heads,
        want.kv_lora_rank,
        want.qk_nope_head_dim,
        want.qk_rope_head_dim,
        want.v_head_dim,
    )
    if name in ("glm-4.7-flash", "glm-5", "mistral-large-3"):
        assert got.softmax_scale == got.head_dim_qk**-0.5  # no mscale_all_dim in their RoPE entry
    if name in ("deepseek-v3", "deepseek-v3.2"):
        assert got.softmax_scale == pytest.approx(0.135234, abs=1e-6)
    if name == "kimi-k2":  # YaRN factor 64, mscale_all_dim 1
        assert got.softmax_scale == pytest.approx(192**-0.5 * (0.1 * __import__("math").log(64) + 1) ** 2)


@pytest.mark.parametrize("name", ["glm-5", "mistral-large-3", "glm-4.7-flash"])
def test_cli_prefill_model_preset(tmp_path, name, two_threads):
    path = tmp_path / "out.json"
    rc = main(
        [
            "prefill",
            "--device",
            "cpu",
            "--model",
            name,
            "--prompt-lens",
            "3,2",
            "--context-lens",
            "4,0",
            "--layers",
            "1",
            "--json",
            str(path),
        ]
    )
    res = json.loads(path.read_text())
    d = MLADims.preset(name)
    assert rc == 0 and res["check"]["passed"] is True
    assert res["model"] == name and res["dims"]["num_heads"] == d.num_heads
    assert res["dims"]["v_head_dim"] == d.v_head_dim and res["dims"]["qk_nope_head_dim"] == d.qk_nope_head_dim


def test_info_lists_the_presets(tmp_path, capsys):
    path = tmp_path / "info.json"
    assert main(["info", "--json", str(path)]) == 0
    info = json.loads(path.read_text())
    assert list(info["presets"]) == list(PRESETS)
    glm5 = info["presets"]["glm-5"]
    assert (glm5["num_heads"], glm5["qk_nope_head_dim"], glm5["v_head_dim"]) == (64, 192, 256)
    out = " ".join(capsys.readouterr().out.split())
    assert "--model glm-5" in out and "64 heads, q/k 192+64, v 256" in out


@pytest.fixture
def two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(min(n, 2))
    yield
    torch.set_num_threads(n)
