"""Attention of any head layout: a layout the tables lack is read from the nearest measured one
at r times the batch (r = KV-head ratio for decode, query-head ratio for prefill); where that
batch was not measured, or r is not whole, the measured launch floor is kept and only the work
above it scaled by r."""

import json

import numpy as np
import pytest

from costmodels import build
from costmodels.optables import DATA_DIR, MS, AttentionShape, ProfiledOps, scale_work

# meta-llama/Llama-2-7b-hf config.json: 32 query heads, 32 KV heads (MHA), head_dim 128
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
             "max_position_embeddings": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
             "num_key_value_heads": 32, "vocab_size": 32000, "torch_dtype": "float16"}
# 28/28 heads: x3.5 from 8/8 (vLLM decode) and x0.875 from 32/32 (everything else), neither
# whole, so scaled work throughout
MHA_28 = {**LLAMA2_7B, "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 28,
          "num_hidden_layers": 4}
MHA = (32, 32, 128)
BIG_MHA = [(h, h) for h in (12, 16, 24, 32, 40, 48, 64, 96)]  # held out: 8/8 is then the nearest MHA layout


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("configs")
    out = {}
    for name, cfg in (("llama2", LLAMA2_7B), ("mha28", MHA_28)):
        out[name] = folder / f"{name}.json"
        out[name].write_text(json.dumps(cfg))
    return out


def raw_rows(tables, fw, prefix, layout):
    """(batch, length, seconds) of one measured layout, read straight from the bundled file."""
    with np.load(DATA_DIR / f"{tables}_{fw}.npz") as z:
        sel = ((z[f"{prefix}_heads"] == layout[0]) & (z[f"{prefix}_kv_heads"] == layout[1])
               & (z[f"{prefix}_head_dim"] == layout[2]) & (z[f"{prefix}_kv_dtype"] == 0))
        return (z[f"{prefix}_batch"][sel].astype(np.float64), z[f"{prefix}_length"][sel].astype(np.float64),
                z[f"{prefix}_latency"][sel].astype(np.float64) * MS)


def held_out(tmp_path, tables, fw, prefix, layouts) -> ProfiledOps:
    """The GPU's op tables with the given (heads, kv heads) layouts removed from one attention table."""
    with np.load(DATA_DIR / f"{tables}_{fw}.npz") as z:
        data = {key: z[key] for key in z.files}
    drop = np.zeros(len(data[f"{prefix}_heads"]), dtype=bool)
    for heads, kv_heads in layouts:
        drop |= (data[f"{prefix}_heads"] == heads) & (data[f"{prefix}_kv_heads"] == kv_heads)
    for key in [k for k in data if k.startswith(prefix + "_")]:
        data[key] = data[key][~drop]
    np.savez(tmp_path / f"{tables}_{fw}.npz", **data)
    return ProfiledOps(tables, fw, "bf16", data_dir=tmp_path)


def by_point(batch, length, sec):
    return {(b, n): s for b, n, s in zip(batch, length, sec, strict=True)}


def test_measured_layout_is_the_table_unscaled(configs):
    # SGLang's H100 decode and vLLM's H100 prefill tables measured 32/32 heads directly
    for fw, prefix in (("sglang", "gen"), ("vllm", "ctx")):
        cost = build("meta-llama/Llama-2-7b-hf", "h100", framework=fw, model_config=configs["llama2"],
                     calibration=False)
        assert f"{prefix} attention" not in cost.source
        batch, length, sec = raw_rows("h100_sxm", fw, prefix, MHA)
        one = batch == 1
        order = np.argsort(length[one])
        length, sec = length[one][order], sec[one][order]
        t = cost.tables
        if prefix == "gen":  # batch-1 row: total KV = tokens per sequence = step + 1
            got = t.decode_s[0, np.searchsorted(t.decode_kv, length + 1)]
            assert t.decode_batch[0] == 1
        else:
            got = t.prefill_s[np.searchsorted(t.prefill_pairs, length * (length + 1) / 2)]
        np.testing.assert_allclose(got, 32 * np.maximum.accumulate(sec), rtol=1e-12)


# (GPU tables, framework, table, held-out layouts, predicted layout, source layout, ratio,
#  bounds on the error: median |e|, |mean e|, worst |e|). Decode: SGLang/TRT-LLM measured
# 32/32 KV heads; predicted from 8/8 (x4) it is exactly the Llama-2-7B-on-vLLM case. vLLM's
# own decode table is checked one step lower: 8/8 from 4/4.
CROSS = [
    ("h100_sxm", "sglang", "gen", BIG_MHA, MHA, "8/8", 4, (0.06, 0.02, 0.20)),
    ("h200_sxm", "sglang", "gen", BIG_MHA, MHA, "8/8", 4, (0.06, 0.02, 0.20)),
    ("a100_sxm", "sglang", "gen", BIG_MHA, MHA, "8/8", 4, (0.06, 0.02, 0.20)),
    ("h100_sxm", "trtllm", "gen", BIG_MHA, MHA, "8/8", 4, (0.06, 0.02, 0.20)),
    ("h100_sxm", "vllm", "gen", [(8, 8)], (8, 8, 128), "4/4", 2, (0.06, 0.02, 0.20)),
    ("h100_sxm", "vllm", "ctx", BIG_MHA, MHA, "8/8", 4, (0.16, 0.17, 0.50)),
    ("h100_sxm", "sglang", "ctx", BIG_MHA, MHA, "8/8", 4, (0.04, 0.01, 0.30)),
    ("a100_sxm", "trtllm", "ctx", BIG_MHA, MHA, "8/8", 4, (0.04, 0.01, 0.30)),
]


@pytest.mark.parametrize("tables, fw, prefix, drop, layout, source, ratio, bounds", CROSS)
def test_held_out_layout_is_predicted_from_a_measured_one(tmp_path, tables, fw, prefix, drop, layout, source,
                                                          ratio, bounds):
    """Remove a measured layout, let the rules carry it from the nearest one left, compare.

    Found in these tables (median |error|, signed mean, worst points): decode 0.6-5.2 %,
    -0.5..+1.6 %, -19/+17 %; SGLang/TRT-LLM prefill 1.1-3.4 %, 0..+0.2 %, -28/+22 %. vLLM's
    prefill is the exception, 14.7 %, +16 %, -11/+49 %: its kernel runs 4 prompts of 8 heads
    up to 1.4x slower than 1 prompt of 32 heads at 512-4096 tokens. Floor + ratio x work
    alone gave 3.6-18 %, +0.2..+19 %, -51/+139 %: kernels pick split-KV and tile shapes by
    the number of (sequence, head) units, which the batch-equivalent rule keeps and it does not.
    """
    ops = held_out(tmp_path, tables, fw, prefix, drop)
    shape = AttentionShape(*layout)
    if prefix == "gen":  # keyed by (batch, step) as measured; decode_rows counts step + 1 tokens
        pred = {(b, n): s for b, (ctx, sec) in ops.decode_rows(shape).items() for n, s in zip(ctx - 1, sec, strict=True)}
    else:
        pred = by_point(*ops.prefill_rows(shape))
    src_rows = raw_rows(tables, fw, prefix, (*map(int, source.split("/")), 128))
    [note] = ops.notes
    assert note.startswith(f"{prefix} attention from measured {source} heads at {ratio}x the batch (")
    assert note.endswith(f" points; the rest work scaled x{ratio:.2f} over its {src_rows[2].min() * 1e6:.1f} us "
                         "launch floor)")
    measured = by_point(*raw_rows(tables, fw, prefix, layout))
    scaled = by_point(*src_rows[:2], scale_work(src_rows[2], ratio))
    keys = sorted(set(pred) & set(measured))
    assert len(keys) >= 90
    want = np.array([measured[k] for k in keys])
    err = np.array([pred[k] for k in keys]) / want - 1
    old = np.array([scaled[k] for k in keys]) / want - 1
    median, mean, worst = bounds
    assert np.median(np.abs(err)) <= median and abs(err.mean()) <= mean and np.abs(err).max() <= worst
    assert np.median(np.abs(err)) < np.median(np.abs(old)) and np.abs(err).max() < np.abs(old).max()


def test_mha_decode_is_the_8_kv_head_table_at_four_times_the_batch(configs):
    """Llama-2-7B (32/32) on vLLM, whose decode tables stop at 8 KV heads: batch 1 is 8/8 at batch
    4, the same KV bytes, (sequence, head) units and launch; times 32 layers."""
    cost = build("meta-llama/Llama-2-7b-hf", "h100", model_config=configs["llama2"], calibration=False)
    assert "gen attention from measured 8/8 heads at 4x the batch (" in cost.source
    batch, length, sec = raw_rows("h100_sxm", "vllm", "gen", (8, 8, 128))

    def row(b):
        r = np.flatnonzero(batch == b)
        r = r[np.argsort(length[r])]
        return length[r] + 1, sec[r]  # step = tokens already cached

    ctx, t4 = row(4)
    t = cost.tables
    assert t.decode_batch[0] == 1
    got = t.decode_s[0, np.searchsorted(t.decode_kv, ctx)]
    np.testing.assert_allclose(got, 32 * np.maximum.accumulate(t4), rtol=1e-12)
    # launch-bound short contexts: ~0.39-0.52 ms over 32 layers where 4x the whole batch-1 time said 1.5-1.8 ms
    short = ctx <= 1024
    assert np.all(got[short] < 0.3 * 32 * 4 * row(1)[1][short])
    assert got[0] == pytest.approx(32 * sec.min(), rel=0.1)
    # batch 512 is 8/8 at batch 2048 where that was measured (steps <= 255); batch 1024 would need
    # 4096, past the table: both fall back to the floor plus 4x the work
    rows = ProfiledOps("h100_sxm", "vllm", "bf16").decode_rows(AttentionShape(*MHA))
    floor = sec.min()
    t512 = row(512)[1]
    want = floor + 4 * (t512 - floor)
    want[: len(row(2048)[1])] = row(2048)[1]
    np.testing.assert_allclose(rows[512.0][1], want, rtol=1e-12)
    np.testing.assert_allclose(rows[1024.0][1], floor + 4 * (row(1024)[1] - floor), rtol=1e-12)


def test_fewer_heads_read_a_smaller_batch_and_uneven_ratios_scale_the_work(tmp_path):
    # 8/8 from 16/16 (ratio 1/2): batch 2b is 16/16 at batch b; batch 1 (half a sequence) scales
    ops = held_out(tmp_path, "h100_sxm", "sglang", "gen", [(1, 1), (2, 2), (4, 4), (8, 8), (12, 12)])
    rows, src = ops.decode_rows(AttentionShape(8, 8, 128)), ops.decode_rows(AttentionShape(16, 16, 128))
    for b in (2.0, 16.0, 2048.0):
        n = len(rows[b][1])
        np.testing.assert_array_equal(rows[b][1], src[b / 2][1][:n])
    floor = min(sec.min() for _, sec in src.values())
    np.testing.assert_allclose(rows[1.0][1], floor + 0.5 * (src[1.0][1] - floor), rtol=1e-12)
    # 28/28 from vLLM's 8/8 (x3.5): no whole batch matches, every point scales
    ops = ProfiledOps("h100_sxm", "vllm", "bf16")
    scaled, src = ops.decode_rows(AttentionShape(28, 28, 128)), ops.decode_rows(AttentionShape(8, 8, 128))
    floor = min(sec.min() for _, sec in src.values())
    assert ops.notes == [f"gen attention from measured 8/8 heads: work scaled x3.50 over its {floor * 1e6:.1f} us "
                         "launch floor"]
    for b, (_, sec) in src.items():
        np.testing.assert_allclose(scaled[b][1], floor + 3.5 * (sec - floor), rtol=1e-12)


@pytest.mark.parametrize("gpu", ["h100", "h200", "a100"])
@pytest.mark.parametrize("fw", ["vllm", "sglang", "trtllm"])
@pytest.mark.parametrize("model", ["llama2", "mha28"])
def test_scaled_grids_stay_monotone(configs, gpu, fw, model):
    cost = build(model, gpu, framework=fw, model_config=configs[model], calibration=False)
    assert cost.source.startswith("profiled:")
    t = cost.tables
    assert np.all(np.diff(t.decode_s, axis=0) >= 0) and np.all(np.diff(t.decode_s, axis=1) >= 0)
    for grid in (t.prefill_s, t.linear_s, t.head_s):
        assert np.all(np.diff(grid) >= 0)
