"""``trainer.fp8`` before launch: the recipe, the layout it cannot reproduce, the layer sizes the GPU kernels refuse
(named, all at once; none on CPU, where fp8 is emulated), and the strategy a valid key builds."""

import pytest
from cli_helpers import composed

from lightning_mgpu.cli.build import build_strategy
from lightning_mgpu.cli.errors import ConfigError
from lightning_mgpu.cli.spec import config_problems, run_spec
from lightning_mgpu.cli.validate import check_run


@pytest.mark.parametrize("overrides, fragment", [
    (["trainer.fp8=fp4"], "trainer.fp8='fp4' is not one of torchao's float8 training recipes; choose 'rowwise' or "
                          "'tensorwise', or leave it unset (off)"),
    (["trainer.fp8=rowwise", "model=moe_tiny", "trainer.devices=4", "parallel.context_parallel_size=2",
      "parallel.expert_parallel_size=2"],
     "parallel.expert_parallel_size=2 with parallel.context_parallel_size=2 and trainer.fp8='rowwise' would scale "
     "each context rank's tokens of an expert apart")])
def test_fp8_settings_are_refused_with_their_fix(overrides, fragment):
    problems = config_problems(composed(*overrides))
    assert any(fragment in p for p in problems), problems


SMALL = ["model.dim=40", "model.ffn_hidden=200", "parallel.tensor_parallel_size=2"]


def test_gpu_kernels_refuse_layer_sizes_by_name():
    """On GPUs each layer whose share on a rank is not a multiple of 16 is named with its sizes: at tp2 the
    column-parallel wq holds 40 x 20, the row-parallel w2 100 x 40; on CPU the same run is not refused for them."""
    with pytest.raises(ConfigError) as err:
        check_run(composed(*SMALL, "trainer.accelerator=gpu", "trainer.fp8=rowwise"))
    message = str(err.value)
    for layer, sizes in (("layers.0.attention.wq", "(40, 20)"), ("layers.1.feed_forward.w2", "(100, 40)"),
                         ("output", "(40, ")):
        assert f"trainer.fp8='rowwise': fp8 layer model.{layer}={sizes}" in message, message
    assert "multiples of 16, which fp8 GEMMs on CUDA (torch._scaled_mm) require" in message
    check_run(composed(*SMALL, "trainer.fp8=rowwise"))  # CPU: emulated, any size


def test_the_key_builds_the_precision_plugin():
    spec = run_spec(composed("trainer.fp8=tensorwise", "trainer.precision=bf16-mixed"))
    plugin = build_strategy(spec).precision_plugin
    assert (plugin.precision, plugin.fp8) == ("bf16-mixed", "tensorwise")
    assert build_strategy(run_spec(composed())).precision_plugin.fp8 is None
