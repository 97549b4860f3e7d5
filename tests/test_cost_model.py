import dataclasses

import numpy as np
import pytest
import torch

from zcode.hardware.cost_model import (
    GGUF_KINDS,
    CostModel,
    fit_coefficients,
    format_weight_bytes,
    gguf_kind,
    predict,
    step_features,
    weight_byte_floors,
)
from zcode.harness.plan import ExecutionPlan
from zcode.quant import apply_precision, quantizable_modules
from zcode.quant.formats import FLOAT_GEMV_MAX_ROWS


def test_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    truth = {"step": 2.0, "int8:MB": 0.07, "int8:calls": 0.015, "kv:MB": 0.2, "int4:MB": 0.0}
    rows = [
        {
            "step": 1.0,
            "int8:MB": rng.uniform(10, 500),
            "int8:calls": rng.integers(1, 300),
            "kv:MB": rng.uniform(0, 50),
            "int4:MB": rng.uniform(0, 100),
        }
        for _ in range(30)
    ]
    times = [sum(truth[n] * row[n] for n in truth) for row in rows]
    fitted = fit_coefficients(rows, times)
    assert fitted.keys() == truth.keys()
    for name, value in truth.items():
        assert fitted[name] == pytest.approx(value, abs=1e-9)


def test_fit_with_noise_stays_close_and_non_negative():
    """Noisy times whose least-squares fit gives a feature a negative cost (a step that gets
    faster per call): the fit clamps it to 0, keeps the others close, and is still a fit."""
    rng = np.random.default_rng(1)
    truth = np.array([1.5, 0.05, 0.0])  # the calls feature costs nothing
    x = np.column_stack([np.ones(200), rng.uniform(50, 600, 200), rng.integers(50, 300, 200)])
    times = x @ truth * rng.normal(1.0, 0.02, 200) - 0.002 * x[:, 2]  # ... measured as negative
    unconstrained = np.linalg.lstsq(x / times[:, None], np.ones_like(times), rcond=None)[0]
    assert unconstrained[2] < 0  # what a plain least-squares fit would predict
    rows = [dict(zip(["step", "a:MB", "a:calls"], r)) for r in x]
    fitted = fit_coefficients(rows, times.tolist())
    assert fitted["a:calls"] == 0.0
    assert fitted["a:MB"] == pytest.approx(0.05, rel=0.05)
    assert fitted["step"] > 0


def test_fit_keeps_each_floor_and_fits_the_rest():
    rng = np.random.default_rng(2)
    truth = {"step": 1.0, "a:MB": 0.02, "a:calls": 0.05}
    rows = [
        {"step": 1.0, "a:MB": rng.uniform(10, 500), "a:calls": rng.integers(1, 300)}
        for _ in range(30)
    ]
    times = [sum(truth[n] * row[n] for n in truth) for row in rows]
    fitted = fit_coefficients(rows, times, floors={"a:MB": 0.02})
    for name, value in truth.items():
        assert fitted[name] == pytest.approx(value, abs=1e-9)
    # A floor above the truth binds: the bytes cost exactly it, the others absorb the rest.
    raised = fit_coefficients(rows, times, floors={"a:MB": 0.03})
    assert raised["a:MB"] == pytest.approx(0.03, abs=1e-12)
    assert raised["a:calls"] < truth["a:calls"] or raised["step"] < truth["step"]


def test_weight_bytes_cost_at_least_the_read_bandwidth():
    rows = [{"step": 1.0, "int8:MB": 5.0, "int8:calls": 3.0}, {"bf16:MB": 2.0, "kv:MB": 1.0}]
    assert weight_byte_floors(rows, read_gbps=80.0) == {"int8:MB": 1 / 80, "bf16:MB": 1 / 80}


def test_the_wide_model_steps_lift_the_floor_of_the_kinds_they_measure():
    from zcode.hardware import cost_fit

    # "a" streams at 50 GB/s, faster than the probe's 30 ("b" at 20): the wide model's steps
    # of kind "a" pin its bytes, so only "b", measured on SmolLM2 alone, keeps the floor.
    truth = {"step": 1.0, "a:MB": 0.02, "b:MB": 0.05, "a:calls": 0.05, "b:calls": 0.05}
    rng = np.random.default_rng(3)
    measurements = []
    for i in range(40):
        wide = i % 2 == 0
        kind = "a" if i % 4 < 2 else "b"
        features = {"step": 1.0, f"{kind}:MB": rng.uniform(50, 900), f"{kind}:calls": 100.0}
        model = "wide" if wide and kind == "a" else "smollm2"
        spec = cost_fit.PlanSpec(kind, "float32", dict, "dense", model=model)
        ms = sum(truth[n] * v for n, v in features.items())
        measurements.append(cost_fit.Measurement(spec, "decode", 1, 64, 1, features, ms))
    fitted = cost_fit._fit(measurements, read_gbps=30.0)
    assert fitted["a:MB"] == pytest.approx(0.02, rel=1e-6)
    assert fitted["b:MB"] == pytest.approx(0.05, rel=1e-6)  # above its floor: fitted as is
    floored = cost_fit._fit(measurements, read_gbps=10.0)  # a floor of 0.1 ms/MB
    assert floored["b:MB"] == pytest.approx(0.1) and floored["a:MB"] == pytest.approx(0.02)


def test_predict_refuses_an_unfitted_kind():
    with pytest.raises(ValueError, match="w4a8:MB"):
        predict({"step": 1.0}, {"step": 1.0, "w4a8:MB": 3.0})


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    from zcode import LLM

    return LLM(str(tiny_checkpoint("llama").path), dtype="float32").model


@pytest.mark.parametrize("fmt", ["int8", "int4-g32", "bf16", "w8a8"])
def test_plan_as_data_counts_what_the_quantized_model_reads(llama, fmt):
    """Features of a plan given as data equal those of the model quantized by that plan."""
    import copy

    plan = {name: fmt for name in quantizable_modules(llama)}
    predicted = step_features(llama, plan, 3, 40, num_seqs=3)
    quantized = copy.deepcopy(llama)
    replaced = apply_precision(quantized, plan)
    measured = step_features(quantized, None, 3, 40, num_seqs=3)
    assert predicted == pytest.approx(measured)
    kind = fmt.split("-g")[0]
    assert measured[f"{kind}:MB"] * 1e6 == pytest.approx(
        sum(m.weight_bytes for m in replaced.values())
    )
    assert measured[f"{kind}:calls"] == len(replaced)


def test_ggml_types_are_priced_by_the_kernel_family_running_them():
    """The 32-weight 4/5-bit blocks one kind, the K-quants another, Q8_0 and the float rows each
    their own; a type without a C++ kernel is no fitted kind (predicting it raises)."""
    kinds = {t: gguf_kind(f"gguf-{t}") for t in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")}
    kinds |= {t: gguf_kind(f"gguf-{t}") for t in ("q4_k", "q5_k", "q6_k", "f32", "f16", "bf16")}
    assert kinds == {
        **dict.fromkeys(("q4_0", "q4_1", "q5_0", "q5_1"), "gguf-q4"),
        "q8_0": "gguf-q8_0",
        **dict.fromkeys(("q4_k", "q5_k", "q6_k"), "gguf-k"),
        **dict.fromkeys(("f32", "f16", "bf16"), "gguf-float"),
    }
    assert gguf_kind("gguf-q2_k") not in GGUF_KINDS


@pytest.mark.parametrize("file_type", ["q4_k_m", "bf16"])
def test_a_gguf_files_linears_as_data_count_what_they_read(llama, file_type):
    """The fit's GGUF plans (a llama.cpp file's linears, gguf_file_linears): features of their
    formats given as data equal those of the model they are swapped into, each kind's MB the
    blocks' own bytes."""
    import copy

    from zcode.hardware.cost_fit import gguf_file_linears
    from zcode.quant.variants import swap

    modules = gguf_file_linears(llama, file_type)
    formats = {name: m.format for name, m in modules.items()}
    predicted = step_features(llama, formats, 3, 40, num_seqs=3)
    swapped = copy.deepcopy(llama)
    swap(swapped, modules)
    measured = step_features(swapped, None, 3, 40, num_seqs=3)
    assert predicted == pytest.approx(measured)
    kind_bytes: dict[str, int] = {}
    for m in modules.values():
        kind = gguf_kind(m.format)
        kind_bytes[kind] = kind_bytes.get(kind, 0) + m.packed.data.nbytes
    assert {k: measured[f"{k}:MB"] * 1e6 for k in kind_bytes} == pytest.approx(kind_bytes)
    assert set(modules) == set(quantizable_modules(llama))


@pytest.mark.parametrize("fmt", [None, "int8"])
def test_a_moe_layers_routed_experts_cost_one_call_per_projection_where_fused(tiny_checkpoint, fmt):
    """fp32 experts (moe_fused) and GGUF ones (ggml_moe) run a layer's routed experts in one
    call: a call per projection and layer, whatever the experts; int8 experts run each expert's
    own module: a call per expert the step is expected to touch (top_k / E at one token)."""
    from zcode.layers.moe import moe_layers
    from zcode.loader import load_model

    net, _ = load_model(tiny_checkpoint("glm4_moe").path)
    plan = None if fmt is None else {n: fmt for n in quantizable_modules(net) if ".experts." in n}
    features = step_features(net, plan, 1, 10)
    moes = moe_layers(net)
    expert_linears = [n for n in quantizable_modules(net) if ".experts." in n]
    others = [n for n in quantizable_modules(net) if ".experts." not in n]
    if fmt is None:
        want = {"dense-float32:calls": len(others) + 3 * len(moes)}
    else:
        share = moes[0].gate.top_k / moes[0].gate.num_experts
        want = {"dense-float32:calls": len(others), "int8:calls": share * len(expert_linears)}
    assert {k: v for k, v in features.items() if k.endswith(":calls")} == pytest.approx(want)


@pytest.mark.parametrize("fmt", [None, "int8", "gguf-q4_0"])
def test_a_moe_layer_whose_float_experts_run_the_fused_op_costs_a_layer_term(tiny_checkpoint, fmt):
    """`moe-fused:layers` per MoE layer run whose routed experts are float Linears (moe_fused),
    eager only; not for a skipped layer, nor where the experts are GGUF blocks (ggml_moe) or
    quantized modules."""
    from zcode.layers.moe import moe_layers
    from zcode.loader import load_model

    net, _ = load_model(tiny_checkpoint("glm4_moe").path)
    moes = moe_layers(net)
    plan = {} if fmt is None else {n: fmt for n in quantizable_modules(net) if ".experts." in n}
    features = step_features(net, plan, 1, 10)
    assert features.get("moe-fused:layers", 0) == (len(moes) if fmt is None else 0)
    assert "moe-fused:layers" not in step_features(net, plan, 1, 10, compiled=True)
    first_moe = next(i for i, layer in enumerate(net.model.layers) if layer.mlp in moes)
    skipped = step_features(net, ExecutionPlan(skip_layers=(first_moe,)), 1, 10)
    assert skipped["moe-fused:layers"] == len(moes) - 1


def test_dense_features_count_parameter_bytes_and_flops(llama):
    names = quantizable_modules(llama)
    linears = [llama.get_submodule(n) for n in names]
    features = step_features(llama, None, 1, 10)
    assert features["dense-float32:MB"] * 1e6 == sum(m.weight.nbytes for m in linears)
    assert features["dense-float32:gemv-GFLOP"] == 0  # one row: the bytes term carries it
    # A few rows run the float GEMV (its own rate), a prompt's many rows F.linear's GEMM
    batched = step_features(llama, None, 4, 10, num_seqs=4)
    assert batched["dense-float32:gemv-GFLOP"] * 1e9 == pytest.approx(
        sum(2 * 3 * m.weight.numel() for m in linears)
    )
    assert "dense-float32:GFLOP" not in batched
    prompt = step_features(llama, None, FLOAT_GEMV_MAX_ROWS + 1, 40)
    body = [m for n, m in zip(names, linears) if n != "lm_head"]  # lm_head: the last row only
    assert prompt["dense-float32:GFLOP"] * 1e9 == pytest.approx(
        sum(2 * FLOAT_GEMV_MAX_ROWS * m.weight.numel() for m in body)
    )
    skipped = step_features(llama, ExecutionPlan(skip_layers=(0,)), 1, 10)
    assert skipped["dense-float32:calls"] == features["dense-float32:calls"] - 7
    assert skipped["kv:MB"] < features["kv:MB"]


def test_sparse_ffns_are_their_own_kind_at_the_plans_density(llama):
    """A plan naming an FFN level runs every dense FFN through the row-skipping kernel
    (SparseMLP): its bytes, scaled by the level's density, are priced as `sparse-float32`, the
    other linears as before; a compiled step (dense levels only) multiplies densely."""
    dense = step_features(llama, None, 1, 10)
    extras = (("ffn_sparsity_in", "0.5"), ("ffn_sparsity_mid", "0.7"))
    plan = ExecutionPlan(ffn_density=0.4, extras=extras)
    sparse = step_features(llama, plan, 1, 10)
    ffn = [m for n, m in llama.named_modules() if ".mlp." in n and isinstance(m, torch.nn.Linear)]
    ffn_mb = sum(m.weight.nbytes for m in ffn) / 1e6
    assert sparse["sparse-float32:MB"] == pytest.approx(0.4 * ffn_mb)
    assert sparse["sparse-float32:calls"] == len(ffn) > 0
    assert sparse["dense-float32:MB"] == pytest.approx(dense["dense-float32:MB"] - ffn_mb)
    compiled = step_features(llama, ExecutionPlan(extras=extras), 1, 10, compiled=True)
    assert "sparse-float32:MB" not in compiled
    assert compiled["dense-float32:MB"] == pytest.approx(dense["dense-float32:MB"])
    # SparseMLPs given in place of the FFNs (the cost fit's): their linears counted once
    from zcode.sparsity.sparse_mlp import SparseMLP

    swapped = {
        f"model.layers.{i}.mlp": SparseMLP(layer.mlp, 0.1, 0.1)
        for i, layer in enumerate(llama.model.layers)
    }
    given = step_features(llama, ExecutionPlan(ffn_density=0.4), 1, 10, modules=swapped)
    assert given == pytest.approx(sparse)


def test_sparse_ffns_on_int8_rows_are_priced_at_the_int8_formats_bytes(llama):
    """A plan whose FFN level reads int8 rows: kind `sparse-int8`, the int8 format's bytes of
    each FFN linear at the level's density, whatever rows the model's SparseMLPs are set to now;
    a plan naming no level prices the rows the SparseMLPs given are set to."""
    from zcode.hardware.cost_model import format_weight_bytes
    from zcode.sparsity.sparse_mlp import SparseMLP

    extras = (("ffn_sparsity_in", "0"), ("ffn_sparsity_mid", "0"), ("ffn_weights", "int8"))
    plan = ExecutionPlan(ffn_density=0.5, extras=extras)
    ffn = [m for n, m in llama.named_modules() if ".mlp." in n and isinstance(m, torch.nn.Linear)]
    int8_mb = sum(format_weight_bytes(*m.weight.shape, "int8") for m in ffn) / 1e6
    int8 = step_features(llama, plan, 1, 10)
    assert int8["sparse-int8:MB"] == pytest.approx(0.5 * int8_mb)
    assert "sparse-float32:MB" not in int8
    swapped = {
        f"model.layers.{i}.mlp": SparseMLP(layer.mlp, 0.1, 0.1)
        for i, layer in enumerate(llama.model.layers)
    }
    as_planned = step_features(llama, plan, 1, 10, modules=swapped)  # modules read fp32 rows
    assert as_planned == pytest.approx(int8)
    for mlp in swapped.values():
        mlp.set_weight_format("int8")
    as_set = step_features(llama, ExecutionPlan(ffn_density=0.5), 1, 10, modules=swapped)
    assert as_set == pytest.approx(int8)


def test_head_paged_kv_adds_its_gathers(llama):
    """An engine keeping KV per head gathers each attention layer's pages per sequence."""
    flat = step_features(llama, ExecutionPlan(skip_layers=(0,)), 3, 40, num_seqs=3)
    paged = step_features(llama, ExecutionPlan(skip_layers=(0,)), 3, 40, num_seqs=3, kv_paged=True)
    layers_run = len(llama.attention_layers()) - 1
    assert paged["kv-paged:calls"] == layers_run > 0
    assert paged["kv-paged:rows"] == 3 * layers_run
    assert paged["kv-paged:MB"] == flat["kv:MB"] == paged["kv:MB"] > 0
    assert {k: v for k, v in paged.items() if not k.startswith("kv-paged:")} == flat
    # the compiled fit measured no such engine: its steps are priced as flat KV's, not refused
    zero = dict.fromkeys(flat, 0.0)
    cost = CostModel(zero | {"step": 1.0}, {}, "k", compiled_decode=zero | {"step": 0.5})
    step = dict(num_tokens=3, num_seqs=3, context_len=40, kv_paged=True)
    assert cost.predict_step_ms(llama, compiled=True, **step) == 0.5


def test_format_bytes_match_the_formats():
    weight = torch.randn(100, 70)
    from zcode.quant import quantize_weight

    for fmt in ("int8", "int4-g64", "w4a8"):
        assert format_weight_bytes(100, 70, fmt) == quantize_weight(weight, fmt).weight_bytes


def test_cache_round_trip(tmp_path):
    cost = CostModel({"step": 1.0, "int8:MB": 0.1}, {"step": 3.0}, "abc", ("int8",))
    cost.save(tmp_path / "c.json")
    assert CostModel.load(tmp_path / "c.json") == cost
    (tmp_path / "bad.json").write_text("{")
    assert CostModel.load(tmp_path / "bad.json") is None


def test_compiled_steps_are_predicted_by_their_own_fit(llama, tmp_path):
    """Without a fit of compiled steps, a compiled prediction is refused (naming the command
    that fits it); with one, its coefficients price the step, and lm_head computes every
    token's logits (a verifying graph's), not only each sequence's last."""
    zero = dict.fromkeys(step_features(llama, None, 8, 16, 2), 0.0)
    eager = CostModel(zero | {"step": 1.0, "dense-float32:gemv-GFLOP": 1.0}, {}, "k")
    step = dict(num_tokens=8, num_seqs=2, context_len=16)
    with pytest.raises(ValueError, match="--fit-cost --compiled"):
        eager.predict_step_ms(llama, compiled=True, **step)
    fit = zero | {"step": 0.25, "dense-float32:gemv-GFLOP": 1.0}
    compiled = dataclasses.replace(eager, compiled_decode=fit)
    head = llama.lm_head
    head_gflop = 2 * head.out_features * head.in_features / 1e9
    # lm_head over 8 rows compiled against 2 eager: 6 more rows of its arithmetic
    gap = compiled.predict_step_ms(llama, compiled=True, **step) - 0.25
    assert gap - (eager.predict_step_ms(llama, **step) - 1.0) == pytest.approx(6 * head_gflop)
    compiled.save(tmp_path / "c.json")
    assert CostModel.load(tmp_path / "c.json") == compiled


def test_a_compiled_fit_is_added_to_the_cached_one(tmp_path, monkeypatch):
    """load_or_fit(compiled=True) fits compiled steps once, beside the cached eager fit (which
    it does not refit), and caches both."""
    from zcode.hardware import cost_fit
    from zcode.hardware.cost_model import cache_path
    from zcode.hardware.probe import HardwareInfo

    info = HardwareInfo.__new__(HardwareInfo)
    object.__setattr__(info, "read_bandwidth_gbps", 50.0)
    monkeypatch.setattr("zcode.hardware.cost_model.cost_key", lambda info=None: "k")
    eager = CostModel({"step": 1.0}, {"step": 2.0}, "k")
    eager.save(cache_path("k", tmp_path))
    fits = []

    def fit_compiled(cost, read_gbps):
        assert read_gbps == 50.0  # the floor of its weight bytes
        fits.append(cost)
        return dataclasses.replace(cost, compiled_decode={"step": 0.5}), []

    monkeypatch.setattr(cost_fit, "fit_compiled", fit_compiled)
    monkeypatch.setattr(cost_fit, "fit_smollm2", lambda *args: pytest.fail("refit the eager cost"))
    for _ in range(2):
        cost = CostModel.load_or_fit(info, cache_dir=tmp_path, compiled=True)
        assert cost == dataclasses.replace(eager, compiled_decode={"step": 0.5})
    assert fits == [eager]


def test_a_fit_on_a_busy_machine_is_recorded_and_reported(tmp_path, monkeypatch):
    from zcode.hardware import cost_fit
    from zcode.hardware.cost_model import format_cost

    monkeypatch.setattr(cost_fit, "measure_plans", lambda plans, settings: [])
    monkeypatch.setattr(cost_fit, "fit_coefficients", lambda features, ms, floors: {"step": 1.0})
    monkeypatch.setattr(cost_fit.os, "cpu_count", lambda: 2)
    # the bandwidth before and after the steps: the higher is the one they were timed at
    bandwidths = iter([30.0, 41.5, 44.0, 33.0])
    monkeypatch.setattr(cost_fit, "read_bandwidth_gbps", lambda: next(bandwidths))
    for (load, busy), gbps in zip(((0.2, False), (3.0, True)), (41.5, 44.0)):
        monkeypatch.setattr(cost_fit, "measure_other_load", lambda fn, load=load: (fn(), load))
        cost, _ = cost_fit.fit_smollm2("k")
        assert cost.fit_load_per_core == load / 2 and cost.fitted_under_load is busy
        assert ("refit on an idle machine" in format_cost(cost)) is busy
        assert cost.fit_read_gbps == gbps and f"at {gbps:.1f} GB/s read" in format_cost(cost)
        cost.save(tmp_path / "c.json")
        assert CostModel.load(tmp_path / "c.json") == cost


def test_format_cost_reports_rates_per_kind():
    from zcode.hardware.cost_model import format_cost

    assert "not fitted" in format_cost(None)
    cost = CostModel({"step": 1.5, "int8:MB": 0.1, "int8:calls": 0.015}, {}, "k", ("a", "b"))
    line = format_cost(cost)
    assert "1.50 ms/step" in line and "int8 10.0 GB/s + 15 us/call" in line


def test_the_fit_times_verifying_steps_of_the_width_it_names(tiny_checkpoint):
    """The compiled fit's verifying setting: every timed step computes 1 + 3 drafted tokens of
    each sequence in one forward."""
    from zcode import LLM
    from zcode.hardware import cost_fit

    llm = LLM(tiny_checkpoint("llama").path, kv_cache_bytes=1 << 20, block_size=4)
    engine = cost_fit.verifying_engine(llm.model, llm.tokenizer, llm.config, max_drafts=3)
    tokens_per_seq = []
    execute = engine.runner.execute

    def counting(rows, *args):
        tokens_per_seq.append([s.num_new_tokens + len(s.seq.spec_token_ids) for s in rows])
        return execute(rows, *args)

    engine.runner.execute = counting
    cost_fit._measure_decode(engine, 2, 16, width=4)
    assert tokens_per_seq[1:] == [[4, 4]] * (1 + cost_fit.NUM_DECODE_STEPS)  # after the prefill
    tokens_per_seq.clear()
    cost_fit._measure_decode(engine, 2, 16, width=1)
    assert tokens_per_seq[1:] == [[1, 1]] * (1 + cost_fit.NUM_DECODE_STEPS)
