"""FP8 on the CPU, through the real servers where it serves: dynamic W8A8 (weights quantized at load), compressed-
tensors and transformers' fp8 checkpoints loaded as stored, an FP8 KV cache; each judged against plain torch.

Bounds, stated: Kiln's FP8 forward is the reference's math (float8 weights times their row scales, activations
rounded to float8 per token) up to float32 summation order, so logits agree within LOGIT_BOUND. Block-wise
checkpoints are quantized once more per row at load: each weight moves by at most one float8 rounding (2^-4 of its
value) from the checkpoint's dequantized weight.
"""

import json

import grpc
import pytest
import torch
from conftest import BackgroundServer
from fp8_reference import (
    compressed_tensors_checkpoint,
    dequantized_reference,
    edit_checkpoint,
    fake_quantized,
    transformers_fp8_checkpoint,
)
from test_exec_service import prompt_of
from test_model_families import FAMILY_CONFIGS, TINY

from kiln.compilation.config import CompileConfig
from kiln.errors import InvalidArgument
from kiln.model.causal_lm import build_model, weights_bytes
from kiln.model.spec import resolve
from kiln.quantization import model_quantization
from kiln.quantization.fp8_linear import FP8, fp8_linear, quantize_rows
from protos import common_pb2, exec_pb2

LOGIT_BOUND = 1e-4  # float32 model: the same FP8 math in another summation order
FP8_CONFIG = common_pb2.CompileConfig(device="cpu", max_compiled_tokens=64, quantization="fp8")
PROMPTS = [prompt_of(n, salt) for salt, n in enumerate([3, 17, 40])]
MAX_TOKENS = 8


def test_scaled_mm_is_the_dequantized_product():
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 3, 64), torch.randn(96, 64), torch.randn(96)
    q, scale = quantize_rows(w)
    assert q.dtype == FP8 and scale.shape == (96,)
    expected = fake_quantized(x, None) @ (q.float() * scale[:, None]).T + b
    torch.testing.assert_close(fp8_linear(x, q, scale, b, None), expected, atol=1e-4, rtol=1e-5)


def test_quantization_is_a_key_factor_and_checked_at_the_edge(monkeypatch):
    from kiln.compilation import cache_key

    resolved = resolve(common_pb2.ModelSpec(preset="tiny-llama"), "cpu")
    plain, fp8 = (CompileConfig.from_proto(common_pb2.CompileConfig(device="cpu", quantization=q)) for q in ("", "fp8"))
    assert fp8.quantization == "fp8" and fp8.to_proto().quantization == "fp8"
    assert cache_key.digest(cache_key.key_factors(resolved, plain)) != \
        cache_key.digest(cache_key.key_factors(resolved, fp8))
    with pytest.raises(InvalidArgument, match="config.quantization: 'int4' is not one of"):
        CompileConfig.from_proto(common_pb2.CompileConfig(device="cpu", quantization="int4"))
    monkeypatch.setattr(model_quantization, "_cpu_fp8_unsupported", lambda: "this CPU has no FP8 GEMM")
    with pytest.raises(InvalidArgument, match="config.quantization: fp8 asked for, but this CPU has no FP8 GEMM"):
        CompileConfig.from_proto(common_pb2.CompileConfig(device="cpu", quantization="fp8"))


def test_dummy_fp8_weights_are_the_bf16_dummy_weights_quantized_and_half_the_bytes():
    """Layer by layer (a 70B loads so) gives the very values of quantizing the whole dummy model."""
    from kiln.model.causal_lm import transformers_model

    resolved = resolve(common_pb2.ModelSpec(preset="tiny-llama", dtype="bfloat16"), "cpu")
    fp8, bf16 = build_model(resolved, "cpu", quantization="fp8"), build_model(resolved, "cpu")
    layers = transformers_model(resolved, "cpu").model.layers
    whole = layers[1]
    for name in ("self_attn.k_proj", "mlp.down_proj"):
        kiln = fp8.layers.steps[1].layer.get_submodule(name)
        weight, scale = quantize_rows(whole.get_submodule(name).weight)
        assert torch.equal(kiln.weight[kiln.start:kiln.end].float(), weight.float())
        assert torch.equal(kiln.weight_scale[kiln.start:kiln.end], scale)
    linears = [m for m in layers.modules() if type(m) is torch.nn.Linear]
    weights, rows = sum(m.weight.numel() for m in linears), sum(m.out_features for m in linears)
    assert weights_bytes(bf16) - weights_bytes(fp8) == weights - 4 * rows  # 2 bytes a weight become 1, + scales


def _judge(stub, name: str, reference, prompts=PROMPTS, bound: float = LOGIT_BOUND) -> None:
    """Each served greedy token is the reference's best next token, within ``bound`` of its logit."""
    for prompt in prompts:
        tokens = []
        for response in stub.Generate(exec_pb2.GenerateRequest(model=name, prompt_ids=prompt, max_tokens=MAX_TOKENS,
                                                                temperature=0.0, ignore_eos=True)):
            tokens += response.token_ids
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
        chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert (logits.max(1).values - chosen).max() <= bound, (prompt, tokens)


@pytest.fixture(scope="module")
def fp8_stub(compile_server, trusted_keys, tmp_path_factory):
    """An exec server of its own (FP8 bundles are other keys), on the session's compile service."""
    from exec_service.server import ExecServerSettings, start_exec_server
    from kiln.rpc.grpc_server import CHANNEL_OPTIONS
    from protos import exec_pb2_grpc

    settings = ExecServerSettings("127.0.0.1:0", trusted_keys, compile_server.address,
                                  cache_dir=tmp_path_factory.mktemp("fp8-cache"))
    server = BackgroundServer(lambda: start_exec_server(settings))
    channel = grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS)
    yield exec_pb2_grpc.ExecServiceStub(channel)
    channel.close()
    server.stop()


def _load(stub, name: str, model: common_pb2.ModelSpec, **fields) -> exec_pb2.ModelSizing:
    request = exec_pb2.LoadModelRequest(name=name, model=model, config=FP8_CONFIG, kv_cache_bytes=4 << 20, **fields)
    events = list(stub.LoadModel(request))
    assert events[-1].HasField("ready")
    return events[-1].ready


def test_dynamic_fp8_serves_compiled_as_the_dequantized_reference(fp8_stub):
    model = common_pb2.ModelSpec(preset="tiny-llama")
    sizing = _load(fp8_stub, "fp8-dynamic", model, weights_seed=4)
    assert sizing.quantization == "fp8" and sizing.key.digest
    module = build_model(resolve(model, "cpu"), "cpu", seed=4, quantization="fp8")
    assert sizing.weights_bytes == weights_bytes(module)
    _judge(fp8_stub, "fp8-dynamic", dequantized_reference(module))


def test_a_quantized_head_serves_as_the_dequantized_reference_and_holds_fewer_bytes(fp8_stub):
    """``quantize_head``: the head is an FP8 linear too (its weight a byte a value and a scale a row), the embedding
    as it was; served greedy tokens are the reference's with the head dequantized."""
    model = common_pb2.ModelSpec(preset="tiny-llama")
    sizing = _load(fp8_stub, "fp8-head", model, weights_seed=4, quantize_head=True)
    assert sizing.quantize_head and sizing.quantization == "fp8"
    module = build_model(resolve(model, "cpu"), "cpu", seed=4, quantization="fp8", quantize_head=True)
    linears_only = build_model(resolve(model, "cpu"), "cpu", seed=4, quantization="fp8")
    head = linears_only.causal_lm.get_output_embeddings().weight
    assert sizing.weights_bytes == weights_bytes(module)
    assert weights_bytes(linears_only) - weights_bytes(module) == head.numel() * (head.element_size() - 1) \
        - 4 * head.shape[0]
    assert module.causal_lm.get_input_embeddings().weight.dtype == head.dtype
    _judge(fp8_stub, "fp8-head", dequantized_reference(module))


def test_a_quantized_head_needs_fp8(exec_stub):
    """Asked of a model in its own dtype: INVALID_ARGUMENT naming the field, before anything is served."""
    request = exec_pb2.LoadModelRequest(name="head-bf16", model=common_pb2.ModelSpec(preset="tiny-llama"),
                                        config=common_pb2.CompileConfig(device="cpu", max_compiled_tokens=64),
                                        kv_cache_bytes=4 << 20, quantize_head=True)
    with pytest.raises(grpc.RpcError) as err:
        list(exec_stub.LoadModel(request))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "quantize_head" in err.value.details()


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "FP8", "fp8-block"])
def test_fp8_checkpoints_serve_as_stored(fp8_stub, tmp_path, scheme):
    """compressed-tensors per-channel dynamic and per-tensor static; transformers' fp8 with 32x32 blocks."""
    if scheme == "fp8-block":
        transformers_fp8_checkpoint(tmp_path)
    else:
        compressed_tensors_checkpoint(tmp_path, scheme)
    model = common_pb2.ModelSpec(hf_dir=str(tmp_path))
    module = build_model(resolve(model, "cpu"), "cpu", weights=str(tmp_path))
    reference = dequantized_reference(module)
    if scheme == "fp8-block":  # one more float8 rounding of each weight than the checkpoint's own
        from safetensors.torch import load_file

        stored = load_file(tmp_path / "model.safetensors")
        name = "model.layers.0.mlp.down_proj"
        scales = stored[f"{name}.weight_scale_inv"].repeat_interleave(32, 0).repeat_interleave(32, 1)
        expected = stored[f"{name}.weight"].float() * scales
        kiln = module.layers.steps[0].layer.mlp.down_proj.dequantized()
        assert ((kiln - expected).abs() <= expected.abs() * 2 ** -4 + 1e-12).all()
    else:
        layer = module.layers.steps[0].layer.self_attn.q_proj
        assert (layer.input_scale is not None) == (scheme == "FP8")
    sizing = _load(fp8_stub, f"ckpt-{scheme.lower()}", model, weights=str(tmp_path))
    assert sizing.quantization == "fp8"
    _judge(fp8_stub, f"ckpt-{scheme.lower()}", reference)


def _missing_scale(tensors):
    del tensors["model.layers.1.self_attn.v_proj.weight_scale"]


def _wrong_shape_scale(tensors):
    tensors["model.layers.0.mlp.up_proj.weight_scale"] = torch.ones(64, 1)


def _bf16_weight(tensors):
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16)


def _nan_scale(tensors):
    tensors["model.layers.1.mlp.down_proj.weight_scale"][5, 0] = float("nan")


def _negative_scale(tensors):
    tensors["model.layers.0.self_attn.o_proj.weight_scale"][0, 0] *= -1


@pytest.mark.parametrize("edit, code, said", [
    (_missing_scale, grpc.StatusCode.FAILED_PRECONDITION, "1 missing: model.layers.1.self_attn.v_proj.weight_scale"),
    (_wrong_shape_scale, grpc.StatusCode.FAILED_PRECONDITION,
     "model.layers.0.mlp.up_proj.weight_scale [64, 1] where the model has [128, 1]"),
    (_bf16_weight, grpc.StatusCode.FAILED_PRECONDITION, "model.layers.0.mlp.up_proj.weight (BF16)"),
    # would load, report ready and serve NaN logits (every token the same id) or flipped rows
    (_nan_scale, grpc.StatusCode.FAILED_PRECONDITION,
     "model.layers.1.mlp.down_proj.weight_scale[5, 0] is nan; a scale must be finite and not negative"),
    (_negative_scale, grpc.StatusCode.FAILED_PRECONDITION, "model.layers.0.self_attn.o_proj.weight_scale[0, 0] is -"),
], ids=["missing-scale", "wrong-shape-scale", "not-fp8", "nan-scale", "negative-scale"])
def test_a_broken_fp8_checkpoint_is_refused_before_anything_is_built(fp8_stub, tmp_path, edit, code, said):
    compressed_tensors_checkpoint(tmp_path, "FP8_DYNAMIC")
    edit_checkpoint(tmp_path, edit)
    with pytest.raises(grpc.RpcError) as raised:
        _load(fp8_stub, "broken", common_pb2.ModelSpec(hf_dir=str(tmp_path)), weights=str(tmp_path))
    assert raised.value.code() == code and said in raised.value.details(), raised.value.details()


def test_a_static_activation_scale_of_zero_is_refused(fp8_stub, tmp_path):
    """An input_scale divides the activations: 0 would turn every one to infinity."""
    compressed_tensors_checkpoint(tmp_path, "FP8")
    name = "model.layers.0.self_attn.k_proj.input_scale"
    edit_checkpoint(tmp_path, lambda tensors: tensors[name].zero_())
    with pytest.raises(grpc.RpcError) as raised:
        _load(fp8_stub, "zero-input-scale", common_pb2.ModelSpec(hf_dir=str(tmp_path)), weights=str(tmp_path))
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"{name} is 0.0; a scale must be finite and positive" in raised.value.details(), raised.value.details()


@pytest.mark.parametrize("edit, said", [
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=32),
     "quantization_config.config_groups.group_0.weights.group_size=32"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(type="int"),
     "quantization_config.config_groups.group_0.weights.type='int'"),
    (lambda q: q.update(quant_method="awq"), "quantization_config.quant_method='awq'"),
    (lambda q: q.update(kv_cache_scheme={"num_bits": 8}), "quantization_config.kv_cache_scheme="),
], ids=["group-scales", "int8", "awq", "kv-scheme"])
def test_an_unsupported_scheme_is_refused_naming_the_field(fp8_stub, tmp_path, edit, said):
    compressed_tensors_checkpoint(tmp_path, "FP8_DYNAMIC")
    raw = json.loads((tmp_path / "config.json").read_text())
    edit(raw["quantization_config"])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(grpc.RpcError) as raised:
        _load(fp8_stub, "unsupported", common_pb2.ModelSpec(hf_dir=str(tmp_path)), weights=str(tmp_path))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and said in raised.value.details()


def test_fp8_kv_cache_doubles_the_blocks_and_serves(fp8_stub):
    """bfloat16 model: the FP8 cache holds twice the blocks in the same bytes; served tokens are the best of the
    model with its keys and values rounded to float8 (the reference attention over an FP8 cache, eagerly)."""
    from exec_service.engine.kv.kv_cache import KVCacheSpec, allocate, allocate_scales
    from kiln.attention import reference

    model = common_pb2.ModelSpec(preset="tiny-llama", dtype="bfloat16")
    plain = _load(fp8_stub, "kv-bf16", model, kv_cache_dtype="")
    fp8 = _load(fp8_stub, "kv-fp8", model, kv_cache_dtype="fp8_e4m3")
    assert fp8.num_kv_blocks == 2 * plain.num_kv_blocks and fp8.kv_cache_dtype == "float8_e4m3fn"
    assert plain.kv_cache_dtype == "bfloat16"
    for name in ("kv-bf16", "kv-fp8"):  # the same tokens here: a tiny random model's logits are far apart
        served = [list(r.token_ids) for r in fp8_stub.Generate(exec_pb2.GenerateRequest(
            model=name, prompt_ids=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))]
        assert sum(map(len, served)) == MAX_TOKENS
    # The reference's round trip: what is read back is the value rounded to float8 at its head's scale.
    spec = KVCacheSpec(1, 2, 16, 4, FP8)
    cache, scales = allocate(spec, 2, "cpu")[0], allocate_scales(spec, 0.5, "cpu")[0]
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    reference.write_kv(k, v, cache, torch.tensor([0, 5, -1]), scales)
    back = reference.read_kv(cache[0].view(-1, 2, 16)[[0, 5]], scales, 0, torch.float32)
    assert torch.equal(back, (k[:2] / 0.5).to(FP8).float() * 0.5)
    for fields, said in [(dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype: 'fp8_e5m2'"),
                         (dict(kv_cache_dtype="fp8_e4m3", kv_cache_scale=5000.0), "kv_cache_scale: 5000.0 is outside"),
                         (dict(kv_cache_dtype="fp8_e4m3", kv_cache_scale=-1.0), "kv_cache_scale: -1.0 is outside"),
                         (dict(kv_cache_scale=2.0), "kv_cache_scale: given, but kv_cache_dtype is the model's")]:
        with pytest.raises(grpc.RpcError) as raised:
            _load(fp8_stub, "kv-bad", model, **fields)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and said in raised.value.details()


def test_an_fp8_layer_runs_one_fp8_product_per_projection_group():
    """q/k/v and gate/up each ask for their group's product; the compile service's pass leaves one quantize and one
    FP8 product (kiln::fp8_mm) per group (Dynamo and Inductor leave three): 7 become 4."""
    from compile_service.pipeline import _layer_examples
    from kiln.model.merged_projections import merge_identical_linears

    resolved = resolve(common_pb2.ModelSpec(preset="tiny-llama"), "cpu")
    module = build_model(resolved, "cpu", quantization="fp8")
    (step, inputs), = _layer_examples(module, resolved, CompileConfig(max_compiled_tokens=64))
    counts = []

    def count_products(gm, example_inputs):
        def products():
            return sum(n.op == "call_function" and n.target is torch.ops.kiln.fp8_mm.default for n in gm.graph.nodes)

        before = products()
        merged = merge_identical_linears(gm)
        counts.append((before, products(), merged))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(step, backend=count_products, fullgraph=True)(*inputs)
    assert counts == [(7, 4, 3)]


def tiny_fp8_layer_compiled(compile_pass=None) -> torch.Tensor:
    """tiny-llama's FP8 layer compiled whole by a backend that merges its linears and then, when given, runs
    ``compile_pass(gm)`` (a pass under test, on the CPU, which the compile service leaves unpassed); its output."""
    from compile_service.pipeline import _layer_examples
    from kiln.model.merged_projections import merge_identical_linears

    resolved = resolve(common_pb2.ModelSpec(preset="tiny-llama"), "cpu")
    module = build_model(resolved, "cpu", quantization="fp8")
    (step, inputs), = _layer_examples(module, resolved, CompileConfig(max_compiled_tokens=64))

    def backend(gm, example_inputs):
        merge_identical_linears(gm)
        if compile_pass is not None:
            compile_pass(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        return torch.compile(step, backend=backend, fullgraph=True)(*inputs)


def test_the_quantizes_inductor_fuses_badly_are_given_kilns_kernel():
    """The compile's pass gives kiln::quantize_kernel the input of down (SiLU(gate) x up, the SiLU and the product
    with it) and of o (the attention op's output), and leaves the quantizes after the norms (q/k/v, gate/up) to
    Inductor's fusion; the routed graph computes what the unrouted one does. On the CPU the compile does not route
    (the pass is asked to here): the op's CPU code is the same torch ops, unfused."""
    import torch.nn.functional as F

    from kiln.quantization.activation_quant import QUANTIZE_TOKENS, route_activation_quantize

    seen = {}

    def route(gm):
        seen["on_cuda_only"] = route_activation_quantize(gm)
        seen["routed"] = route_activation_quantize(gm, devices=("cpu",))
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        seen["kernels"] = sorted(n.args[1] is not None for n in calls
                                 if n.target is torch.ops.kiln.quantize_kernel.default)
        seen["left"] = sum(n.target in QUANTIZE_TOKENS for n in calls)
        seen["silu"] = sum(n.target is F.silu for n in calls)

    unrouted, routed = tiny_fp8_layer_compiled(), tiny_fp8_layer_compiled(route)
    assert seen["on_cuda_only"] == 0
    assert seen["routed"] == 2 and seen["kernels"] == [False, True]  # o's input, down's SiLU x up
    assert seen["left"] == 2 and seen["silu"] == 0
    torch.testing.assert_close(routed, unrouted, rtol=0, atol=0)


def test_the_norms_before_fp8_products_are_routed_with_their_quantize():
    """The compile's pass gives the RMSNorms before q/k/v and gate/up, with their quantize, the norm-and-quantize ops
    (the second with the residual add after o before it, whose sum the layer's last add then reads from the op), and
    leaves o's and down's quantizes alone; the routed graph computes what the unrouted one does (on the CPU the ops
    are the same torch ops). On the CPU the compile does not route (the pass is asked to here)."""
    import operator

    from kiln.quantization.activation_quant import QUANTIZE_TOKENS
    from kiln.quantization.norm_quantize import add_rms_norm_quantize, rms_norm_quantize, route_norm_quantize

    seen = {}

    def route(gm):
        seen["on_cuda_only"] = route_norm_quantize(gm)
        seen["routed"] = route_norm_quantize(gm, devices=("cpu",))
        seen["again"] = route_norm_quantize(gm, devices=("cpu",))
        calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
        seen["ops"] = [n.target for n in calls if n.target in (rms_norm_quantize, add_rms_norm_quantize)]
        seen["left"] = sum(n.target in QUANTIZE_TOKENS for n in calls)
        seen["norm steps"] = sum(n.target in (torch.rsqrt, "pow", "mean") for n in calls)
        fused_add, = (n for n in calls if n.target is add_rms_norm_quantize)
        seen["sum readers"] = [u.target for u in fused_add.users]
        gm.graph.lint()

    unrouted, routed = tiny_fp8_layer_compiled(), tiny_fp8_layer_compiled(route)
    assert seen["on_cuda_only"] == 0 and seen["routed"] == 2 and seen["again"] == 0
    assert seen["ops"] == [rms_norm_quantize, add_rms_norm_quantize]
    assert seen["left"] == 2 and seen["norm steps"] == 0  # o's and down's quantizes; no norm left unrouted
    assert sorted(seen["sum readers"], key=str).count(operator.getitem) == 3  # q, scale and the sum
    torch.testing.assert_close(routed, unrouted, rtol=0, atol=0)


# Families whose norms before q/k/v and gate/up are Llama's RMSNorm: the pass routes both; the others' (Gemma's
# 1 + weight, Helium's float32 product, LayerNorms, OLMo's and EXAONE's norms after the sublayers) stay Inductor's.
LLAMA_NORM_FAMILIES = {"llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "ministral", "smollm3", "glm4"}


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS))
def test_the_norm_pass_routes_llamas_rms_norm_in_every_family_and_nothing_else(model_type):
    """Each family's FP8 layers traced by Dynamo, the pass asked to route on the CPU, against the eager layer: the
    same output bit for bit (the ops' CPU code is Llama's norm in torch ops, so a norm of another form routed would
    change it), and both norms routed exactly in the families whose norms are Llama's."""
    from compile_service.pipeline import _layer_examples
    from kiln.model.merged_projections import merge_identical_linears
    from kiln.quantization.norm_quantize import route_norm_quantize

    config = TINY | FAMILY_CONFIGS[model_type]
    resolved = resolve(common_pb2.ModelSpec(config_json=json.dumps(config)), "cpu")
    module = build_model(resolved, "cpu", quantization="fp8")
    routed = []

    def backend(gm, example_inputs):
        merge_identical_linears(gm)
        routed.append(route_norm_quantize(gm, devices=("cpu",)))
        return gm.forward

    for step, inputs in _layer_examples(module, resolved, CompileConfig(max_compiled_tokens=64)):
        routed.clear()
        torch._dynamo.reset()
        with torch.no_grad():
            eager = step(*inputs)
            traced = torch.compile(step, backend=backend, fullgraph=True)(*inputs)
        assert routed == [2 if model_type in LLAMA_NORM_FAMILIES else 0]
        assert torch.equal(traced, eager)


def test_the_layers_last_residual_add_is_taken_into_its_fp8_product():
    """The compile's pass gives down's product the residual it is added to (the layer's output), and leaves the add
    after o to Inductor's norm fusion; the fused graph computes what the unfused one does (on the CPU the op adds after
    ``_scaled_mm``, in the same float32). On the CPU the compile does not fuse (the pass is asked to here)."""
    from kiln.quantization.fp8_mm import fp8_mm
    from kiln.quantization.residual_add import fuse_residual_add

    seen = {}

    def fuse(gm):
        seen["on_cuda_only"] = fuse_residual_add(gm)
        seen["fused"] = fuse_residual_add(gm, devices=("cpu",))
        seen["again"] = fuse_residual_add(gm, devices=("cpu",))
        products = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fp8_mm]
        seen["with_residual"] = [str(n.args[2]) for n in products if len(n.args) == 6]

    unfused, fused = tiny_fp8_layer_compiled(), tiny_fp8_layer_compiled(fuse)
    assert seen["on_cuda_only"] == 0 and seen["fused"] == 1 and seen["again"] == 0
    assert len(seen["with_residual"]) == 1 and "down_proj" in seen["with_residual"][0]
    torch.testing.assert_close(fused, unfused, rtol=0, atol=0)


def test_the_70b_preset_fits_an_h200_in_fp8_only(monkeypatch):
    """The memory check before anything is allocated counts FP8 bytes: with the 100 GiB an H200 has left beside a
    KV cache, Llama-3.1-70B's bfloat16 weights (131.4 GiB) are refused, its FP8 ones (67.7 GiB) go on to be built."""
    from kiln.errors import ResourceExhausted
    from kiln.model import causal_lm

    resolved = resolve(common_pb2.ModelSpec(preset="llama-3.1-70b", dtype="bfloat16"), "cpu")
    skeleton = causal_lm._skeleton(resolved)
    monkeypatch.setattr(causal_lm, "available_bytes", lambda device: 100 << 30)
    with pytest.raises(ResourceExhausted, match="take 131.4 GiB, the cuda has 100.0 GiB free"):
        causal_lm._check_fits(skeleton, resolved, "cuda", None)
    causal_lm._check_fits(skeleton, resolved, "cuda", model_quantization.quantization_of(None, "fp8"))
