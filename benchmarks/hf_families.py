"""Which ``transformers`` families train as they are, on which layout: each family's tiny random model inside the same
plain LightningModule (``tests/hf_helpers.py``), tensor parallel 2 with sequence parallelism, pipeline parallel 2
(1F1B) and context parallel 2 on two CPU processes, against one process on the same global batches.

Prints one row per family and layout: the first step's global grad norm against one process's (before any update,
so only the split computation differs), the largest loss difference over 3 steps, and the verdict: ``exact`` (both
under 1e-5), ``refused`` (the refusal's first line) or ``differs``. Later steps are not compared in the grad norm:
AdamW's first update is ``lr * g / (|g| + eps)``, so an element whose gradient is near ``eps`` in exact arithmetic
(a key projection's bias, whose gradient is zero: a constant added to every key moves no softmax) moves by the
rounding of a split sum, and the steps after it differ by more than the split computation does.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import transformers  # noqa: E402

import hf_helpers  # noqa: E402
from helpers import in_turn, max_abs_diff  # noqa: E402
from lightning_mgpu.testing import run_distributed  # noqa: E402
from record import recorded  # noqa: E402
from smoke import sized  # noqa: E402

#: family -> its tiny config with the shape ``hf_helpers`` gives (a padding row where the family sets one: in the
#: second half of the vocabulary for some, so that tensor rank 1 holds it).
EXTRA_FAMILIES = {
    "gemma": lambda **kw: transformers.GemmaConfig(pad_token_id=0, **kw),
    "gemma3": lambda **kw: transformers.Gemma3TextConfig(pad_token_id=0, sliding_window=4, **kw),
    "granite": lambda **kw: transformers.GraniteConfig(logits_scaling=4.0, **kw),
    "cohere": lambda **kw: transformers.CohereConfig(pad_token_id=40, **kw),
    "olmo": lambda **kw: transformers.OlmoConfig(pad_token_id=1, **kw),
    "smollm3": lambda **kw: transformers.SmolLM3Config(pad_token_id=60, **kw),
    "starcoder2": lambda **kw: transformers.Starcoder2Config(**kw),
    "glm4": lambda **kw: transformers.Glm4Config(pad_token_id=0, **kw),
    "helium": lambda **kw: transformers.HeliumConfig(pad_token_id=3, **kw),
    "exaone4": lambda **kw: transformers.Exaone4Config(**kw),
    "seed_oss": lambda **kw: transformers.SeedOssConfig(pad_token_id=50, attention_dropout=0.0, residual_dropout=0.0,
                                                        **kw),
    "ernie4_5": lambda **kw: transformers.Ernie4_5Config(pad_token_id=0, **kw),
    "mixtral": lambda **kw: transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **kw),
    "qwen2_moe": lambda **kw: transformers.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                                          shared_expert_intermediate_size=32, **kw),
    "olmoe": lambda **kw: transformers.OlmoeConfig(num_experts=4, num_experts_per_tok=2, **kw),
}
hf_helpers.FAMILIES.update(EXTRA_FAMILIES)
FAMILIES = sized(["llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "olmo2", "qwen3_moe", "deepseek_v3",
                  *EXTRA_FAMILIES], ["gemma2"])
LAYOUTS = sized({"tp2 + SP": dict(tensor_parallel_size=2, sequence_parallel=True),
                 "pp2 1F1B": dict(pipeline_parallel_size=2, num_microbatches=2),
                 "cp2": dict(context_parallel_size=2)},
                {"tp2 + SP": dict(tensor_parallel_size=2, sequence_parallel=True)})
STEPS, TOLERANCE = 3, 1e-5


def fit_or_refusal(rank: int, family: str, layout: dict) -> dict:
    """One family's run on this rank, or the first line of why it was refused."""
    try:
        return hf_helpers.fit_hf(rank, family, 2, steps=STEPS, **layout)
    except ValueError as refused:
        return {"refused": next(line.strip(" -") for line in str(refused).splitlines()[1:2] or [str(refused)])}
    except Exception:  # a failure is a row of the table, not the end of it
        return {"failed": traceback.format_exc().strip().splitlines()[-1]}


def row(family: str, name: str, results: list[dict]) -> str:
    first = results[0]
    if "refused" in first or "failed" in first:
        why = first.get("refused") or first["failed"]
        return f"| {family} | {name} | - | - | {'refused' if 'refused' in first else 'failed'}: {why[:110]} |"
    expected = hf_helpers.single_process(family, hf_helpers.global_batches(results))
    grad = max(abs(r["grad_norms"][0] - expected["grad_norms"][0]) for r in results)
    loss = max(max_abs_diff(r["losses"], expected["losses"]) for r in results)
    verdict = "exact" if max(grad, loss) < TOLERANCE else "differs"
    return f"| {family} | {name} | {grad:.1e} | {loss:.1e} | {verdict} |"


def main() -> None:
    rows = []
    for name, layout in LAYOUTS.items():
        calls = {family: (fit_or_refusal, (family, layout), {}) for family in FAMILIES}
        results = run_distributed(in_turn, 2, calls, timeout=1800)
        rows += [row(family, name, [r[family] for r in results]) for family in FAMILIES]
    print(f"transformers {transformers.__version__}: each family's tiny model, 2 CPU processes against one, "
          f"{STEPS} steps of AdamW")
    print("| family | layout | step-1 grad norm diff | max loss diff | verdict |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    print(f"{sum(r.endswith('| exact |') for r in rows)} of {len(rows)} runs exact")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    with recorded(__file__, "Twenty-four `transformers` families as they are", about=__doc__):
        main()
