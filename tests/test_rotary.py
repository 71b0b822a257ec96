"""The rotary embedding taken into the attention op (kiln.attention.rotary): the op given q and k unrotated and the
tables computes what it computes given them rotated, and the compile's pass gives it exactly transformers' rotation
over the whole head, in every family that has it, on the CPU here (on CUDA the KV write's kernel rotates:
tests/test_attention_triton.py)."""

import json

import pytest
import torch
from test_model_families import FAMILY_CONFIGS, TINY

from kiln.attention.forward_context import AttentionMetadata, ForwardContext, forward_context
from kiln.attention.op import attention
from kiln.attention.rotary import rotate, route_rotary
from kiln.compilation.config import CompileConfig
from kiln.model.causal_lm import build_model
from kiln.model.spec import resolve
from protos import common_pb2

# model_type -> routed rotations per traced region (a kind of layer): none where the family rotates part of the head
# (Phi-3, GLM-4), pairs of neighbours (Cohere 2), in float32 (OLMo 2 and 3, Helium), or a layer kind not at all
# (SmolLM3's and EXAONE 4's layers without positions)
ROUTED = {"llama": [1], "mistral": [1], "qwen2": [1, 1], "qwen3": [1, 1], "gemma": [1], "gemma2": [1, 1],
          "gemma3_text": [1, 1], "granite": [1], "starcoder2": [1], "ministral": [1, 1], "smollm3": [1, 0],
          "exaone4": [1, 0]}


def _tables(tokens: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(tokens, head_dim // 2) * 3
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("in_a_step", [False, True], ids=["no-context", "paged"])
def test_the_op_given_unrotated_q_and_k_and_the_tables_attends_as_given_them_rotated(in_a_step):
    torch.manual_seed(0)
    tokens, head_dim = 5, 16
    q, k, v = torch.randn(tokens, 4, head_dim), torch.randn(tokens, 2, head_dim), torch.randn(tokens, 2, head_dim)
    cos, sin = _tables(tokens, head_dim)
    caches = [torch.zeros(2, 2, 4, 2, head_dim) for _ in range(2)]
    meta = AttentionMetadata(slot_mapping=torch.arange(tokens), query_start_loc=torch.tensor([0, tokens]),
                             seq_lens=torch.tensor([tokens]), block_tables=torch.tensor([[0, 1]]),
                             max_query_len=tokens, num_seqs=1)
    outs = []
    for cache, args in zip(caches, ((q, k, v), (rotate(q, cos, sin), rotate(k, cos, sin), v)), strict=True):
        tables = {"cos": cos, "sin": sin} if args[0] is q else {}
        if in_a_step:
            with forward_context(ForwardContext(kv_caches=[cache], metadata=meta)):
                outs.append(attention(*args, torch.tensor(0), 0.25, **tables))
        else:
            outs.append(attention(*args, torch.tensor(0), 0.25, **tables))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0], caches[1])
    assert not torch.equal(outs[0], attention(q, k, v, torch.tensor(0), 0.25))  # the tables did rotate


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS))
def test_the_pass_routes_transformers_rotation_in_every_family_and_nothing_else(model_type):
    """Each family's layers traced by Dynamo, the pass asked to route on the CPU, against the eager layer: the same
    output bit for bit (the op rotates with transformers' ops in their order, so a rotation of another form routed
    would change it), and routed exactly where the rotation is transformers' over the whole head."""
    from compile_service.pipeline import _layer_examples

    resolved = resolve(common_pb2.ModelSpec(config_json=json.dumps(TINY | FAMILY_CONFIGS[model_type])), "cpu")
    module = build_model(resolved, "cpu")
    routed = []

    def backend(gm, example_inputs):
        routed.append(route_rotary(gm, devices=("cpu",)))
        assert route_rotary(gm, devices=("cpu",)) == 0  # a routed call is not routed again
        return gm.forward

    for step, inputs in _layer_examples(module, resolved, CompileConfig(max_compiled_tokens=64)):
        torch._dynamo.reset()
        with torch.no_grad():
            eager = step(*inputs)
            traced = torch.compile(step, backend=backend, fullgraph=True)(*inputs)
        assert torch.equal(traced, eager)
    assert routed == ROUTED.get(model_type, [0] * len(routed))


def test_the_pass_leaves_the_cpus_graphs_alone():
    """On CUDA only by default: the CPU's compiled layers keep Inductor's rotation."""
    from compile_service.pipeline import _layer_examples

    resolved = resolve(common_pb2.ModelSpec(config_json=json.dumps(TINY | FAMILY_CONFIGS["llama"])), "cpu")
    routed = []

    def backend(gm, example_inputs):
        routed.append(route_rotary(gm))
        return gm.forward

    for step, inputs in _layer_examples(build_model(resolved, "cpu"), resolved, CompileConfig(max_compiled_tokens=64)):
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(step, backend=backend, fullgraph=True)(*inputs)
    assert routed == [0]
