"""How the GPU tests judge Kiln's greedy tokens: transformers' float32 model reads Kiln's whole output (teacher
forcing), and at each step the token Kiln chose must be within rounding of the best logit there.

Equality with transformers' own greedy output in bfloat16 is not the test: on the H200 transformers' bfloat16 run
itself picks another token than its float32 run where their top two logits are 0.2 apart, and Kiln's kernels round
differently. What rounding allows is measured, not assumed: transformers' model in Kiln's dtype reads the same
context, and its largest logit error against float32 at a step bounds how far any two logits can move there. In
float32 only the order of sums differs (and TF32 in the kernels' dot products): 0.032 at most seen on the H200.
"""

import torch

FLOAT32_TOLERANCE = 0.05


def _step_logits(model, prompt: list[int], got: list[int], compared: int) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + got[:compared]], device="cuda")).logits[0].float()
    return logits[len(prompt) - 1:len(prompt) - 1 + compared]


def assert_each_token_near_the_best(reference, prompt: list[int], got: list[int], compared: int,
                                    rounding=None) -> None:
    """``reference``: transformers' float32 model; ``rounding``: the same weights in Kiln's lower dtype, or None
    when Kiln ran in float32. A token may be below the best by twice the rounding model's largest error at that
    step (each of two logits moves by at most that), else by FLOAT32_TOLERANCE."""
    steps = _step_logits(reference, prompt, got, compared)
    chosen = steps.gather(1, torch.tensor(got[:compared], device="cuda")[:, None])[:, 0]
    deficits = steps.max(dim=1).values - chosen
    if rounding is None:
        allowed = torch.full_like(deficits, FLOAT32_TOLERANCE)
    else:
        allowed = 2 * (_step_logits(rounding, prompt, got, compared) - steps).abs().max(dim=1).values
    worst = int(torch.argmax(deficits - allowed))
    assert deficits[worst] <= allowed[worst], (
        f"token {worst} of a {len(prompt)}-token prompt: Kiln's {got[worst]} is {deficits[worst]:.3f} below the best "
        f"float32 logit, where rounding allows {allowed[worst]:.3f}")
