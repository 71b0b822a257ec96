"""How the GPU tests judge Kiln's greedy tokens: transformers' model in float64 reads Kiln's whole output (teacher
forcing), and at each step the token Kiln chose must be within rounding of the best logit there.

Equality with transformers' own greedy output is not the test: on the H200 transformers' bfloat16 run itself picks
another token than its float32 run where their top two logits are 0.2 apart, and in float32 a tiny random model's
logits moved by up to 0.15 between CUDA runs (on the CPU float32 and float64 differ by 1e-5 on the same model). What
rounding allows is measured, not assumed: transformers' model in Kiln's dtype, with Kiln's weights, reads the same
context, and its largest logit error against float64 at a step bounds how far any two logits can move there.
"""

import copy

import torch

EXACT_TIES = 1e-4  # below this two logits count as equal whatever the rounding measured


def _step_logits(model, prompt: list[int], got: list[int], compared: int) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + got[:compared]], device="cuda")).logits[0].double()
    return logits[len(prompt) - 1:len(prompt) - 1 + compared]


def assert_each_token_near_the_best(served, prompt: list[int], got: list[int], compared: int) -> None:
    """``served``: transformers' model in the dtype Kiln served, with its weights. A token may be below the best
    float64 logit by twice the served dtype's largest logit error at that step (each of two logits moves by at
    most that)."""
    steps = _step_logits(copy.deepcopy(served).double(), prompt, got, compared)
    chosen = steps.gather(1, torch.tensor(got[:compared], device="cuda")[:, None])[:, 0]
    deficits = steps.max(dim=1).values - chosen
    allowed = 2 * (_step_logits(served, prompt, got, compared) - steps).abs().max(dim=1).values + EXACT_TIES
    worst = int(torch.argmax(deficits - allowed))
    assert deficits[worst] <= allowed[worst], (
        f"token {worst} of a {len(prompt)}-token prompt: Kiln's {got[worst]} is {deficits[worst]:.3f} below the best "
        f"float64 logit, where rounding allows {allowed[worst]:.3f}")
